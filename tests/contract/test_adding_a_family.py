"""Adding a family from the docs alone: the page's example matches the task contract, its checklist names every
file a family touches, `trainer new-family NAME` writes a skeleton that trains and passes the contract as written
(in this repository and as a package of its own), and the per-family lists (FAMILY_RUNS, the generated doc pages)
come from the registry."""

from __future__ import annotations

import ast
import configparser
import importlib.metadata
import importlib.util
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import (
    FAMILY_RUNS,
    ROOT,
    cli_in_process,
    family_runs,
    reset_accelerate,
    task_cache_dir,
    tiny_configs,
    trainable_families,
)

from trainer.errors import ConfigError
from trainer.registry import available_tasks, get_spec
from trainer.task import Task

PAGE = ROOT / "docs" / "adding-a-family.md"
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


docs_config = load_module(ROOT / "scripts" / "update_docs_config.py", "update_docs_config")


@pytest.fixture
def scratch_registry(monkeypatch):
    """Registry state and imported modules restored after a test that registers families of its own."""
    from trainer import registry

    saved = dict(registry._SPECS), dict(registry._TASKS), dict(registry._UNAVAILABLE)
    modules = set(sys.modules)
    yield registry
    for live, old in zip((registry._SPECS, registry._TASKS, registry._UNAVAILABLE), saved):
        live.clear()
        live.update(old)
    for name in set(sys.modules) - modules:
        if name.startswith(("demo_", "trainer.families.demo_", "test_demo_")):
            del sys.modules[name]
            parent, _, child = name.rpartition(".")
            if parent in sys.modules and hasattr(sys.modules[parent], child):
                delattr(sys.modules[parent], child)


# ------------------------------------------------------------------------------------------------------- the page
def test_page_example_hooks_take_the_arguments_the_core_passes():
    """Each hook the page's Task example defines takes the parameters of trainer.task.Task's hook of that name, in
    order (copied as written, a hook missing one fails at the first step)."""
    checked = []
    for block in PYTHON_BLOCK.findall(PAGE.read_text()):
        for node in ast.walk(ast.parse(block)):
            if not (isinstance(node, ast.ClassDef) and any(getattr(b, "id", None) == "Task" for b in node.bases)):
                continue
            for hook in node.body:
                if isinstance(hook, ast.FunctionDef) and callable(getattr(Task, hook.name, None)):
                    wanted = list(inspect.signature(getattr(Task, hook.name)).parameters)
                    got = [a.arg for a in hook.args.posonlyargs + hook.args.args]
                    assert got == wanted, f"{PAGE.name}: {node.name}.{hook.name}({', '.join(got)}): Task's takes {wanted}"
                    checked.append(hook.name)
    assert {"build_data", "build_model", "loss", "eval_step"} <= set(checked), checked


def test_page_checklist_names_every_file_the_skeleton_touches(tmp_path):
    """The checklist names each file `trainer new-family` writes in this repository (as `<family>`), and the shared
    files a family edits: setup.cfg's entry point (with a reinstall), mkdocs.yml's nav, `make docs-config`."""
    root = fake_repository(tmp_path)
    from trainer.scaffold import new_family

    written = new_family("probe_fam", root).written
    page = PAGE.read_text()
    for path in written:
        named = path.relative_to(root).as_posix().replace("probe_fam", "<family>")
        assert f"`{named}`" in page, f"{PAGE.name} does not name `{named}`"
    for shared in ("`setup.cfg`", "`mkdocs.yml`", "make docs-config", "make setup", "trainer new-family"):
        assert shared in page, f"{PAGE.name} does not name {shared}"


# ---------------------------------------------------------------------------------------------------- the skeleton
def fake_repository(tmp_path: Path) -> Path:
    """A folder laid out as this repository's root (its setup.cfg names the distribution), with no family."""
    root = tmp_path / "repo"
    (root / "trainer" / "families").mkdir(parents=True)
    (root / "setup.cfg").write_text("[metadata]\nname = sciml-trainer\n")
    return root


