"""What every rank of a checkpoint save or load agrees on, and how a failure is told: in one line.

`SaveChannel` (the collectives of a save: one agreement per save in the loop, on a gloo group of its own),
`SaveErrors` (a failed save is one line on every rank, the temp folder removed), `verify_everywhere` (every
rank checks the manifest and all agree), `agree_on_target` (every rank resumes the same checkpoint) and
`failure_reason`, the one description of a failed read, conversion or write for every backend: a full disk
or quota with the free space and the size needed, an I/O error or an unreadable file by name, or the
CheckpointError's own words.
An agreed error (`agree`) is raised on every rank and marked so (`TrainerError.everywhere`): the command
line prints it once, from the main process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
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
import torch.distributed as dist
from accelerate.utils import gather_object
from torch.distributed.constants import default_pg_timeout

from trainer.core.checkpoint import store
from trainer.core.checkpoint.target import ResumeTarget, passed_over
from trainer.disk_space import (
    NO_SPACE,
    OUT_OF_SPACE,
    QUOTA,
    disk_bytes,
    disk_verdict,
    format_bytes,
    no_space_reason,
    space_report,
)
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
    disk, an exceeded quota, an I/O error or a stale NFS handle (each named as such however the writer reported
    it), the file an OSError names, a CheckpointError's own words (unreadable files and other models are named
    where they are read), else the error's first line. `writing`: the file or folder being written, named when
    the error names none, and looked at when the error's words do not tell a full disk (`disk_verdict`: call
    this before the partial output is removed)."""
    if isinstance(err, CheckpointError):
        return str(err)
    filename = err.filename if isinstance(err, OSError) and err.filename else None
    verdict = disk_verdict(err, writing)
    if verdict is not None:
        if verdict in OUT_OF_SPACE:
            _clear_frames(err)
        return f"{verdict} writing {filename or writing}"
    if filename:
        return f"{filename}: {err.strerror}"
    return f"{type(err).__name__}: {first_line(err)}"


def conversion_failure(err: BaseException, path: Path, scratch: Path) -> str:
    """One line for a conversion of checkpoint `path` into `scratch` that failed; removes the scratch. A full disk
    is judged while the scratch is still there (it shows), its free space measured once the scratch is gone."""
    reason = failure_reason(err, scratch)
    shutil.rmtree(scratch, ignore_errors=True)
    if (full := no_space_reason(err)) is not None:
        root = scratch.parents[1]  # RUN_DIR/checkpoints/.universal-step_N/universal
        space = space_report(root, disk_bytes(path), estimate="the checkpoint's size", reason=full)
        return (f"checkpoint {path} could not be converted for this run: {reason}; {space}; the checkpoint is intact: "
                f"free space there, or resume with the layout that wrote it")
    if isinstance(err, CheckpointError):
        return reason
    return f"checkpoint {path} could not be converted for this run ({reason})"


def describe_write_failure(err: BaseException, tmp: Path) -> str:
    """`failure_reason` for a failed write into a checkpoint's temp folder `tmp`, with what it had written when the
    disk or quota ran out. Call it before the partial output is removed: a full disk shows, and it is measured."""
    reason = failure_reason(err, tmp)
    if no_space_reason(err) is not None:
        return f"{reason} ({format_bytes(disk_bytes(tmp))} of it written)"
    return reason


def collective_timeout(seconds: float) -> datetime.timedelta | None:
    """run.collective_timeout_s as a process group's timeout (0: None, torch's default)."""
    return datetime.timedelta(seconds=seconds) if seconds > 0 else None


