"""Checkpointing as one component: a `Checkpointer` that saves and restores the run's `Stateful` parts.

As torchtitan's CheckpointManager, the Checkpointer holds every part of the training state in one mapping
(parts.py: train state, RNG, backend, data position, scheduler, step guard, task statistics, EMA), saves them
in one loop, atomically (store.py: a temp folder, the manifest, the rename, then the pointers), and restores
them in one loop: first every part's own files (`load_files`; the backend's conversion among them), then
every part's state. Where each part's state lives in a checkpoint is the part's `placement` (parts.py: a file of
its own, keys at the top of `trainer_state.json`, or by default under the part's name there); a part that owns
files writes and reads them itself (`save_files`/`load_files`: the backend's are sharded under ZeRO and FSDP,
and converted through a scratch folder when the checkpoint has another layout, convert.py).

`resume()` restores the checkpoint the run's `ResumeTarget` names (picked and verified once, target.py),
every part in place, and returns what it resumed (`Resumed`); it reads and writes nothing else of the
Trainer. A failure to read, convert or write is one CheckpointError, the same on every rank (agreement.py),
and leaves the run folder as it was.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from trainer.config import Config
from trainer.core.checkpoint import store, writer
from trainer.core.checkpoint.agreement import (
    SaveChannel,
    SaveErrors,
    agree,
    agree_on_target,
    describe_write_failure,
    everywhere,
    set_aside_old_checkpoints,
    verify_everywhere,
)
from trainer.core.checkpoint.parts import (
    BackendState,
    Stateful,
    TrainState,
    can_stage,
    load_files,
    placement,
    save_files,
    stage_files,
)
from trainer.core.checkpoint.target import ResumeTarget, warn_changed_task, warn_skipped
from trainer.core.checkpoint.writer import StagedFile, WriteJob
from trainer.core.elastic import restartable
from trainer.core.preemption import stop_requested_at
from trainer.core.run_lock import run_generation
from trainer.errors import CheckpointError, first_line
from trainer.rundir import RunDir

logger = logging.getLogger("trainer")

STAGED_ARTIFACTS = ".staged-artifacts"
"""The folder beside the checkpoints where the task's artifacts are written once for the writer process to copy."""
SKIP, STAGED, ON_STEP = 0, 1, 2
"""What a save does, as the main process decides for every rank (`Checkpointer._decide`): nothing (the last one is
still being written), hand its files to the writer process, or write them on the step."""


def completion_deadline_s(group_timeout_s: float) -> float:
    """How long the main process waits for a checkpoint completing in the background (the writer process or the
    completion thread) before it takes it for a failure: half the save group's timeout less the time ending the writer
    may take (`writer.ENDING_S`), a quarter of it at least. The other ranks wait for the main process's decision in
    that group's broadcast: the deadline leaves them well inside their timeout, so the stalled checkpoint is the error
    every rank raises, not a collective's timeout."""
    return max(group_timeout_s / 2 - writer.ENDING_S, group_timeout_s / 4)


AGENT_STOP_S = 30.0
"""torch elastic's time from stopping its workers to their SIGKILL: the default of TORCH_ELASTIC_SHUTDOWN_TIMEOUT
for a signal the agent forwards, and fixed when the agent stops its group itself (a node joins, a restart)."""
STOP_MARGIN_S = writer.ENDING_S + 5.0
"""What a rank keeps of its stop window after the last checkpoint's wait: ending the writer process, the stop's
marker, the exit."""


def stop_window_s(environ: Mapping[str, str] = os.environ) -> float:
    """How long a rank has from a stop signal to its SIGKILL: TORCH_ELASTIC_SHUTDOWN_TIMEOUT (torch's default,
    AGENT_STOP_S, where unset: also about what a batch system gives a process it signals, SLURM's KillWait), and
    no more than AGENT_STOP_S under an agent that restarts its group (it stops a group for a join with that)."""
    try:
        window = float(environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "") or AGENT_STOP_S)
    except ValueError:
        window = AGENT_STOP_S
    return min(window, AGENT_STOP_S) if restartable(environ) else window


