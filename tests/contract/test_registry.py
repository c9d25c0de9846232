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