class SaveChannel:
    """The collectives of checkpoint saves, among `acc`'s processes. With `own_group` (saves in the loop,
    ckpt.async_save) a gloo group made once carries them: the agreement each save in the loop costs stays on the
    host (no device sync under NCCL) and fails after `timeout_s` (run.collective_timeout_s; 0: torch's default).
    Otherwise the default group does."""

    def __init__(self, acc: Accelerator, timeout_s: float = 0.0, own_group: bool = False):
        self.acc = acc
        self.timeout_s = timeout_s if timeout_s > 0 else default_pg_timeout.total_seconds()
        """Seconds a rank waits in the group's collectives for the main process (its decision) before it fails."""
        self.group = None
        if acc.num_processes > 1 and own_group:
            self.group = dist.new_group(backend="gloo", timeout=collective_timeout(timeout_s))

    def decide(self, decision: int, problem: str | None) -> tuple[int, str | None]:
        """The main process's `decision` and `problem` (None: none) on every rank: one broadcast (a problem's
        words take a second one)."""
        if self.acc.num_processes == 1:
            return decision, problem
        flags = torch.tensor([decision, problem is not None], dtype=torch.int64,
                             device="cpu" if self.group is not None else self.acc.device)
        dist.broadcast(flags, src=0, group=self.group)
        decision, told = (int(v) for v in flags.tolist())
        if told:
            words = [problem]
            dist.broadcast_object_list(words, src=0, group=self.group)
            problem = words[0]
        return decision, problem

    def problems(self, problem: str | None) -> list[str]:
        """Every rank's problem (None: none), on every rank."""
        if self.acc.num_processes == 1:
            return [problem] if problem else []
        if self.group is None:
            gathered = gather_object([problem])
        else:
            gathered = [None] * self.acc.num_processes
            dist.all_gather_object(gathered, problem, group=self.group)
        return [p for p in gathered if p is not None]

    def to_main(self, obj: object) -> list | None:
        """Every rank's `obj` in rank order, on the main process (None on the others)."""
        if self.acc.num_processes == 1:
            return [obj]
        if self.group is None:
            gathered = gather_object([obj])
            return gathered if self.acc.is_main_process else None
        gathered = [None] * self.acc.num_processes if self.acc.is_main_process else None
        dist.gather_object(obj, gathered, dst=0, group=self.group)
        return gathered

    def barrier(self) -> None:
        if self.group is None:
            self.acc.wait_for_everyone()
        else:
            dist.barrier(group=self.group)


class SaveErrors:
    """The first error of this rank's part of a save; `agree()` (a barrier) makes every rank raise the same
    one-line CheckpointError, so a full disk or a read-only directory on one rank leaves no rank waiting,
    and removes the unfinished temp directory. Earlier checkpoints are never touched by a failed save.

    A full disk or an exceeded quota is named as such, however the writer reported it (OSError, safetensors'
    error, or torch's short write on a disk left without room), with the free space once the temp directory is
    gone and an estimate of the size."""

    def __init__(self, acc: Accelerator, root: Path, tmp: Path, channel: SaveChannel | None = None,
                 checkpoint: str | None = None):
        self.acc, self.root, self.tmp = acc, root, tmp
        self.channel = channel or SaveChannel(acc)
        self.checkpoint = checkpoint or store.saved_as(tmp)
        """The name of the checkpoint the save writes (step_N), which a failure names."""
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
        return describe_write_failure(err, self.tmp)  # while this rank's part is still there: a full disk shows

    def _space(self, reason: str) -> str:
        """Free space after the temp directory is removed, and how much the checkpoint needs (estimated)."""
        if self.previous is None:
            return f"{space_report(self.root, None, reason=reason)}, more needed than was written"
        return space_report(self.root, disk_bytes(self.previous), estimate="estimate: the previous checkpoint's size",
                            reason=reason)

    def agree(self) -> None:
        problems = self.channel.problems(self.error)
        if not problems:
            return
        if self.acc.is_main_process:
            shutil.rmtree(self.tmp, ignore_errors=True)
        if self.acc.num_processes > 1 and any(reason in p for p in problems for reason in OUT_OF_SPACE):
            self.channel.barrier()  # the temp directory is gone before any rank measures
        raise everywhere(CheckpointError(self.failure_message(problems))) from self.cause

    def failure_message(self, problems: list[str]) -> str:
        """The one line of a failed save, from each failing rank's line (once the temp folder is gone): a full
        disk's or quota's space, and the checkpoint left as the latest."""
        space = ""
        if any(reason in p for p in problems for reason in OUT_OF_SPACE):
            space = f"; {self._space(NO_SPACE if any(NO_SPACE in p for p in problems) else QUOTA)}"
        kept = f"the previous checkpoint {self.previous} is intact" if self.previous else "no earlier checkpoint exists"
        return f"could not save checkpoint {self.checkpoint} ({'; '.join(problems)}){space}; {kept}"


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