@dataclass
class Resumed:
    path: Path
    state: TrainState
    converted: str | None
    """The conversion made ('ZeRO-2 x 2 -> 1 process' and its duration), None when the backend read its own files."""


class Checkpointer:
    """Saves and restores `parts` (name -> Stateful; module docstring) in `run_dir/checkpoints`; resumes `target`.

    `parts` holds "backend" (a `BackendState`) and "train" (the `TrainState`); any other `Stateful` may join. The
    mapping's order is the order of the loops (the RNG part before the backend's: it checks its files first)."""

    def __init__(self, cfg: Config, acc: Any, run_dir: RunDir, parts: dict[str, Stateful], target: ResumeTarget):
        self.cfg, self.acc, self.run_dir, self.parts, self.target = cfg, acc, run_dir, parts, target
        self._main = acc.is_main_process
        self.corrupt: set[Path] = set()
        """Checkpoints the resume passed over because they failed verification: set aside if this run saves the step."""
        self.generation = run_generation(run_dir.root)
        """This worker group's generation of the run (run_lock.py): it names the temp folders and fences the saves."""
        self._completion: threading.Thread | None = None
        self._completing: tuple[Path, Path, float] | None = None
        """The checkpoint the completion thread completes: its temp folder, its folder, when it started."""
        self._stall_told: str | None = None
        """The checkpoint whose writing past the deadline was said (`_tell_stalled`): once per checkpoint."""
        self._lost: int | None = None
        """The step of a checkpoint the writer process held when it died, not written since: `wait()` returns it."""
        self._given_up: str | None = None
        """A checkpoint given up at a stop, still being written when the stop window ran out (`_wait_limit`): no
        checkpoint is written after it."""
        self._failure: tuple[Path, list[str]] | None = None
        """A save completed in the background that failed (its temp folder, each failing rank's line): raised, on
        every rank, by the next save or `wait()`."""
        self.channel = SaveChannel(acc, cfg.run.collective_timeout_s, own_group=cfg.ckpt.async_save)
        """The saves' collectives: with ckpt.async_save on a gloo group of their own (agreement.py)."""
        self._writer_timeout_s = completion_deadline_s(self.channel.timeout_s)
        """How long a save or `wait()` waits for the checkpoint being completed in the background (its failure then)."""
        self._writer: writer.BackgroundWriter | None = None
        self._scratch = run_dir.checkpoints / STAGED_ARTIFACTS
        if cfg.ckpt.async_save:
            self._start_writer()

    @property
    def backend(self) -> BackendState:
        return self.parts["backend"]

    @property
    def state(self) -> TrainState:
        return self.parts["train"]

    # ------------------------------------------------------------------ save
    def save(self, best: bool = False, wait: bool = True) -> Path | None:
        """Write a complete checkpoint atomically (every rank takes part) and rotate old ones.

        wait=False with ckpt.async_save: return before the checkpoint is complete. Where every part can hand its
        files over as host data (the plain and DDP layouts), the step only copies them into memory shared with a
        writer process, which writes and completes the checkpoint (writer.py). Elsewhere, or once the writer process
        is gone (said once), every rank writes its files on the step and the main process completes the checkpoint
        (hashes, fsync, manifest, rename, pointers, rotation) in a background thread. A failure there is raised, on
        every rank, by the next save or `wait()`, naming its own checkpoint. A save asked for while the previous one
        is still being written, or while the writer process rests after it (ckpt.async_cpu_share), is skipped
        (None; a best checkpoint waits instead): checkpoints then come as often as the disk completes them, and no
        step waits for the disk; one written for longer than a save waits for it (`completion_deadline_s`: a stalled
        filesystem) is said once, and the saves stay skipped until it completes or the next waiting save fails it.
        What a save does is the main process's decision, told to every rank in one collective
        (`SaveChannel.decide`): a skipped save costs the step that one."""
        background = self.cfg.ckpt.async_save and not wait
        how, problem = SKIP, None
        if self._main:
            how, problem = self._decide(best, background)
        how, problem = self.channel.decide(how, problem)
        if problem is not None:
            raise everywhere(CheckpointError(problem))
        if how == SKIP:
            return None
        tmp, final = self._folders()
        errors = SaveErrors(self.acc, self.run_dir.checkpoints, tmp, self.channel, checkpoint=final.name)
        if how == STAGED:
            self._save_staged(tmp, final, best, errors)
        else:
            self._save_on_step(tmp, final, best, background, errors)
        return final

    def _folders(self) -> tuple[Path, Path]:
        """This step's checkpoint: the temp folder it is written into, and the folder it becomes."""
        final = self.run_dir.checkpoints / store.step_dir_name(self.state.step)
        return store.temp_dir(final, self.generation), final

    def _decide(self, best: bool, background: bool) -> tuple[int, str | None]:
        """Main process: what this save does (SKIP, STAGED or ON_STEP, the temp folder of a save on the step made
        ready), or the failure to raise instead: the last background save's, or this save's temp folder's. Whatever
        it raises is that failure: the other ranks wait for the decision."""
        tmp, final = self._folders()
        try:
            busy = self._completion is not None and self._completion.is_alive()
            if self._writer is not None:
                busy = self._writer.busy() or busy
                self._log_writer_warnings()
            if background and busy and not best:  # the common case in the loop: decided without a look at the disk
                self._tell_stalled()
                return SKIP, None
            problem = self._join_completion()
            if problem is not None:
                return SKIP, problem
            if self._given_up is not None:  # a stop whose window ran out: a save on the step would outlast it too
                return SKIP, None
            if self._lost == self.state.step:  # written again now
                self._lost = None
            if background and self._writer is not None and self._writer.ready():
                return STAGED, None
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except Exception as err:  # noqa: BLE001 - disk errors surface as any type; raised on every rank
            problem = f"rank {self.acc.process_index}: {describe_write_failure(err, tmp)}"
            shutil.rmtree(tmp, ignore_errors=True)
            return SKIP, SaveErrors(self.acc, self.run_dir.checkpoints, tmp, self.channel,
                                    checkpoint=final.name).failure_message([problem])
        return ON_STEP, None

    def _tell_stalled(self) -> None:
        """Main process, a save skipped: say once per checkpoint that the one being written has taken longer than a
        save waits for it. The run goes on (a slow disk may catch up); a best, synchronous or final save then waits
        for it no longer than that and fails it."""
        writing = self._writer.writing() if self._writer is not None else None
        if writing is None and self._completion is not None and self._completion.is_alive():
            writing = (self._completing[1].name, time.monotonic() - self._completing[2])
        if writing is None or writing[1] <= self._writer_timeout_s or writing[0] == self._stall_told:
            return
        self._stall_told = writing[0]
        logger.warning("checkpoint %s is still being written after %.0f s, past the %.1f s a save waits for it (the "
                       "storage under %s stalls?): the saves in the loop are skipped until it completes, and a "
                       "save that waits for it fails it", writing[0], writing[1], self._writer_timeout_s,
                       self.run_dir.checkpoints)

    def _records(self) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
        """Every rank: the parts' states for trainer_state.json, those with files of their own, and the names of
        those files that are artifacts."""
        record: dict[str, Any] = {}
        files: dict[str, Any] = {}
        artifacts: list[str] = []
        for key, part in self.parts.items():
            state, where = part.state_dict(), placement(part)  # every rank: the EMA's is a collective
            if where.file is not None:
                files[where.file] = state
                artifacts += [where.file] if where.artifact else []
            elif where.top_level:
                record.update(state)
            else:
                record[key] = state
        return record, files, artifacts

    def _save_on_step(self, tmp: Path, final: Path, best: bool, background: bool, errors: SaveErrors) -> None:
        """Every rank writes its files into `tmp` (made by the main process before the save's agreement); then the
        main process completes the checkpoint, in a background thread where `background`."""
        acc = self.acc
        artifacts: list[str] = []
        with errors.record():
            for part in self.parts.values():  # the parts' own files, every rank its share
                artifacts += save_files(part, tmp)
        record, files, listed = self._records()
        if acc.is_main_process:
            with errors.record():
                writer.write_files(tmp, [_part_file(file, state) for file, state in files.items()], None)
        errors.agree()  # every rank's files are written: only then the manifest, which completes the checkpoint
        if acc.is_main_process:
            record["artifacts"] = listed + artifacts
            if background:
                self._complete_later(tmp, final, record, best)
            else:
                with errors.record():
                    self._complete(tmp, final, record, best)
        if not background:
            errors.agree()

    def _save_staged(self, tmp: Path, final: Path, best: bool, errors: SaveErrors) -> None:
        """Every rank stages its share; the main process gathers the others' (their RNG states: small), copies the
        tensors into the writer's memory and hands the checkpoint over. A failure here is, as the writer's, raised
        by the next save or `wait()`: no collective waits for it now."""
        acc, staged = self.acc, []
        with errors.record():
            for part in self.parts.values():
                staged += stage_files(part, self._scratch)
        record, files, listed = self._records()
        shares = self.channel.to_main((errors.error, [] if acc.is_main_process else staged))
        if not acc.is_main_process:
            return
        problems = [error for error, _ in shares if error is not None]
        if not problems:
            with errors.record():
                staged += [f for _, share in shares for f in share]
                staged += [_part_file(file, state) for file, state in files.items()]
                record["artifacts"] = listed + [f.name for f in staged if f.artifact]
                corrupt = final in self.corrupt
                self.corrupt.discard(final)
                self._hand_over(WriteJob(tmp, final, staged, record, best, self.cfg.ckpt.keep_last,
                                         self.cfg.ckpt.verify, set_aside_existing=corrupt, generation=self.generation))
            problems = [errors.error] if errors.error else []
        if problems:
            self._failure = self._failure or (tmp, problems)

    def _hand_over(self, job: WriteJob) -> None:
        """Main process: `job` to the writer process; where that is gone, written on the step as the saves after it
        are (`_writer_stopped`)."""
        try:
            self._writer.submit(job)
            return
        except writer.WriterStopped:
            pass
        shutil.rmtree(job.tmp, ignore_errors=True)
        job.tmp.mkdir(parents=True)
        writer.write_files(job.tmp, job.files, None)  # before the staged artifacts it copies are removed
        self._writer_stopped(None)
        if job.set_aside_existing:
            self.corrupt.add(job.final)
        self._complete_later(job.tmp, job.final, job.record, job.best)

    def _start_writer(self) -> None:
        """Main process: start the writer process where every part can stage its files (the same answer on every
        rank: the layout decides); its start-up overlaps the first steps, whose saves write on the step."""
        stages = writer.supported() and all(can_stage(part) for part in self.parts.values())
        if stages and self.acc.is_main_process:
            self._writer = writer.BackgroundWriter(cpu_share=self.cfg.ckpt.async_cpu_share)

    def _complete(self, tmp: Path, final: Path, record: dict[str, Any], best: bool) -> None:
        """Main process: hashes and manifest (the mark of completeness), the rename, the pointers, the rotation."""
        corrupt = final in self.corrupt
        self.corrupt.discard(final)
        for warning in store.complete_checkpoint(tmp, final, record, best=best, verify=self.cfg.ckpt.verify,
                                                 keep_last=self.cfg.ckpt.keep_last, set_aside_existing=corrupt,
                                                 generation=self.generation):
            logger.warning("%s", warning)

    def _complete_later(self, tmp: Path, final: Path, record: dict[str, Any], best: bool) -> None:
        """Main process: `_complete` in a background thread; its failure is the next save's or `wait()`'s."""
        # A daemon: one stalled past the deadline (`_join_completion`) is given up and must not hold the exit
        self._completion = threading.Thread(target=self._complete_in_background, args=(tmp, final, record, best),
                                            name="trainer-checkpoint", daemon=True)
        self._completing = (tmp, final, time.monotonic())
        self._completion.start()

    def _complete_in_background(self, tmp: Path, final: Path, record: dict[str, Any], best: bool) -> None:
        try:
            self._complete(tmp, final, record, best)
        except Exception as err:  # noqa: BLE001 - raised by the next save or wait(), on every rank
            # A completion given up at a stop (`_join_completion`) was said then: its late failure is not raised again
            if self._completion is threading.current_thread():
                self._failure = (tmp, [f"rank 0: {describe_write_failure(err, tmp)}"])  # before its output is removed
            shutil.rmtree(tmp, ignore_errors=True)

    def _join_completion(self) -> str | None:
        """Main process: wait for the checkpoint being completed in the background, by the writer process or the
        completion thread, no longer than `completion_deadline_s` (then it is a failure); the line of its failure,
        if it failed. A writer process found gone is said once, a checkpoint it held is given up (its step is
        `wait()`'s to return), and the saves after it are written on the step."""
        timeout_s, stop = self._wait_limit()
        deadline = time.monotonic() + timeout_s
        if self._completion is not None:
            self._completion.join(timeout_s)
            if self._completion.is_alive() and stop is not None:  # left to the filesystem, a daemon
                self._give_up(self._completing[1].name, stop)
                self._completion = self._completing = None
            elif self._completion.is_alive():  # a stalled filesystem: the thread is left to it, its temp folder too
                tmp, final, _ = self._completing
                return SaveErrors(self.acc, self.run_dir.checkpoints, tmp, self.channel).failure_message(
                    [f"rank 0: not completed within {round(self._writer_timeout_s, 1):g} s: the storage under {final.parent} "
                     f"stalls"])
            self._completion = self._completing = None
        if self._writer is not None:
            failure = self._writer.wait(max(0.0, deadline - time.monotonic()))
            self._log_writer_warnings()
            if failure is not None and failure.timed_out and stop is not None:
                self._give_up(failure.checkpoint, stop)  # said, not raised; its temp folder left to the next save
                self._close_writer()
                failure = None
            elif failure is not None and failure.lost:
                self._lost = _step_of(failure.checkpoint)
            if failure is not None and not failure.lost and self._failure is None:
                final = self.run_dir.checkpoints / failure.checkpoint
                self._failure = (store.temp_dir(final, self.generation), [f"rank 0: {failure.reason}"])
            if self._writer is not None and self._writer.stopped is not None:
                self._writer_stopped(failure)
        if self._failure is None:
            return None
        (tmp, problems), self._failure = self._failure, None
        shutil.rmtree(tmp, ignore_errors=True)
        return SaveErrors(self.acc, self.run_dir.checkpoints, tmp, self.channel).failure_message(problems)

    def _wait_limit(self) -> tuple[float, str | None]:
        """Main process: how long a wait for the checkpoint completing in the background may take now, and, where a
        stop signal cut it short, what it was cut to (for `_give_up`). `completion_deadline_s`, but once a stop
        signal arrived no longer than what is left of the stop window (`stop_window_s`) less STOP_MARGIN_S: a
        launcher kills the rank at its end, and a rank killed there writes no marker and leaves its writer mid-way."""
        since = stop_requested_at()
        if since is None:
            return self._writer_timeout_s, None
        window = stop_window_s()
        left = max(0.0, since + window - STOP_MARGIN_S - time.monotonic())
        if left >= self._writer_timeout_s:
            return self._writer_timeout_s, None
        return left, (f"{round(window, 1):g} s from the stop signal to the launcher's SIGKILL "
                      f"(TORCH_ELASTIC_SHUTDOWN_TIMEOUT), less {round(STOP_MARGIN_S, 1):g} s to end the writer and exit")

    def _give_up(self, checkpoint: str, window: str) -> None:
        """Main process, at a stop: the checkpoint being written past the stop window is given up, said once; the
        saves of this stop are skipped (`_decide`), the run resumes from the latest complete checkpoint."""
        self._given_up = checkpoint
        logger.warning("stopping: checkpoint %s was still being written when the stop window ran out (%s; the storage "
                       "under %s stalls?): given up, and no checkpoint is written at this stop; the run resumes from "
                       "the latest complete checkpoint", checkpoint, window, self.run_dir.checkpoints)

    def _writer_stopped(self, failure: writer.WriteFailure | None) -> None:
        """Main process: the writer process is gone. Said once (where its end is not the failure to raise), with
        the checkpoint it held, given up; every save after it writes its files on the step."""
        stopped = self._writer.stopped
        self._close_writer()
        if failure is not None and not failure.lost:
            return
        held = ""
        if failure is not None:
            shutil.rmtree(store.temp_dir(self.run_dir.checkpoints / failure.checkpoint, self.generation),
                          ignore_errors=True)
            held = f" while writing {failure.checkpoint}"
        logger.warning("%s%s: checkpoints are written on the step from now on", stopped, held)

    def _log_writer_warnings(self) -> None:
        for warning in self._writer.warnings:
            logger.warning("%s", warning)
        self._writer.warnings.clear()

    def wait(self, close: bool = False) -> int | None:
        """Every rank: return once the last checkpoint is complete on disk (raises its failure everywhere, naming
        its checkpoint); `close`: then stop the writer process. Returns, on every rank, the step of a checkpoint
        lost with the writer process (it died while writing it: not on disk, nor written since), else None; where
        the state is still at that step, the caller saves it again (on the step: the writer is gone). Once a stop
        signal arrived, the wait ends inside the launcher's stop window (`_wait_limit`): a checkpoint still being
        written then is given up and said once, not raised, and the stop's saves are skipped."""
        problem, lost = None, -1
        if self.acc.is_main_process:
            try:
                problem = self._join_completion()
            except Exception as err:  # noqa: BLE001 - raised on every rank
                problem = f"could not complete the last checkpoint ({type(err).__name__}: {first_line(err)})"
            finally:
                if close:
                    self._close_writer()
            lost = -1 if self._lost is None else self._lost
            self._lost = None
        lost, problem = self.channel.decide(lost, problem)  # the decision's slot carries the lost step
        if problem is not None:
            raise everywhere(CheckpointError(problem))
        return None if lost < 0 else lost

    def _close_writer(self) -> None:
        if self._writer is not None:
            self._writer.close(self._wait_limit()[0])
            self._writer = None
        shutil.rmtree(self._scratch, ignore_errors=True)

    # ------------------------------------------------------------------ resume
    def resume(self, finished: bool = False) -> Resumed | None:
        """Restore every part from the target checkpoint; None for a fresh start. `finished`: the checkpoint is at or
        past the run's last step, so nothing will be trained from it (no notes about continuing it)."""
        acc, root = self.acc, self.run_dir.checkpoints
        if self.target.problem is not None:
            warn_skipped(self.target.skipped, "no checkpoint is left to resume from")
        target = agree_on_target(acc, self.target, self.cfg.ckpt.verify)
        self.corrupt = set(target.corrupt)
        if target.mode == "none":
            set_aside_old_checkpoints(acc, root)
            return None
        path, saved = target.path, dict(target.saved)
        if path is None:
            warn_skipped(target.skipped, "no complete checkpoint: starting from step 0")
            return None
        if target.mode == "auto" and store.is_set_aside(path):
            path = self._put_back(path)
        warn_skipped(target.skipped, f"resuming from {path.name}")
        if saved.get("task") and self.state.task and saved["task"] != self.state.task:
            raise everywhere(CheckpointError(
                f"checkpoint {path} was trained for task '{saved['task']}', this run trains task '{self.state.task}'; "
                f"resume it with its own config, or start over with run.resume=none or a new run.output_dir"))
        self._warn_changed_batch(path, saved)
        warn_changed_task(self.run_dir, self.cfg, path)
        notes = [note for part in self.parts.values() if (note := load_files(part, path, saved, finished))]
        converted = "; ".join(notes) or None
        acc.step = 0  # accumulation boundaries restart with each optimizer step, whatever accum was
        for key in self.parts:
            self._load_part(key, path, saved)
        if target.mode == "auto" and acc.is_main_process:
            self._set_pointers(path, target)
        if converted and acc.is_main_process:
            logger.info("converted checkpoint %s (%s) through the topology-free form", path.name, converted)
        return Resumed(path, self.state, converted)

    def _put_back(self, path: Path) -> Path:
        """run.resume=auto picked a checkpoint that a kill left set aside with no other copy of its step
        (store.set_aside_copies): the main process, holding the run lock, renames it back to its step folder before
        any rank reads it, and every rank resumes it there (a failure is raised on every rank)."""
        final = path.with_name(path.name.removeprefix(store.SET_ASIDE))
        problem = None
        if self._main:
            try:
                store.put_back(path, self.generation)
                logger.warning("checkpoint %s was left set aside by a save of its step that did not finish: put back "
                               "as %s", path, final.name)
            except (OSError, CheckpointError) as err:
                problem = str(err) if isinstance(err, CheckpointError) else (
                    f"checkpoint {path} could not be put back as {final.name}: {err}")
        agree(self.acc, problem)
        return final

    def _load_part(self, key: str, path: Path, saved: dict[str, Any]) -> None:
        part = self.parts[key]
        where = placement(part)
        file = where.file
        if file is None:
            part.load_state_dict(saved if where.top_level else saved.get(key, {}))
            return
        if not (path / file).is_file():
            if where.required is not None:
                raise CheckpointError(f"checkpoint {path} has no {file} but {where.required}")
            return
        try:
            part.load_state_dict(_read_part_file(path / file))
        except KeyError as err:
            raise CheckpointError(f"checkpoint {path}: {file} {err.args[0]}") from None

    def _set_pointers(self, path: Path, target: ResumeTarget) -> None:
        """run.resume=auto: `latest` and `best` right where a kill or a checkpoint that failed verification left them
        stale, said with its cause."""
        root = self.run_dir.checkpoints
        try:
            repaired = store.repair_pointers(root, path)
        except OSError as err:  # a read-only directory: the next save reports it
            logger.warning("could not repair the checkpoint pointers under %s: %s", root, err)
            return
        if repaired:
            cause = ("newer checkpoints failed verification" if target.corrupt
                     else "a save was interrupted while it was finalised")
            logger.warning("checkpoint pointers repaired (%s): %s", cause, ", ".join(repaired))

    def _warn_changed_batch(self, path: Path, saved: dict[str, Any]) -> None:
        accum, world = self.state.grad_accum_steps, self.acc.num_processes  # the run plan's layout
        saved_global = saved.get("global_batch_size") or (
            saved.get("per_device_batch_size", 0) * saved.get("grad_accum_steps", accum) * saved.get("world_size", 1))
        now_global = self.state.per_device_batch_size * accum * world
        if saved_global and saved_global != now_global:  # batch_plan keeps it; only a hand-built plan gets here
            logger.warning("the global batch changed from %s to %s: the data position counts optimizer steps, so the "
                           "samples differ from the original run's", saved_global, now_global)

    def load_weights(self, path: Path) -> None:
        """Load a checkpoint's model weights (and EMA) into a trained run, e.g. the best one for the test pass.
        The whole backend state (optimizer, RNG) comes with them: harmless after training."""
        saved, problem = verify_everywhere(self.acc, path, check_hashes=self.cfg.ckpt.verify)
        if problem is not None:  # may differ by rank ("failed verification on another rank"): every rank says it
            raise CheckpointError(problem)
        self.backend.load_files(path, saved, finished=True)
        if "ema" in self.parts:
            self._load_part("ema", path, saved)


def _part_file(file: str, state: Any) -> StagedFile:
    """A part's file of its own (`Placement.file`): safetensors by its suffix, else JSON; written on the step or by
    the writer process, by the same `writer.write_files`."""
    return StagedFile(file, "safetensors" if file.endswith(".safetensors") else "json", state)


def _step_of(checkpoint: str) -> int:
    """The step of a checkpoint folder's name (store.step_dir_name)."""
    return int(checkpoint.removeprefix("step_"))


def _read_part_file(file: Path) -> Any:
    return load_file(file) if file.suffix == ".safetensors" else json.loads(file.read_text())
