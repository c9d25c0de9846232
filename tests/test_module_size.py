"""The training loop stays small enough to read in one sitting: `trainer/core/trainer.py` holds the loop and
delegates the rest (checkpoints, stop signals, evaluation plans, logging) to modules of their own. A change that
grows it past the limit moves something out instead."""

from __future__ import annotations

from pathlib import Path

from conftest import ROOT

LOOP = ROOT / "trainer" / "core" / "trainer.py"
LOOP_MAX_LINES = 400
"""The house rule for core/trainer.py."""


def too_long(path: Path, limit: int) -> str | None:
    """Why `path` breaks the rule (its line count past `limit`), None where it keeps it."""
    lines = len(path.read_text(encoding="utf-8").splitlines())
    return None if lines <= limit else f"{path.relative_to(path.parents[2])} has {lines} lines, past {limit}"


def test_the_line_count_is_checked(tmp_path):
    folder = tmp_path / "trainer" / "core"
    folder.mkdir(parents=True)
    path = folder / "trainer.py"
    path.write_text("x = 1\n" * 400)
    assert too_long(path, LOOP_MAX_LINES) is None
    path.write_text("x = 1\n" * 401)
    assert too_long(path, LOOP_MAX_LINES) == "trainer/core/trainer.py has 401 lines, past 400"


def test_the_training_loop_stays_within_its_line_budget():
    problem = too_long(LOOP, LOOP_MAX_LINES)
    assert problem is None, (f"{problem}: move a concern out of the loop into a module of its own (as "
                             f"preemption.py, checkpoint/, run_plan.py) rather than growing it")
