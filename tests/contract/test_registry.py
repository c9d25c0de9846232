"""The registry: lazy lookup by name, helpful misses, and a family installed from another package."""

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, child_env, run_cmd

from trainer.errors import ConfigError
from trainer.registry import available_tasks, get_task

FAMILY = Path(__file__).resolve().parent / "third_party_family"


def test_miss_lists_available_names():
    with pytest.raises(ConfigError) as err:
        get_task("crystal_propery")
    message = str(err.value)
    assert "crystal_property" in message and "regression" in message and "Did you mean 'crystal_property'" in message


def test_lookup_imports_only_the_family_asked_for():
    code = ("import sys; from trainer.registry import get_task; get_task('regression'); "
            "print(sorted(m for m in sys.modules if m.startswith('trainer.families.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert "trainer.families.regression" in out and "protein_sedd" not in out and "crystals" not in out


def test_core_imports_no_family():
    """Nothing outside trainer/families but the registry names a family: the front ends above a family reach it
    through the registry too (`get_family`)."""
    offenders = []
    for path in (ROOT / "trainer").rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("trainer/families/") or rel == "trainer/registry.py":
            continue
        if "trainer.families." in path.read_text():
            offenders.append(rel)
    assert not offenders


def test_builtin_tasks_are_registered():
    assert {"regression", "protein_sedd", "crystal_property"} <= set(available_tasks())


@pytest.mark.slow
def test_third_party_family_through_entry_point(tmp_path):
    """A package installed elsewhere adds a task through the `trainer.tasks` entry points and trains."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(FAMILY)], check=True, capture_output=True, text=True, timeout=300)
    env = child_env()
    env["PYTHONPATH"] = str(site)
    tasks = run_cmd([sys.executable, "-m", "trainer", "tasks"], env=env).stdout
    assert "tiny_mean" in tasks
    light = ("import sys; from trainer.registry import get_spec; print(get_spec('tiny_mean').presets['tiny'], "
             "'tiny_family.task' in sys.modules, 'torch' in sys.modules)")
    assert run_cmd([sys.executable, "-c", light], env=env).stdout.split()[-2:] == ["False", "False"]
    out, config = tmp_path / "run", tmp_path / "tiny_mean.yaml"
    config.write_text("task:\n  name: tiny_mean\n  preset: tiny\n")
    run_cmd([sys.executable, "-m", "trainer", "train", str(config), f"run.output_dir={out}",
             "log.progress_bar=false", "log.tensorboard=false"], env=env)
    assert (out / "checkpoints" / "latest").is_file()


def test_family_with_missing_dependency_names_its_extra(tmp_path, monkeypatch):
    from trainer import registry

    (tmp_path / "needs_extra").mkdir()
    (tmp_path / "needs_extra" / "__init__.py").write_text("import no_such_dependency_xyz  # noqa: F401\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"no_such_dependency_xyz.*pip install 'sciml-trainer\[needs_extra\]'"):
        registry._import_family("needs_extra", strict=True)
    registry._import_family("needs_extra", strict=False)
    assert "needs_extra" in registry.unavailable_families()
    registry._UNAVAILABLE.clear()


def test_spec_lookup_imports_no_task_module():
    """The config loader, `trainer tasks` and config-help read the light specs: no Task module, no torch."""
    code = ("import sys; from trainer.registry import available_tasks, get_spec; from trainer.config import load_config; "
            "names = available_tasks(); [get_spec(n).config_cls() for n in names]; "
            "load_config(None, ['task.name=protein_sedd', 'task.preset=tiny']); "
            "print(sorted(m for m in sys.modules if m.endswith('.task') or m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "['trainer.task']"


def test_every_builtin_spec_names_the_class_that_implements_it():
    from trainer.registry import get_spec
    from trainer.task import GenerativeTask

    for name in available_tasks():
        spec, cls = get_spec(name), get_task(name)
        assert (cls.name, cls.config_cls, cls.unit, tuple(cls.metrics)) == (name, spec.config_cls, spec.unit, spec.metrics)
        assert cls.presets == dict(spec.presets) and issubclass(cls, GenerativeTask) == spec.generates
        if spec.generates:
            assert cls.sample_config_cls is spec.sample_config_cls


@pytest.fixture
def scratch_registry():
    """Registry state restored after a test that registers its own tasks."""
    from trainer import registry

    saved = dict(registry._SPECS), dict(registry._TASKS), dict(registry._UNAVAILABLE)
    yield registry
    for live, old in zip((registry._SPECS, registry._TASKS, registry._UNAVAILABLE), saved):
        live.clear()
        live.update(old)


def test_family_registered_by_its_class_still_works(tmp_path, monkeypatch, scratch_registry):
    """The older way: an entry point names a module whose Task class is decorated with @register_task(name);
    looking the name up imports it (not fast, but it works), and load_config checks options by building it."""
    import importlib.metadata

    (tmp_path / "legacy_family.py").write_text(
        "from dataclasses import dataclass\n"
        "from trainer import Task, TaskConfig, register_task\n\n"
        "@dataclass\nclass LegacyConfig(TaskConfig):\n    name: str = 'legacy_mean'\n    width: int = 4\n\n"
        "@register_task('legacy_mean')\nclass LegacyTask(Task):\n    config_cls = LegacyConfig\n"
        "    presets = {'tiny': {'task': {'width': 2}}}\n    unit = 'vectors'\n    metrics = ('loss', 'mae')\n"
        "    def __init__(self, cfg, seed=0):\n        super().__init__(cfg, seed)\n"
        "        if cfg.width < 1:\n            raise ValueError('task.width must be >= 1')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = importlib.metadata.EntryPoint(name="legacy_mean", value="legacy_family", group=scratch_registry.ENTRY_POINT_GROUP)
    real = scratch_registry._entry_points
    monkeypatch.setattr(scratch_registry, "_entry_points", lambda: {**real(), "legacy_mean": entry})
    from trainer.config import load_config

    spec = scratch_registry.get_spec("legacy_mean")
    assert spec.unit == "vectors" and spec.metrics == ("loss", "mae") and not spec.generates
    cfg = load_config(None, ["task.name=legacy_mean", "task.preset=tiny"])
    assert cfg.task.width == 2 and cfg.eval.metric == "loss"
    with pytest.raises(ConfigError, match="task 'legacy_mean': task.width must be >= 1"):
        load_config(None, ["task.name=legacy_mean", "task.width=0"])
    assert get_task("legacy_mean").__name__ == "LegacyTask" and "legacy_mean" in available_tasks()
    monkeypatch.delitem(sys.modules, "legacy_family")


def test_a_spec_and_its_class_must_agree(scratch_registry):
    from dataclasses import dataclass

    from trainer.task import SampleConfig, Task, TaskConfig, TaskSpec

    @dataclass
    class Options(TaskConfig):
        name: str = "probe_task"

    spec = scratch_registry.register_spec(TaskSpec(name="probe_task", task=f"{__name__}:Elsewhere", config_cls=Options))
    with pytest.raises(ValueError, match="its spec names"):
        scratch_registry.register_task(spec)(type("Probe", (Task,), {"__module__": __name__}))
    generating = TaskSpec(name="probe_gen", task=f"{__name__}:Probe", sample_config_cls=SampleConfig)
    with pytest.raises(ValueError, match="is not a GenerativeTask"):
        scratch_registry.register_task(generating)(type("Probe", (Task,), {"__module__": __name__}))
    with pytest.raises(ValueError, match="tiny"):
        scratch_registry.register_spec(TaskSpec(name="probe_no_tiny", task="x:Y", presets={"small": {}}))
    with pytest.raises(ValueError, match="already registered"):
        scratch_registry.register_spec(TaskSpec(name="regression", task="x:Y"))


FAMILY_MUST_NOT_IMPORT = ("trainer.api", "trainer.core", "trainer.frontends", "accelerate", "torch.distributed")
"""Above a family in the import graph: the core that plugs it in (and its facade, `trainer.api`), the front ends
built over both, and the distributed layers (model and task code is single-device)."""


def test_families_import_neither_the_core_nor_its_api_nor_distributed_layers():
    """Model and task code is single-device: ranks, gathering and sharding belong to the core, which plugs a family
    in by task name; a family's Python API is a front end (trainer/frontends/) above both."""
    offenders = []
    for path in sorted((ROOT / "trainer" / "families").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        offenders += [f"{rel}:{line}: {module}" for line, module in _imported_modules(rel, path.read_text())
                      if any(module == m or module.startswith(m + ".") for m in FAMILY_MUST_NOT_IMPORT)]
    assert not offenders, "\n".join(offenders)


def test_the_front_ends_sit_above_the_core_and_the_families():
    """The families' Python APIs (ComFormer's, GEARS') live in trainer/frontends and train through `trainer.api`;
    the core imports no front end."""
    from trainer.frontends import crystals, perturbation

    assert callable(crystals.train_from_list) and callable(perturbation.train_multi_gpu)
    for front_end in (crystals, perturbation):
        rel = Path(front_end.__file__).relative_to(ROOT).as_posix()
        assert "trainer.api" in {module for _, module in _imported_modules(rel, Path(front_end.__file__).read_text())}
    for path in sorted((ROOT / "trainer" / "core").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        assert not [m for _, m in _imported_modules(rel, path.read_text()) if m.startswith("trainer.frontends")], rel


FAMILY_MAY_IMPORT = ("trainer.task", "trainer.config", "trainer.errors", "trainer.atomic_io", "trainer.rundir",
                     "trainer.seeding", "trainer.sample_random", "trainer.data", "trainer.registry",
                     "trainer.state_dicts", "trainer.reference_formats")
"""The shared modules a family builds on (each also as a package prefix: `trainer.data.splits`); never the core
or its `trainer.api` facade (FAMILY_MUST_NOT_IMPORT)."""


def _imported_modules(rel_path: str, source: str) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in a file's source, inside functions too (and constant
    `importlib.import_module` / `__import__` names); `from pkg import name` gives `pkg.name` as well (a
    submodule, or a name of the package) and relative imports are resolved against `rel_path`."""
    import ast

    package = rel_path.split("/")[:-1]  # a module's package; for __init__.py the package itself
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) == "import_module" or getattr(node.func, "id", None) == "__import__")):
            found.append((node.lineno, node.args[0].value))
    return found


def _family_may_import(module: str, family: str | None) -> bool:
    import trainer

    if module.split(".")[0] != "trainer":
        return True  # the standard library and third-party packages
    if module == "trainer" or module.removeprefix("trainer.") in trainer.__all__:
        return True  # the package's public names (the task contract, the registry, load_config)
    own = f"trainer.families.{family}" if family else None
    allowed = (*FAMILY_MAY_IMPORT, *((own,) if own else ()))
    return module in ("trainer.families",) or any(module == a or module.startswith(a + ".") for a in allowed)


def test_families_import_only_the_contract_and_shared_modules():
    """A family is single-device model code on the task contract: it imports the shared leaf modules
    (trainer.task, config, errors, atomic_io, rundir, seeding, data, registry, state_dicts, reference_formats) and its
    own package, never
    `trainer.core` or its `trainer.api` facade, the front ends, the sweep, the CLI or another family."""
    offenders = []
    for path in sorted((ROOT / "trainer" / "families").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        parts = rel.split("/")
        family = parts[2] if len(parts) > 3 else None  # trainer/families/<family>/...
        bad = {line: module for line, module in reversed(_imported_modules(rel, path.read_text()))
               if not _family_may_import(module, family)}  # per line the first module named
        offenders += [f"{rel}:{line}: {module}" for line, module in sorted(bad.items())]
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("source, allowed", [
    ("from trainer.core.trainer import Trainer", False), ("import trainer.core.checkpoint.export", False),
    ("from trainer import core", False), ("from trainer.families.crystals import task", False),
    ("import importlib\nimportlib.import_module('trainer.core.launch')", False),
    ("def f():\n    from ...core import checkpoint", False), ("from trainer.sweep import spec", False),
    ("from trainer.api import train", False), ("from trainer.frontends import crystals", False),
    ("from trainer.data.splits import split_indices", True),
    ("from trainer import Task", True), ("from . import readers", True), ("import numpy", True),
    ("from trainer.families.regression.task import RegressionConfig", True),
])
def test_family_import_rule_reads_every_kind_of_import(source, allowed):
    found = _imported_modules("trainer/families/regression/probe.py", source)
    assert all(_family_may_import(name, "regression") for _, name in found) == allowed, (source, found)
