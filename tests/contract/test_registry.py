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
    """Nothing outside trainer/families (but the registry) names a family."""
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


def test_families_import_neither_torch_distributed_nor_accelerate():
    """Model and task code is single-device: ranks, gathering and sharding belong to the core."""
    import ast

    offenders = []
    for path in (ROOT / "trainer" / "families").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "accelerate" or n.startswith(("accelerate.", "torch.distributed")) for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders


FAMILY_MAY_IMPORT = ("trainer.task", "trainer.config", "trainer.errors", "trainer.atomic_io", "trainer.rundir",
                     "trainer.seeding", "trainer.data", "trainer.registry", "trainer.api")
"""The shared modules a family builds on (each also as a package prefix: `trainer.data.splits`); the core is
reached only through the `trainer.api` facade (training, results, loading a trained model)."""


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


def test_families_import_only_the_contract_shared_modules_and_the_api():
    """A family is single-device model code on the task contract: it imports the shared leaf modules
    (trainer.task, config, errors, atomic_io, rundir, seeding, data, registry), the `trainer.api` facade
    and its own package, never `trainer.core`, the sweep, the CLI or another family."""
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
    ("from trainer.core.trainer import Trainer", False), ("import trainer.core.export", False),
    ("from trainer import core", False), ("from trainer.families.crystals import task", False),
    ("import importlib\nimportlib.import_module('trainer.core.launch')", False),
    ("def f():\n    from ...core import checkpoint", False), ("from trainer.sweep import spec", False),
    ("from trainer.api import train", True), ("from trainer.data.splits import split_indices", True),
    ("from trainer import Task", True), ("from . import readers", True), ("import numpy", True),
    ("from trainer.families.regression.task import RegressionConfig", True),
])
def test_family_import_rule_reads_every_kind_of_import(source, allowed):
    found = _imported_modules("trainer/families/regression/probe.py", source)
    assert all(_family_may_import(name, "regression") for _, name in found) == allowed, (source, found)
