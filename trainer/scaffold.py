"""`trainer new-family NAME [--dir PATH]`: write a model family's skeleton that trains and passes the task contract
as written.

At this repository's root (PATH, by default the current folder, holds the `sciml-trainer` setup.cfg and
trainer/families/) the family goes where docs/adding-a-family.md lists its files: its package under
trainer/families/NAME, configs/NAME/tiny.yaml, tests/families/NAME/ and docs/families/NAME.md; the lines for the
shared files (setup.cfg's entry point, mkdocs.yml's nav) are printed, not edited in. Anywhere else PATH (by default
./NAME) becomes a package of its own that declares its entry point in pyproject.toml, with the same config, tests
and a README. Nothing existing is overwritten. The skeleton (a small MLP on synthetic data, with a loss that draws
its noise from the sample's `rng`) comes from the templates in trainer/scaffold_templates/.
"""

from __future__ import annotations

import configparser
import importlib.util
import keyword
import re
from dataclasses import dataclass
from pathlib import Path
from string import Template

from trainer.errors import ConfigError

TEMPLATES = Path(__file__).resolve().parent / "scaffold_templates"
DISTRIBUTION = "sciml-trainer"
"""This repository's distribution name (its setup.cfg's `[metadata] name`), how a checkout is recognised."""
FAMILIES_DIR = Path("trainer", "families")
"""Where this repository keeps its families, relative to its root."""


@dataclass(frozen=True)
class NewFamily:
    """What `new_family` wrote and what is left to do by hand."""

    root: Path
    """The repository root, or the new package's project folder."""
    in_repository: bool
    written: list[Path]
    next_steps: list[str]


def is_repository_root(path: Path) -> bool:
    """Whether `path` is a checkout of this repository (its setup.cfg names the distribution; it has trainer/families)."""
    setup = path / "setup.cfg"
    if not (setup.is_file() and (path / FAMILIES_DIR).is_dir()):
        return False
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(setup)
    return parser.get("metadata", "name", fallback="") == DISTRIBUTION


def class_prefix(name: str) -> str:
    """`char_lm` -> `CharLm`: the prefix of the family's class names."""
    return "".join(part.capitalize() for part in name.split("_") if part)


def _check_name(name: str, in_repository: bool) -> None:
    from trainer.registry import available_tasks

    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or keyword.iskeyword(name):
        raise ConfigError(f"family name {name!r}: use a lowercase Python identifier (letters, digits, _), e.g. char_lm")
    if name in available_tasks():
        raise ConfigError(f"family name {name!r} is already a registered task (`trainer tasks` lists them)")
    if not in_repository and importlib.util.find_spec(name) is not None:
        raise ConfigError(f"family name {name!r}: a package of that name would shadow the module {name} "
                          f"that this environment already imports; pick another name")


def _layout(name: str, root: Path, in_repository: bool) -> dict[str, Path]:
    """Template -> the file it becomes, relative to `root`."""
    if in_repository:
        package_dir, tests, page = FAMILIES_DIR / name, Path("tests", "families", name), Path("docs", "families", f"{name}.md")
    else:
        package_dir, tests, page = Path(name), Path("tests"), Path("README.md")
    files = {"__init__.py.tmpl": package_dir / "__init__.py", "spec.py.tmpl": package_dir / "spec.py",
             "task.py.tmpl": package_dir / "task.py", "tiny.yaml.tmpl": Path("configs", name, "tiny.yaml"),
             "test_family.py.tmpl": tests / f"test_{name}.py", "family.md.tmpl": page}
    if not in_repository:
        files["pyproject.toml.tmpl"] = Path("pyproject.toml")
    return files


def _values(name: str, files: dict[str, Path], in_repository: bool) -> dict[str, str]:
    package_dir = files["spec.py.tmpl"].parent
    test_file = files["test_family.py.tmpl"]
    if in_repository:
        contract = {"contract_note": "tests/contract/test_contract.py runs the task contract of trainer/task.py on it\n"
                                     "(train, resume, evaluate, export) with every other task.",
                    "testing_imports": "reset_accelerate", "contract_test": "",
                    "contract_row": "; tests/contract/ runs the task contract on it"}
    else:
        contract = {"contract_note": "`test_task_contract` runs the task contract of trainer/task.py on it\n"
                                     "(train, resume, evaluate, export).",
                    "testing_imports": "check_task_contract, reset_accelerate",
                    "contract_test": ("\n\n\ndef test_task_contract(tmp_path):\n"
                                      f'    check_task_contract("{name}", tmp_path)'),
                    "contract_row": ", and the task contract (`trainer.testing.check_task_contract`)"}
    return {"name": name, "cls": class_prefix(name), "package": ".".join(package_dir.parts),
            "package_dir": package_dir.as_posix(), "config": files["tiny.yaml.tmpl"].as_posix(),
            "tests": test_file.as_posix(), "depth": str(len(test_file.parts) - 1),
            "distribution": name.replace("_", "-"),
            "entry_point_file": "setup.cfg" if in_repository else "pyproject.toml", **contract}


def _next_steps(name: str, root: Path, values: dict[str, str], in_repository: bool) -> list[str]:
    if in_repository:
        return [
            f"setup.cfg, [options.entry_points] trainer.tasks: add the line `{name} = {values['package']}.spec`, then "
            f"reinstall so that the entry point is seen: make setup (or pip install --no-build-isolation -e . in your "
            f"own environment)",
            f"mkdocs.yml, nav, under `Model families`: `- {name}: families/{name}.md`",
            "make docs-config   (its task.* table on docs/configuration.md, its spec on docs/api/specs.md)",
            f".venv/bin/python -m pytest {values['tests']} tests/contract -k {name}",
            f"make train CONFIG={values['config']} SAMPLES=0   (in runs/{name}/tiny)",
            "the checklist of every file a family touches: docs/adding-a-family.md",
        ]
    return [
        f"pip install -e {root}   (its pyproject.toml declares the trainer.tasks entry point; reinstall after "
        f"changing it)",
        f"trainer tasks   (lists {name})",
        f"python -m pytest {root / values['tests']}",
        f"trainer train {root / values['config']}",
    ]


def new_family(name: str, directory: str | Path | None = None) -> NewFamily:
    """Write family `name`'s skeleton: into this repository when `directory` (default: the current folder) is its
    root, else as a package of its own in `directory` (default: ./NAME). Refuses a name that is no lowercase
    identifier, is registered already or (for a package) shadows an importable module, and any file that exists."""
    here = Path.cwd()
    if directory is None:
        root = here if is_repository_root(here) else here / name
    else:
        root = Path(directory).resolve()
    in_repository = is_repository_root(root)
    _check_name(name, in_repository)
    files = _layout(name, root, in_repository)
    existing = [root / rel for rel in files.values() if (root / rel).exists()]
    if existing:
        raise ConfigError(f"{existing[0]} already exists: new-family writes a new family and overwrites nothing")
    values = _values(name, files, in_repository)
    written = []
    for template, rel in files.items():
        text = Template((TEMPLATES / template).read_text()).substitute(values)
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return NewFamily(root=root, in_repository=in_repository, written=written,
                     next_steps=_next_steps(name, root, values, in_repository))