def run_generated_tests(path: Path, tmp_path: Path) -> list[str]:
    """Import a generated test module and run each of its test functions (tmp_path: a fresh folder each)."""
    module = load_module(path, path.stem)
    ran = []
    for name, test in vars(module).items():
        if name.startswith("test_") and callable(test):
            folder = tmp_path / name
            folder.mkdir()
            try:
                test(**({"tmp_path": folder} if "tmp_path" in inspect.signature(test).parameters else {}))
            finally:
                reset_accelerate()  # what the module's autouse fixture does under pytest
            ran.append(name)
    return ran


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate")
def test_new_family_package_trains_and_passes_the_contract_as_written(tmp_path, monkeypatch, capsys, scratch_registry):
    """Outside this repository `trainer new-family` writes an installable package: its pyproject's entry point
    registers the task, its generated tests (the contract checks included) pass, and its tiny config trains."""
    project = tmp_path / "demo"
    cli_in_process("new-family", "demo_lm", "--dir", str(project))
    printed = capsys.readouterr().out
    assert f"pip install -e {project}" in printed and "reinstall" in printed
    for rel in ("pyproject.toml", "README.md", "demo_lm/__init__.py", "demo_lm/spec.py", "demo_lm/task.py",
                "configs/demo_lm/tiny.yaml", "tests/test_demo_lm.py"):
        assert (project / rel).is_file(), rel

    # Installed as the third-party test family is: importable, found through its declared entry point.
    pyproject = (project / "pyproject.toml").read_text()
    section = pyproject.split('[project.entry-points."trainer.tasks"]\n')[1].split("\n\n")[0]
    assert section.strip() == 'demo_lm = "demo_lm.spec"', section
    monkeypatch.syspath_prepend(str(project))
    entry = importlib.metadata.EntryPoint(name="demo_lm", value="demo_lm.spec", group=scratch_registry.ENTRY_POINT_GROUP)
    real = scratch_registry._entry_points
    monkeypatch.setattr(scratch_registry, "_entry_points", lambda: {**real(), "demo_lm": entry})
    assert "demo_lm" in available_tasks()

    ran = run_generated_tests(project / "tests" / "test_demo_lm.py", tmp_path)
    assert "test_task_contract" in ran and len(ran) >= 3, ran
    run = tmp_path / "cli_run"
    cli_in_process("train", str(project / "configs" / "demo_lm" / "tiny.yaml"), f"run.output_dir={run}",
                   "train.max_steps=3", "log.progress_bar=false", "log.tensorboard=false")
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000003"


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate")
def test_new_family_in_this_repository_is_found_and_listed_without_core_edits(tmp_path, capsys, monkeypatch,
                                                                              scratch_registry):
    """At the repository root it writes trainer/families/NAME, configs/NAME/tiny.yaml, tests/families/NAME and
    docs/families/NAME.md, prints the shared files' lines (entry point, reinstall, nav); the registry finds the
    family, FAMILY_RUNS takes its tiny config, and `make docs-config` adds its table and spec page entry."""
    import trainer.families

    root = fake_repository(tmp_path)
    cli_in_process("new-family", "demo_local", "--dir", str(root))
    printed = capsys.readouterr().out
    for line in ("demo_local = trainer.families.demo_local.spec", "make setup", "families/demo_local.md",
                 "make docs-config"):
        assert line in printed, line
    for rel in ("trainer/families/demo_local/__init__.py", "trainer/families/demo_local/spec.py",
                "trainer/families/demo_local/task.py", "configs/demo_local/tiny.yaml",
                "tests/families/demo_local/test_demo_local.py", "docs/families/demo_local.md"):
        assert (root / rel).is_file(), rel
    assert not (root / "pyproject.toml").exists()

    monkeypatch.setattr(trainer.families, "__path__", [*trainer.families.__path__, str(root / "trainer" / "families")])
    assert "demo_local" in available_tasks() and "demo_local" in trainable_families()
    assert family_runs(root / "configs")["demo_local"] == ("demo_local/tiny.yaml", [])
    assert task_cache_dir("demo_local", tmp_path) == []
    assert get_spec("demo_local").task == "trainer.families.demo_local.task:DemoLocalTask"

    page = (ROOT / "docs" / "configuration.md").read_text()
    generated = docs_config.render_configuration(page)
    section = generated[generated.index("### `demo_local`"):]
    assert "<!-- demo_local keys -->" in section and "| `task.hidden` |" in section and "<!-- end demo_local keys -->" in section
    assert "[demo_local](families/demo_local.md)" in section
    assert docs_config.render_configuration(generated) == generated  # the section is then kept as it is
    specs = docs_config.render_specs((ROOT / "docs" / "api" / "specs.md").read_text())
    assert "::: trainer.families.demo_local.spec" in specs

    ran = run_generated_tests(root / "tests" / "families" / "demo_local" / "test_demo_local.py", tmp_path)
    assert "test_bad_option_is_a_config_error_naming_the_key" in ran


