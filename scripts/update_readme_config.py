"""Regenerate the config reference table in README.md from the dataclass docstrings."""

from pathlib import Path

from trainer.config import describe_config

README = Path(__file__).resolve().parents[1] / "README.md"
HEADER = "| key | default | meaning |"
NEXT_SECTION = "\n\n## What one optimizer step does"

text = README.read_text()
start, end = text.index(HEADER), text.index(NEXT_SECTION)
README.write_text(text[:start] + describe_config("regression") + text[end:])
print(f"updated {README}")
