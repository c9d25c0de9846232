"""Regenerate the config key tables of docs/configuration.md from the dataclass docstrings.

The page holds one table of the core sections (with the regression task's keys, what `trainer config-help`
prints) and one table of `task.*` keys per registered task, each between `<!-- NAME keys -->` and
`<!-- end NAME keys -->` markers; the text around them is left as it is. `make docs-config` runs this.
"""

import dataclasses
import sys
from pathlib import Path

from trainer.config import describe_config, field_docs
from trainer.registry import available_tasks, get_spec

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def task_table(name: str) -> str:
    """Markdown table of the task's own `task.*` keys (its spec's options dataclass; no torch imported)."""
    cfg = get_spec(name).config_cls()
    docs = field_docs(type(cfg))
    rows = ["| key | default | meaning |", "|---|---|---|"]
    rows += [f"| `task.{f.name}` | `{getattr(cfg, f.name)!r}` | {docs.get(f.name, '')} |" for f in dataclasses.fields(cfg)]
    return "\n".join(rows)


def replace_between(text: str, name: str, body: str) -> str:
    """Put `body` between the `<!-- name keys -->` and `<!-- end name keys -->` markers of `text`."""
    start_marker, end_marker = f"<!-- {name} keys -->", f"<!-- end {name} keys -->"
    if start_marker not in text or end_marker not in text:
        sys.exit(f"{PAGE}: no '{start_marker}' ... '{end_marker}' markers: add them where the table goes")
    start, end = text.index(start_marker) + len(start_marker), text.index(end_marker)
    return text[:start] + "\n" + body + "\n" + text[end:]


def main() -> None:
    text = PAGE.read_text()
    text = replace_between(text, "core", describe_config("regression"))
    for name in available_tasks():
        text = replace_between(text, name, task_table(name))
    PAGE.write_text(text)
    print(f"updated {PAGE}")


if __name__ == "__main__":
    main()
