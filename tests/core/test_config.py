import dataclasses

import pytest
import yaml

from trainer.config import Config, ConfigError, config_from_dict, describe_config, field_docs, load_config, save_config
from trainer.registry import get_task


def write(tmp_path, data):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_precedence_cli_over_yaml_over_preset_over_defaults(tmp_path):
    path = write(tmp_path, {"task": {"name": "regression", "preset": "tiny", "hidden": 48},
                            "train": {"max_steps": 7}})
    cfg = load_config(path, ["train.max_steps=9", "optim.lr=0.5"])
    assert cfg.train.max_steps == 9          # CLI beats YAML
    assert cfg.task.hidden == 48             # YAML beats preset (tiny sets 32)
    assert cfg.task.num_train == 256         # preset beats default (512)
    assert cfg.train.per_device_batch_size == 8  # preset
    assert cfg.optim.lr == 0.5
    assert cfg.eval.mode == "min"            # default


def test_unknown_key_names_close_matches(tmp_path):
    path = write(tmp_path, {"train": {"max_step": 3}})
    with pytest.raises(ConfigError, match=r"unknown config key 'train.max_step'.*train.max_steps"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"'optim.lrr'.*command line.*optim.lr"):
        load_config(None, ["optim.lrr=1"])
    with pytest.raises(ConfigError, match=r"unknown config key 'trian.max_steps'"):
        load_config(None, ["trian.max_steps=1"])


