"""The config stays as loaded: what a run derives from it (batch layout, steps, lr, cadence, metric) is its frozen
RunPlan, logged at start and written to plan.json; nothing under trainer/core assigns into the config."""

import ast
import copy
import dataclasses
import json
import logging
from pathlib import Path

import pytest
import yaml

from trainer.config import config_to_dict, load_config
from trainer.core.batch_plan import plan_batch
from trainer.core.run_plan import build_run_plan
from trainer.errors import ConfigError

CORE = Path(__file__).resolve().parents[2] / "trainer" / "core"
SECTIONS = {"run", "data", "task", "optim", "train", "eval", "ckpt", "log"}


def _is_config(node: ast.AST, aliases: set[str]) -> bool:
    """`cfg`, `self.cfg`, `cfg.<section>` (and deeper), or a name bound to one of them."""
    while isinstance(node, ast.Attribute):
        if node.attr == "cfg" and isinstance(node.value, ast.Name) and node.value.id == "self":
            return True
        node = node.value
    return isinstance(node, ast.Name) and (node.id in aliases or node.id in ("cfg", "config"))


def _mentions_section(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr in SECTIONS and _is_config(n.value, set())
               for n in ast.walk(node))


def _names(target: ast.AST) -> set[str]:
    """The plain names a target binds (`t`, `o, t`), not the objects it stores into (`self.x`)."""
    if isinstance(target, ast.Name):
        return {target.id}
    return {n for e in target.elts for n in _names(e)} if isinstance(target, (ast.Tuple, ast.List)) else set()


def config_assignments(source: str, filename: str = "<source>") -> list[str]:
    """Each `file:line` where `source` assigns into a config (an attribute of cfg / self.cfg / a section of it, a
    name bound to a section, setattr on one)."""
    found = []
    for func in ast.walk(ast.parse(source)):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        aliases: set[str] = set()
        for node in ast.walk(func):  # names bound to a config section: `t = cfg.train`, `for s in (cfg.eval, ...)`
            if isinstance(node, ast.Assign) and _mentions_section(node.value):
                aliases |= {n for t in node.targets for n in _names(t)}
            elif isinstance(node, (ast.For, ast.comprehension)) and _mentions_section(node.iter):
                aliases |= _names(node.target)
        for node in ast.walk(func):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            stores = [n for t in targets for n in ast.walk(t) if isinstance(n, (ast.Attribute, ast.Subscript))
                      and isinstance(n.ctx, ast.Store)]
            if any(_is_config(n.value, aliases) for n in stores) or (
                    isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                    and node.args and _is_config(node.args[0], aliases)):
                found.append(f"{filename}:{node.lineno}")
    return sorted(set(found), key=lambda hit: (hit.rsplit(':', 1)[0], int(hit.rsplit(':', 1)[1])))


def test_the_check_finds_assignments_into_the_config():
    """The patterns the core used to plan with, each found; reading the config and building the plan are not."""
    edits = '''
def plan(cfg, steps):
    t = cfg.train
    t.per_device_batch_size, t.grad_accum_steps = 8, 2
    cfg.train.max_steps = steps
    for section in (cfg.eval, cfg.ckpt):
        section.every_steps = 3
    setattr(cfg.optim, "lr", 0.1)

class Trainer:
    def __init__(self, cfg):
        self.cfg = cfg
        self.cfg.eval.metric = "loss"
'''
    assert config_assignments(edits) == ["<source>:4", "<source>:5", "<source>:7", "<source>:8", "<source>:13"]
    reads = '''
def plan(cfg, batch):
    t = cfg.train
    per_device, accum = t.per_device_batch_size, t.grad_accum_steps
    self.cfg = cfg
    self.plan = build(cfg, batch)
    return per_device * accum
'''
    assert config_assignments(reads) == []


def test_nothing_under_trainer_core_assigns_into_the_config():
    """Nor does the loader, once the dataclasses exist: defaults (eval.metric's too) are merged in as a layer."""
    paths = [*sorted(CORE.rglob("*.py")), CORE.parent / "config.py"]
    found = [hit for path in paths for hit in config_assignments(path.read_text(), str(path.relative_to(CORE.parents[1])))]
    assert found == []


def test_the_plan_turns_epochs_into_steps_and_scales_the_lr():
    cfg = load_config(None, ["run.resume=none", "train.per_device_batch_size=4", "train.global_batch_size=16",
                             "train.epochs=2.5", "eval.every_epochs=1", "ckpt.every_epochs=0.5",
                             "optim.scale_lr=linear", "optim.lr=0.01", "optim.warmup_steps=10"])
    as_loaded = copy.deepcopy(cfg)
    plan = build_run_plan(cfg, plan_batch(cfg, world=2, saved={}), batches_per_epoch=20, metrics=("loss", "mae"))
    assert (plan.per_device_batch_size, plan.grad_accum_steps, plan.batch.global_batch) == (4, 2, 16)
    assert (plan.steps_per_epoch, plan.max_steps, plan.eval_every_steps, plan.ckpt_every_steps) == (10, 25, 10, 5)
    assert (plan.lr, plan.warmup_steps, plan.eval_metric, plan.resume_from) == (pytest.approx(0.02), 20, "loss", None)
    assert cfg == as_loaded
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.max_steps = 3
    with pytest.raises(ConfigError, match="a stream has no epoch length"):
        build_run_plan(cfg, plan.batch, batches_per_epoch=None)


@pytest.mark.usefixtures("fresh_accelerate")
def test_a_run_and_its_resume_on_another_layout_leave_the_config_as_loaded(tmp_path, caplog):
    """A tiny run with epochs and a global batch, then its resume with another accumulation: the config objects
    compare equal before and after, config.yaml is the config as loaded, plan.json and the start log hold the plan."""
    from conftest import reset_accelerate

    from trainer.core.trainer import Trainer

    def run(*overrides):
        cfg = load_config(None, ["task.preset=tiny", f"run.output_dir={tmp_path}", "log.progress_bar=false",
                                 "log.tensorboard=false", "train.per_device_batch_size=8", "eval.every_epochs=1",
                                 *overrides])
        as_loaded = copy.deepcopy(cfg)
        with caplog.at_level(logging.INFO, logger="trainer"):
            trainer = Trainer(cfg)
            assert trainer.fit() == "completed"
        reset_accelerate()
        assert cfg == as_loaded
        assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == config_to_dict(as_loaded)
        assert json.loads((tmp_path / "plan.json").read_text()) == json.loads(json.dumps(trainer.plan.to_dict()))
        return trainer

    first = run("train.global_batch_size=16", "train.epochs=1")
    assert (first.plan.grad_accum_steps, first.plan.max_steps) == (2, first.plan.steps_per_epoch)
    assert any(r.getMessage().startswith(f"plan: {first.plan.max_steps} steps (1 epochs") for r in caplog.records)
    resumed = run("train.grad_accum_steps=1", "train.epochs=2")  # the checkpoint's global batch of 16 is kept
    assert resumed.plan.resume_from is not None and resumed.plan.grad_accum_steps == 2
    assert resumed.plan.batch.changes and resumed.state.step == resumed.plan.max_steps == 2 * first.plan.max_steps
