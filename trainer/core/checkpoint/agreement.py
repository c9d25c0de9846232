"""What every rank of a checkpoint save or load agrees on, and how a failure is told: in one line.

`SaveErrors` (a failed save is one line on every rank, the temp folder removed), `verify_everywhere` (every
rank checks the manifest and all agree), `agree_on_target` (every rank resumes the same checkpoint) and
`failure_reason`, the one description of a failed read, conversion or write for every backend: a full disk
with the free space and the size needed, an unreadable file by name, or the CheckpointError's own words.
An agreed error (`agree`) is raised on every rank and marked so (`TrainerError.everywhere`): the command
line prints it once, from the main process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import shutil
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch
from accelerate.utils import gather_object

from trainer.atomic_io import disk_bytes, format_bytes, no_space_reason, space_report
from trainer.core.checkpoint import store
from trainer.core.checkpoint.target import ResumeTarget, passed_over
from trainer.errors import CheckpointError, first_line

if TYPE_CHECKING:
    from accelerate import Accelerator

logger = logging.getLogger("trainer")


def agree(acc: Accelerator, problem: str | None) -> None:
    """Every rank raises the same CheckpointError when any rank has a problem (a collective)."""
    problems = [problem] if problem else []
    if acc.num_processes > 1:
        problems = [p for p in gather_object([problem]) if p is not None]
    if problems:
        raise everywhere(CheckpointError(problems[0]))


def everywhere(err: CheckpointError) -> CheckpointError:
    """`err`, marked as raised by every rank alike (the command line prints it from the main process only)."""
    err.everywhere = True
    return err


def _clear_frames(err: BaseException) -> None:
    """Drop the frames of a failed writer, and with them its open file: the space is freed with the folder."""
    chained: BaseException | None = err
    while chained is not None:
        traceback.clear_frames(chained.__traceback__)
        chained = chained.__cause__ or chained.__context__


def failure_reason(err: BaseException, writing: Path) -> str:
    """One line for a failed read, conversion or write of checkpoint files, whatever the backend raised: a full
    disk (named as such however the writer reported it), the file an OSError names, a CheckpointError's own
    words (unreadable files and other models are named where they are read), else the error's first line.
    `writing`: the file or folder being written, named when a full disk's error names none, and looked at when the
    error's words do not tell a full disk (`no_space_reason`: call this before the partial output is removed)."""
    if isinstance(err, CheckpointError):
        return str(err)
    filename = err.filename if isinstance(err, OSError) and err.filename else None
    full = no_space_reason(err, writing)
    if full is not None:
        _clear_frames(err)
        return f"{full} writing {filename or writing}"
    if filename:
        return f"{filename}: {err.strerror}"
    return f"{type(err).__name__}: {first_line(err)}"


def conversion_failure(err: BaseException, path: Path, scratch: Path) -> str:
    """One line for a conversion of checkpoint `path` into `scratch` that failed; removes the scratch. A full disk
    is judged while the scratch is still there (it shows), its free space measured once the scratch is gone."""
    reason = failure_reason(err, scratch)
    shutil.rmtree(scratch, ignore_errors=True)
    if no_space_reason(err) is not None:
        root = scratch.parents[1]  # RUN_DIR/checkpoints/.universal-step_N/universal
        space = space_report(root, disk_bytes(path), estimate="the checkpoint's size")
        return (f"checkpoint {path} could not be converted for this run: {reason}; {space}; the checkpoint is intact: "
                f"free space there, or resume with the layout that wrote it")
    if isinstance(err, CheckpointError):
        return reason
    return f"checkpoint {path} could not be converted for this run ({reason})"


