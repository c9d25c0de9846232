"""The commands the documentation shows exist: every `trainer ...` line in a shell block of the README and the
getting-started page parses with the CLI's own parser (subcommand and options), every `trainer X` in any page's
shell blocks names a subcommand, and every `make X` names a Makefile target. No mkdocs needed."""

import re
import shlex
from pathlib import Path

import pytest

from trainer.cli import build_parser, parse_args

ROOT = Path(__file__).resolve().parents[1]
FIRST_PAGES = [ROOT / "README.md", ROOT / "docs" / "getting-started.md"]
ALL_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```", re.M | re.S)
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def shell_lines(markdown: str) -> list[str]:
    """The command lines of the fenced shell blocks: continuations joined, comments and prompts dropped."""
    lines = []
    for block in FENCE.finditer(markdown):
        if block["lang"].lower() not in SHELL_LANGS:
            continue
        body = re.sub(r"\\\n\s*", " ", block["body"])
        for line in body.splitlines():
            line = line.strip().removeprefix("$ ")
            try:
                tokens = shlex.split(line, comments=True)
            except ValueError:  # an unbalanced quote: not a command line
                continue
            if tokens:
                lines.append(tokens)
    return lines


def trainer_commands(lines: list[list[str]]) -> list[list[str]]:
    """The argv after `trainer` of each line that runs it: `trainer ...`, `.venv/bin/trainer ...`,
    `python -m trainer ...` and `accelerate launch ... -m trainer ...`."""
    found = []
    for tokens in lines:
        for i, token in enumerate(tokens):
            runs_trainer = token == "trainer" or (i == 0 and token.endswith("/bin/trainer"))
            if runs_trainer and (i == 0 or tokens[i - 1] == "-m"):
                found.append(tokens[i + 1:])
                break
    return found


def make_targets_used(lines: list[list[str]]) -> list[str]:
    """The target of every `make ...` line (after any VAR=value before or after `make`)."""
    targets = []
    for tokens in lines:
        words = [t for t in tokens if not ASSIGNMENT.match(t)]
        if words and words[0] == "make":
            targets.append(next((w for w in words[1:] if not w.startswith("-")), ""))
    return targets


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z0-9_-][A-Za-z0-9_.-]*)\s*:(?!=)", text, re.M))  # .PHONY is no target


def subcommands() -> set[str]:
    parser = build_parser(sweep_arguments=False)
    action = next(a for a in parser._actions if a.dest == "command")  # argparse keeps subparsers here
    return set(action.choices)


def test_shell_block_parsing_finds_trainer_and_make_lines():
    markdown = ("text\n```bash\nmake train   # comment\nCONFIG=x.yaml SAMPLES=0 make train\n"
                "accelerate launch --config_file a.yaml -m trainer sample RUN \\\n    num_samples=4\n"
                "trainer trian configs/x.yaml\n```\n```\ntrainer/\n  api.py\n```\n```python\ntrainer train not_shell\n```\n")
    lines = shell_lines(markdown)
    assert make_targets_used(lines) == ["train", "train"]
    assert trainer_commands(lines) == [["sample", "RUN", "num_samples=4"], ["trian", "configs/x.yaml"]]
    assert "trian" not in subcommands() and "train" in subcommands()


@pytest.mark.parametrize("page", FIRST_PAGES, ids=lambda p: p.name)
def test_first_pages_commands_parse_with_the_cli(page):
    commands = trainer_commands(shell_lines(page.read_text()))
    assert commands, f"{page.name} shows no trainer command"
    for argv in commands:
        try:
            parse_args(argv)
        except SystemExit as err:
            pytest.fail(f"{page.name}: `trainer {' '.join(argv)}` does not parse with trainer.cli (exit {err.code})")


@pytest.mark.parametrize("page", ALL_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_name_existing_subcommands_and_make_targets(page):
    lines = shell_lines(page.read_text())
    known = subcommands()
    for argv in trainer_commands(lines):
        assert argv and argv[0] in known, f"{page.name}: `trainer {' '.join(argv)}`: no such subcommand ({sorted(known)})"
    targets = makefile_targets()
    for target in make_targets_used(lines):
        assert target in targets, f"{page.name}: `make {target}`: no such Makefile target ({sorted(targets)})"