def test_new_family_refuses_bad_names_and_never_overwrites(tmp_path, scratch_registry):
    from trainer.scaffold import new_family

    for name, says in [("Char-LM", "lowercase Python identifier"), ("class", "lowercase Python identifier"),
                       ("regression", "already a registered task"), ("json", "shadow the module")]:
        with pytest.raises(ConfigError, match=says):
            new_family(name, tmp_path / name)
    new_family("demo_once", tmp_path / "once")
    spec = tmp_path / "once" / "demo_once" / "spec.py"
    spec.write_text("# edited\n")
    with pytest.raises(ConfigError, match=r"demo_once.* already exists: new-family .* overwrites nothing"):
        new_family("demo_once", tmp_path / "once")
    assert spec.read_text() == "# edited\n"


def test_new_family_goes_into_the_repository_it_is_run_in_else_into_a_folder_of_its_name(tmp_path, monkeypatch):
    from trainer.scaffold import new_family

    root = fake_repository(tmp_path)
    monkeypatch.chdir(root)
    made = new_family("demo_here")
    assert made.in_repository and made.root == root and (root / "trainer" / "families" / "demo_here" / "spec.py").is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    made = new_family("demo_there")
    assert not made.in_repository and (elsewhere / "demo_there" / "pyproject.toml").is_file()


# ------------------------------------------------------------------------------------- the lists from the registry
def test_every_family_has_one_tiny_config():
    """FAMILY_RUNS (the 2-process, DeepSpeed and GPU tests of every family) is each family's tiny config: a family
    without one is named with what to add."""
    configs = tiny_configs()
    problems = []
    for name in trainable_families():
        found = configs.get(name, [])
        if not found:
            problems.append(f"task '{name}' has no tiny config: add configs/<family>/tiny.yaml (task: {{name: {name}, "
                            f"preset: tiny}}) for FAMILY_RUNS in tests/conftest.py")
        elif len(found) > 1:
            problems.append(f"task '{name}' has several tiny configs {found}: keep one tiny.yaml or *_tiny.yaml")
    assert not problems, "\n".join(problems)
    assert sorted(FAMILY_RUNS) == trainable_families()
    assert FAMILY_RUNS["crystal_property"][0] == "crystals/comformer_tiny.yaml"


def test_cache_dir_is_passed_where_the_task_has_one(tmp_path):
    assert task_cache_dir("regression", tmp_path) == []
    assert task_cache_dir("protein_sedd", tmp_path) == [f"task.cache_dir={tmp_path}"]


def test_every_family_in_this_repository_has_its_entry_point():
    """setup.cfg's `trainer.tasks` names each family's spec module (the registry would find it without one, by
    importing every family's spec: the entry point keeps a lookup to one module)."""
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    declared = {line.split("=")[1].strip() for line in parser["options.entry_points"]["trainer.tasks"].splitlines()
                if "=" in line}
    modules = {get_spec(name).config_cls.__module__ for name in trainable_families()}
    assert not modules - declared, f"setup.cfg [options.entry_points] trainer.tasks lacks {sorted(modules - declared)}"


def test_generated_pages_list_the_registered_families():
    """docs/configuration.md's task tables and docs/api/specs.md's spec modules are what `make docs-config` makes
    from the registry today."""
    for page, render in [(ROOT / "docs" / "configuration.md", docs_config.render_configuration),
                         (ROOT / "docs" / "api" / "specs.md", docs_config.render_specs)]:
        text = page.read_text()
        assert render(text) == text, f"{page.relative_to(ROOT)} is not what the registry gives: run `make docs-config`"


def test_make_train_gives_configs_of_the_same_name_their_own_run_folders():
    def run_dir(config: str) -> str:
        return subprocess.run(["make", "-s", "--no-print-directory", "--eval", "print-run-dir: ; @echo $(RUN_DIR)",
                               "print-run-dir", f"CONFIG={config}"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()

    assert run_dir("configs/char_lm/tiny.yaml") != run_dir("configs/regression/tiny.yaml")
    assert run_dir("configs/regression/tiny.yaml") == "runs/regression/tiny"
    assert run_dir("configs/protein_sedd/sedd_tiny.yaml") == "runs/protein_sedd/sedd_tiny"