class SaveErrors:
    """The first error of this rank's part of a save; `agree()` (a barrier) makes every rank raise the same
    one-line CheckpointError, so a full disk or a read-only directory on one rank leaves no rank waiting,
    and removes the unfinished temp directory. Earlier checkpoints are never touched by a failed save.

    A full disk is named as such, however the writer reported it (OSError, safetensors' error or torch's
    "unexpected pos"), with the free space once the temp directory is gone and an estimate of the size."""

    def __init__(self, acc: Accelerator, root: Path, tmp: Path):
        self.acc, self.root, self.tmp = acc, root, tmp
        self.error: str | None = None
        self.cause: Exception | None = None

    @contextlib.contextmanager
    def record(self) -> Iterator[None]:
        try:
            yield
        except Exception as err:  # noqa: BLE001 - disk errors surface as OSError, RuntimeError, SafetensorError
            if self.error is None:
                self.error = f"rank {self.acc.process_index}: {self._describe(err)}"
                self.cause = err

    @functools.cached_property
    def previous(self) -> Path | None:
        """What a failure leaves as the latest checkpoint (read only on a failure: the save never renamed its temp
        folder into place)."""
        return store.latest_checkpoint(self.root)

    def _describe(self, err: Exception) -> str:
        reason = failure_reason(err, self.tmp)  # while this rank's part is still there: a full disk shows
        if no_space_reason(err) is not None:
            return f"{reason} ({format_bytes(disk_bytes(self.tmp))} of it written)"
        return reason

    def _space(self) -> str:
        """Free space after the temp directory is removed, and how much the checkpoint needs (estimated)."""
        if self.previous is None:
            return f"{space_report(self.root, None)}, more needed than was written"
        return space_report(self.root, disk_bytes(self.previous), estimate="estimate: the previous checkpoint's size")

    def agree(self) -> None:
        problems = [self.error] if self.error else []
        if self.acc.num_processes > 1:
            problems = [p for p in gather_object([self.error]) if p is not None]
        if not problems:
            return
        if self.acc.is_main_process:
            shutil.rmtree(self.tmp, ignore_errors=True)
        space = ""
        if any(reason in p for p in problems for reason in ("no space left on device", "disk quota exceeded")):
            if self.acc.num_processes > 1:
                self.acc.wait_for_everyone()  # the temp directory is gone before any rank measures
            space = f"; {self._space()}"
        kept = f"the previous checkpoint {self.previous} is intact" if self.previous else "no earlier checkpoint exists"
        raise everywhere(CheckpointError(f"could not save checkpoint {self.tmp.name.removeprefix('.tmp-')} "
                              f"({'; '.join(problems)}){space}; {kept}")) from self.cause


def verify_everywhere(acc: Accelerator, path: Path, check_hashes: bool) -> tuple[dict, str | None]:
    """Verify on every rank (hashes on each node's main rank) and agree: one bad rank fails all.

    Returns (the saved trainer state, None) or ({}, the problem)."""
    saved, problem = {}, None
    try:
        saved = store.verify_checkpoint(path, check_hashes=check_hashes and acc.is_local_main_process)
    except CheckpointError as err:
        problem = str(err)
    if acc.num_processes > 1:
        failed = acc.reduce(torch.tensor(float(problem is not None), device=acc.device), reduction="sum")
        if problem is None and float(failed) > 0:
            problem = f"checkpoint {path} failed verification on another rank"
    return saved, problem


def set_aside_old_checkpoints(acc: Accelerator, root: Path) -> None:
    """run.resume=none in a directory with checkpoints: keep them, but out of this run's way."""
    if acc.is_main_process and store.list_checkpoints(root):
        aside = root.with_name(f"checkpoints.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
        root.rename(aside)
        logger.warning("run.resume=none: the existing checkpoints were moved to %s", aside)
    acc.wait_for_everyone()


def agree_on_target(acc: Accelerator, target: ResumeTarget, check_hashes: bool) -> ResumeTarget:
    """The target every rank resumes. Each rank picked its own (`pick_resume_target`, before a process group
    existed); a checkpoint that one rank refused is refused by all (hashes are read by each node's first
    process only), so all go back to the oldest pick, verified where it was not. A problem on any rank is
    raised on every rank."""
    if acc.num_processes == 1:
        if target.problem is not None:
            raise everywhere(CheckpointError(target.problem))
        return target
    picks = gather_object([(target.path.name if target.path else None, target.problem)])
    problems = [problem for _, problem in picks if problem is not None]
    if problems:
        raise everywhere(CheckpointError(problems[0]))
    names = {name for name, _ in picks}
    if len(names) == 1:
        return target
    if None in names:  # no shared view of the checkpoints: nothing to agree on
        raise everywhere(CheckpointError(f"the processes see different checkpoints: some find none to resume, others "
                                         f"{sorted(n for n in names if n)}; put the run directory on a filesystem "
                                         f"every node shares"))
    order = [p.name for p in target.candidates]
    oldest = max(names, key=lambda n: order.index(n) if n in order else len(order))
    chosen, problem = target, None
    if target.path.name != oldest:
        older = next((p for p in target.candidates if p.name == oldest), target.path.parent / oldest)
        chosen = passed_over(target, target.path, f"checkpoint {target.path} failed verification on another rank")
        try:
            saved = store.verify_checkpoint(older, check_hashes=check_hashes and acc.is_local_main_process)
            chosen = dataclasses.replace(chosen, path=older, saved=MappingProxyType(saved))
        except CheckpointError as err:
            problem = str(err)
    agree(acc, problem)
    return chosen
