"""Regenerate the per-family parts of the docs from the registry: `make docs-config` runs this.

docs/configuration.md holds one table of the core sections (with the regression task's keys, what `trainer
config-help` prints) and one table of `task.*` keys per task of this repository's families, each between
`<!-- NAME keys -->` and `<!-- end NAME keys -->` markers; a task without them gets a section of its own (heading,
family page link, markers) after the last task's. docs/api/specs.md lists the families' spec modules between
`<!-- family specs -->` and `<!-- end family specs -->`. The text around the markers is left as it is.
`--check` writes nothing and exits 1 when a page is not what the registry gives.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

from trainer.config import describe_config, field_docs
from trainer.registry import available_tasks, get_spec

DOCS = Path(__file__).resolve().parents[1] / "docs"
CONFIGURATION = DOCS / "configuration.md"
SPECS = DOCS / "api" / "specs.md"
FAMILIES_PACKAGE = "trainer.families."
"""This repository's families; a family installed from a package of its own is documented there."""


def repository_tasks() -> dict[str, str]:
    """Task name -> the spec module that registers it, for the tasks of this repository's families."""
    modules = {name: get_spec(name).config_cls.__module__ for name in available_tasks()}
    return {name: module for name, module in modules.items() if module.startswith(FAMILIES_PACKAGE)}


def task_table(name: str) -> str:
    """Markdown table of the task's own `task.*` keys (its spec's options dataclass; no torch imported)."""
    cfg = get_spec(name).config_cls()
    docs = field_docs(type(cfg))
    rows = ["| key | default | meaning |", "|---|---|---|"]
    rows += [f"| `task.{f.name}` | `{getattr(cfg, f.name)!r}` | {docs.get(f.name, '')} |" for f in dataclasses.fields(cfg)]
    return "\n".join(rows)


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- {name} keys -->", f"<!-- end {name} keys -->"


def replace_between(text: str, start_marker: str, end_marker: str, body: str) -> str:
    """Put `body` between `start_marker` and `end_marker` in `text` (both must be there)."""
    start, end = text.index(start_marker) + len(start_marker), text.index(end_marker)
    return text[:start] + "\n" + body + "\n" + text[end:]


def new_task_section(name: str, module: str) -> str:
    """The section of a task the page does not have yet: heading, its family's page, its table's markers."""
    family = module.removeprefix(FAMILIES_PACKAGE).split(".")[0]
    start, end = _markers(name)
    return f"### `{name}`\n\nFamily page: [{family}](families/{family}.md).\n\n{start}\n{end}\n"


def render_configuration(text: str) -> str:
    """docs/configuration.md's `text` with the core table and every task's table regenerated (missing sections added
    after the last task's section)."""
    if "<!-- core keys -->" not in text or "<!-- end core keys -->" not in text:
        sys.exit(f"{CONFIGURATION}: no '<!-- core keys -->' ... '<!-- end core keys -->' markers around the core table")
    text = replace_between(text, "<!-- core keys -->", "<!-- end core keys -->", describe_config("regression"))
    for name, module in repository_tasks().items():
        start, end = _markers(name)
        if start not in text or end not in text:
            ends = list(re.finditer(r"<!-- end (\w+) keys -->\n", text))
            at = ends[-1].end() if ends else len(text)
            text = text[:at] + "\n" + new_task_section(name, module) + text[at:]
        text = replace_between(text, start, end, task_table(name))
    return text


def stale_sections(text: str) -> list[str]:
    """Task sections of docs/configuration.md whose task this repository no longer registers."""
    known = {"core", *repository_tasks()}
    return [name for name in re.findall(r"<!-- (\w+) keys -->", text) if name not in known]


def render_specs(text: str) -> str:
    """docs/api/specs.md's `text` with the families' spec modules listed (one mkdocstrings reference each)."""
    start, end = "<!-- family specs -->", "<!-- end family specs -->"
    if start not in text or end not in text:
        sys.exit(f"{SPECS}: no '{start}' ... '{end}' markers around the list of spec modules")
    modules = sorted(set(repository_tasks().values()))
    # Blank lines around each reference: mkdocstrings reads a `:::` line as a block of its own.
    return replace_between(text, start, end, "\n" + "\n\n".join(f"::: {module}" for module in modules) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a page is out of date")
    args = parser.parse_args(argv)
    status = 0
    for page, render in ((CONFIGURATION, render_configuration), (SPECS, render_specs)):
        text = page.read_text()
        new = render(text)
        if new == text:
            print(f"{page}: up to date")
        elif args.check:
            print(f"{page}: out of date: run `make docs-config`")
            status = 1
        else:
            page.write_text(new)
            print(f"updated {page}")
    if stale := stale_sections(CONFIGURATION.read_text()):
        print(f"{CONFIGURATION}: sections of tasks no longer registered (remove them): {', '.join(stale)}")
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