def test_wrong_type_and_bad_choice(tmp_path):
    with pytest.raises(ConfigError, match=r"train.max_steps.*command line"):
        load_config(None, ["train.max_steps=many"])
    with pytest.raises(ConfigError, match=r"mixed_precision.*\['no', 'bf16', 'fp16'\]"):
        load_config(None, ["train.mixed_precision=fp8"])
    with pytest.raises(ConfigError, match=r"scale_lr"):
        load_config(None, ["optim.scale_lr=cubic"])
    with pytest.raises(ConfigError, match="must look like"):
        load_config(None, ["train.max_steps"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_unknown_task_lists_available():
    with pytest.raises(ConfigError, match=r"unknown task 'regresion'.*available tasks: .*regression"):
        load_config(None, ["task.name=regresion"])
    with pytest.raises(ConfigError, match="no preset 'huge'"):
        load_config(None, ["task.preset=huge"])


def test_resolved_config_roundtrip(tmp_path):
    cfg = load_config(None, ["task.preset=tiny", "optim.betas=[0.8,0.9]"])
    save_config(cfg, tmp_path / "config.yaml")
    again = config_from_dict(yaml.safe_load((tmp_path / "config.yaml").read_text()))
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg)


def test_every_field_is_documented():
    table = describe_config("regression")
    for section in dataclasses.fields(Config):
        obj = section.default_factory()
        if section.name == "task":
            obj = get_task("regression").config_cls()
        docs = field_docs(type(obj))
        for f in dataclasses.fields(obj):
            assert docs.get(f.name), f"{section.name}.{f.name} has no docstring"
            assert f"`{section.name}.{f.name}`" in table


@pytest.mark.parametrize("text, match", [
    ("", r"is empty"),
    ("task: regression\n", r"(?s)section 'task'.*must be a mapping.*got str 'regression'.*task:\n  name: regression"),
    ("task: null\n", r"section 'task'.*must be a mapping.*got NoneType"),
    ("train: 5\n", r"section 'train'.*must be a mapping"),
])
def test_bad_yaml_shapes_are_one_line_errors(tmp_path, text, match):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(path)


@pytest.mark.parametrize("override, match", [
    ("optim.lr=nan", r"optim.lr.*finite"), ("optim.lr=-1e-3", r"optim.lr.*>= 0"), ("optim.lr=.inf", r"optim.lr.*finite"),
    ("optim.scheduler=cosin", r"unknown scheduler 'cosin'.*Did you mean 'cosine'"),
    ("eval.metric=accuracy", r"eval.metric='accuracy' is not a metric of task 'regression'.*loss, mae"),
    ("task=regression", r"section 'task'.*command line.*mapping"),
    ("ckpt.async_cpu_share=0", r"ckpt.async_cpu_share.*\(0, 1\]"),
])
def test_bad_values_fail_at_config_time(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_missing_resume_path_fails_at_config_time(tmp_path):
    with pytest.raises(ConfigError, match=r"run.resume=.*no such checkpoint"):
        load_config(None, [f"run.resume={tmp_path / 'nope'}"])


def test_unknown_task_key_lists_the_tasks_real_keys():
    with pytest.raises(ConfigError, match=r"unknown config key 'task.train_file'.*Valid keys in 'task':.*data_path"):
        load_config(None, ["task.name=protein_sedd", "task.train_file=x.fasta"])


def test_task_options_are_checked_at_config_time_and_metric_defaults_to_the_tasks():
    with pytest.raises(ConfigError, match=r"task 'crystal_property': task.graph must be one of"):
        load_config(None, ["task.name=crystal_property", "task.graph=knm"])
    assert load_config(None, ["task.name=crystal_property"]).eval.metric == "mae"
    assert load_config(None, []).eval.metric == "loss"


def test_dict_fields_take_any_keys_and_sections_stay_strict():
    """A field typed `dict` holds the user's own keyword arguments (e.g. a force field's); a typo in a
    section's own keys is still an error with a suggestion."""
    from dataclasses import dataclass, field

    from trainer.config import parse_options

    @dataclass
    class Inner:
        name: str = "x"
        kwargs: dict = field(default_factory=dict)

    @dataclass
    class Options:
        inner: Inner = field(default_factory=Inner)

    options = parse_options(Options, ["inner.kwargs={workers: 2}", "inner.kwargs.model=7net-0"])
    assert options.inner.kwargs == {"workers": 2, "model": "7net-0"}
    with pytest.raises(ConfigError, match="Did you mean: inner.name"):
        parse_options(Options, ["inner.nme=y"])


def test_scheduler_names_are_transformers_and_step():
    """The config checks optim.scheduler against its own list (no transformers import); it is transformers'."""
    from transformers import SchedulerType

    from trainer.config import SCHEDULERS

    assert set(SCHEDULERS) == {s.value for s in SchedulerType} | {"step", "onecycle"}


def test_step_scheduler_decays_every_epoch_like_steplr():
    """optim.scheduler=step (GEARS' StepLR per epoch): epochs resolve to steps, the lr halves at each."""
    import torch

    from trainer.core.batch_plan import plan_batch
    from trainer.core.optim import build_scheduler
    from trainer.core.run_plan import build_run_plan

    def plan(cfg, batches_per_epoch=None):
        return build_run_plan(cfg, plan_batch(cfg, world=1, saved={}), batches_per_epoch)

    cfg = load_config(None, ["optim.scheduler=step", "optim.decay_every_epochs=1", "optim.decay_gamma=0.5",
                             "train.epochs=3", "optim.lr=1.0"])
    run = plan(cfg, batches_per_epoch=4)
    assert run.decay_every_steps == 4 and run.max_steps == 12
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_scheduler(cfg, optimizer, run)
    lrs = []
    for _ in range(12):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert lrs == [1.0] * 4 + [0.5] * 4 + [0.25] * 4
    with pytest.raises(ConfigError, match="decay_every_steps"):
        cfg = load_config(None, ["optim.scheduler=step"])
        build_scheduler(cfg, optimizer, plan(cfg))


@pytest.mark.parametrize("name", ["constant", "constant_with_warmup", "linear", "cosine"])
def test_native_schedules_match_transformers(name):
    """The common schedules are built without importing transformers (a second of every process start): same
    factors as transformers.get_scheduler at every step, warm-up and past the end included."""
    import torch
    from transformers import get_scheduler

    from trainer.core.optim import native_schedule

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    reference = get_scheduler(name, optimizer, num_warmup_steps=5, num_training_steps=23)
    ours = native_schedule(name, warmup_steps=5, total_steps=23)
    for step in range(30):
        assert ours(step) == pytest.approx(reference.lr_lambdas[0](step), abs=1e-12), step
    assert native_schedule("polynomial", 5, 23) is None  # the others still come from transformers


def test_deepspeed_refuses_value_clipping_and_says_what_to_add():
    """GEARS' preset clips by value (as GEARS does); DeepSpeed clips by norm only. The refusal names the value, where
    it may come from and the overrides that run it."""
    from accelerate.utils import DistributedType
    from conftest import ROOT

    from trainer.core.engine import check_backend_supports

    gears_tiny = ROOT / "configs" / "perturbation_gears" / "gears_tiny.yaml"
    cfg = load_config(gears_tiny)
    assert cfg.train.grad_clip_value == 1.0
    with pytest.raises(ConfigError) as err:
        check_backend_supports(cfg, DistributedType.DEEPSPEED)
    message = str(err.value)
    assert "train.grad_clip_value=1 (from the command line, the config, or task preset 'tiny')" in message
    assert "add train.grad_clip_value=0 train.grad_clip_norm=1" in message
    check_backend_supports(cfg, DistributedType.MULTI_CPU)  # DDP clips by value itself
    fixed = load_config(gears_tiny, ["train.grad_clip_value=0", "train.grad_clip_norm=1"])
    check_backend_supports(fixed, DistributedType.DEEPSPEED)


def test_a_missing_config_file_names_the_nearest_ones(tmp_path):
    (tmp_path / "regression").mkdir()
    (tmp_path / "regression" / "tiny.yaml").write_text("task: {name: regression}\n")
    with pytest.raises(ConfigError, match=r"not found: .*regresion/tiny\.yaml; did you mean .*regression/tiny\.yaml\?"):
        load_config(tmp_path / "regresion" / "tiny.yaml")
    with pytest.raises(ConfigError, match=r"did you mean .*regression/tiny\.yaml\?"):
        load_config(tmp_path / "regression" / "tiny.yml")
    with pytest.raises(ConfigError, match=r"not found: [^;]*$"):
        load_config(tmp_path / "elsewhere" / "other.yaml")


def test_a_string_key_takes_its_value_as_written(tmp_path):
    """YAML reads `no` as false and `1.50` as 1.5; a key typed str (mixed_precision's documented `no`) takes the
    text as written, from the command line and the YAML file alike. Keys of other types keep YAML's reading."""
    from dataclasses import dataclass

    from trainer.config import parse_options

    cfg = load_config(None, ["train.mixed_precision=no", "run.output_dir=1.50", "run.init_weights=auto",
                             "train.compile=no", "optim.lr=1e-3", "ckpt.every_seconds=0x10"])
    assert cfg.train.mixed_precision == "no" and cfg.run.output_dir == "1.50"
    assert cfg.train.compile is False and cfg.optim.lr == 0.001 and cfg.ckpt.every_seconds == 16.0
    path = tmp_path / "c.yaml"
    path.write_text("run:\n  output_dir: 0123\n  resume: 'none'\ntrain:\n  mixed_precision: no\n  compile: no\n")
    cfg = load_config(path)
    assert (cfg.train.mixed_precision, cfg.run.output_dir, cfg.run.resume, cfg.train.compile) == ("no", "0123", "none",
                                                                                                   False)
    with pytest.raises(ConfigError, match=r"'train.mixed_precision' must be one of \['no', 'bf16', 'fp16'\], got 'off'"):
        load_config(None, ["train.mixed_precision=off"])

    @dataclass
    class SampleOptions:
        out: str = "samples.fasta"
        temperature: float = 1.0

    options = parse_options(SampleOptions, ["out=2024", "temperature=0.5"])
    assert options.out == "2024" and options.temperature == 0.5
    assert parse_options(SampleOptions, ["out=off"]).out == "off"


REPLACING = {"train.max_steps": ("train.epochs", "3", 2.0), "eval.every_steps": ("eval.every_epochs", "2", 0.5),
             "ckpt.every_steps": ("ckpt.every_epochs", "2", 1.0),
             "optim.decay_every_steps": ("optim.decay_every_epochs", "5", 1.0),
             "train.grad_accum_steps": ("train.global_batch_size", "2", 64)}
"""A key, the key that replaces it when set (> 0) with the value the YAML gives it, and the command line's value."""


@pytest.mark.parametrize("key", list(REPLACING))
def test_a_command_line_key_wins_over_the_yaml_key_that_would_replace_it(tmp_path, caplog, key):
    """train.max_steps=3 typed on the command line trains 3 steps although the YAML sets train.epochs (which
    replaces max_steps when > 0): the replacing key is cleared, in one line that says so. Both in one layer: the
    replacing key wins, as its help says."""
    import logging

    replacing, typed, given = REPLACING[key]
    section, name = replacing.split(".")
    path = write(tmp_path, {"task": {"name": "regression"}, section: {name: given}})
    with caplog.at_level(logging.INFO, logger="trainer"):
        cfg = load_config(path, [f"{key}={typed}"])
    got = dict(dataclasses.asdict(cfg))
    assert got[section][name] == 0
    assert str(got[key.split(".")[0]][key.split(".")[1]]) == typed
    lines = [r.getMessage() for r in caplog.records if replacing in r.getMessage()]
    assert len(lines) == 1 and f"{key}={typed} (from command line)" in lines[0] and str(path) in lines[0], lines
    save_config(cfg, tmp_path / "config.yaml")  # the run directory's config says what the run trains with
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())[section][name] == 0

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainer"):
        both = load_config(None, [f"{replacing}={given}", f"{key}={typed}"])
        from_yaml = load_config(path, [f"{replacing}={given}"])
    assert getattr(getattr(both, section), name) == given and getattr(getattr(from_yaml, section), name) == given
    assert not [r for r in caplog.records if replacing in r.getMessage()]


def test_a_command_line_zero_switches_no_replacing_key_off(tmp_path, caplog):
    """0 is a step key's "not set": `eval.every_steps=0` typed over a YAML's eval.every_epochs leaves the epochs'
    cadence in force and says nothing (only a value that replaces wins)."""
    import logging

    path = write(tmp_path, {"task": {"name": "regression"}, "eval": {"every_epochs": 5}, "train": {"epochs": 2}})
    with caplog.at_level(logging.INFO, logger="trainer"):
        cfg = load_config(path, ["eval.every_steps=0"])
    assert cfg.eval.every_epochs == 5 and cfg.train.epochs == 2
    assert not [r for r in caplog.records if "wins over" in r.getMessage()]


def test_a_null_for_a_text_key_stays_null(tmp_path):
    """`run.init_from=null` is no value, not the text 'null' (a run directory named null): refused as such."""
    with pytest.raises(ConfigError, match="bad value for config key 'run.init_from'.*None"):
        load_config(None, ["task.name=regression", "run.init_from=null"])


def test_the_yaml_wins_over_a_preset_key_that_would_replace_it(tmp_path, monkeypatch):
    from trainer.registry import get_spec

    spec = get_spec("regression")
    monkeypatch.setitem(spec.presets, "epochs", {"train": {"epochs": 2.0}})
    path = write(tmp_path, {"task": {"name": "regression", "preset": "epochs"}, "train": {"max_steps": 7}})
    cfg = load_config(path)
    assert (cfg.train.max_steps, cfg.train.epochs) == (7, 0)
    cfg = load_config(write(tmp_path, {"task": {"name": "regression", "preset": "epochs"}}))
    assert cfg.train.epochs == 2.0
