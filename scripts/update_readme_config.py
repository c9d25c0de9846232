"""Regenerate the config reference tables in README.md from the dataclass docstrings."""

import dataclasses
from pathlib import Path

from trainer.config import describe_config, field_docs
from trainer.registry import get_task

README = Path(__file__).resolve().parents[1] / "README.md"


def task_table(name: str) -> str:
    cfg = get_task(name).config_cls()
    docs = field_docs(type(cfg))
    rows = ["| key | default | meaning |", "|---|---|---|"]
    rows += [f"| `task.{f.name}` | `{getattr(cfg, f.name)!r}` | {docs.get(f.name, '')} |" for f in dataclasses.fields(cfg)]
    return "\n".join(rows)


def replace_between(text: str, start_marker: str, end_marker: str, body: str) -> str:
    start, end = text.index(start_marker), text.index(end_marker)
    return text[:start] + body + text[end:]


text = README.read_text()
text = replace_between(text, "| key | default | meaning |", "\n\n## What one optimizer step does",
                       describe_config("regression"))
text = replace_between(text, "<!-- protein_sedd keys -->", "<!-- end protein_sedd keys -->",
                       "<!-- protein_sedd keys -->\n" + task_table("protein_sedd") + "\n")
README.write_text(text)
print(f"updated {README}")
