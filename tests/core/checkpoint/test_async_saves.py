"""The Checkpointer's saves in the loop with ckpt.async_save: a writer process that dies leaves the run saving on
the step, a save attempt is one host-side agreement, and a failure in the background is blamed on its own
checkpoint."""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time
from typing import Any

import pytest
import torch
from conftest import TINY

from trainer.config import load_config
from trainer.core.checkpoint import agreement, cadence, store, writer
from trainer.core.checkpoint.manager import Checkpointer
from trainer.core.trainer import Trainer
from trainer.errors import CheckpointError

pytestmark = [pytest.mark.usefixtures("fresh_accelerate"),
              pytest.mark.skipif(not writer.supported(), reason="needs memfd and descriptor passing (Linux)")]
RUN = ["train.ema_decay=0", "eval.every_steps=0", "log.progress_bar=false", "log.tensorboard=false",
       "ckpt.async_save=true", "ckpt.keep_last=20"]


def _returns(call, timeout_s: float = 60) -> Any:
    """`call()`'s result (or what it raised), run in a thread: a call that never returns fails the test instead of
    hanging it."""
    result: list = []

    def run() -> None:
        try:
            result.append((call(), None))
        except BaseException as err:  # noqa: BLE001 - raised below, in the test's thread
            result.append((None, err))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"{call} did not return"
    value, error = result[0]
    if error is not None:
        raise error
    return value


def _until(condition, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_run_whose_writer_died_goes_on_saving_on_the_step(tmp_path, caplog, monkeypatch):
    """The writer killed before it was ready (OOM while importing, a kill): the next save notices it without
    spinning, says so once, and this and every later save writes its files on the step; the run completes."""
    start = writer.BackgroundWriter.__init__

    def start_and_kill(self, *args, **kwargs):
        start(self, *args, **kwargs)
        os.kill(self._proc.pid, signal.SIGKILL)  # while it imports: long before it can say it is ready
        while self._proc.poll() is None:
            time.sleep(0.01)

    monkeypatch.setattr(writer.BackgroundWriter, "__init__", start_and_kill)
    trainer = Trainer(load_config(TINY, [*RUN, "train.max_steps=6", "ckpt.every_steps=1", "task.delay_s=0.02",
                                         f"run.output_dir={tmp_path}"]))
    staged = []
    monkeypatch.setattr(Checkpointer, "_save_staged", lambda self, *a: staged.append(a))
    root = tmp_path / "checkpoints"
    assert _returns(lambda: trainer.checkpointer.save(wait=False)) == root / "step_00000000"
    trainer.fit()
    said = [r.getMessage() for r in caplog.records if "checkpoint writer process" in r.getMessage()]
    assert said == ["the checkpoint writer process was killed by SIGKILL before it was ready: checkpoints are "
                    "written on the step from now on"], said
    assert not staged and trainer.checkpointer._writer is None
    assert {"step_00000000", "step_00000006"} <= {p.name for p in root.glob("step_*")}
    for path in root.glob("step_*"):
        store.verify_checkpoint(path)
    assert not list(root.glob(".tmp-*"))


def test_a_checkpoint_the_dead_writer_could_not_take_is_written_on_the_step(tmp_path, caplog, monkeypatch):
    """The writer dies between the save's decision and the hand-over (a broken pipe): that checkpoint is written on
    the step and completed all the same, and the death is said once."""
    trainer = Trainer(load_config(TINY, [*RUN, "train.max_steps=2", "ckpt.every_steps=0",
                                         f"run.output_dir={tmp_path}"]))
    saver = trainer.checkpointer
    _until(saver._writer.ready, "the writer process did not start")
    submit = writer.BackgroundWriter.submit

    def die_then_submit(self, job):
        os.kill(self._proc.pid, signal.SIGKILL)
        while self._proc.poll() is None:
            time.sleep(0.01)
        return submit(self, job)

    monkeypatch.setattr(writer.BackgroundWriter, "submit", die_then_submit)
    trainer.state.step = 2
    assert saver.save(wait=False) == tmp_path / "checkpoints" / "step_00000002"
    saver.wait(close=True)
    store.verify_checkpoint(tmp_path / "checkpoints" / "step_00000002")
    said = [r.getMessage() for r in caplog.records if "checkpoint writer process" in r.getMessage()]
    assert said == ["the checkpoint writer process was killed by SIGKILL: checkpoints are written on the step from "
                    "now on"], said


def test_a_failed_background_save_is_blamed_on_its_own_checkpoint(tmp_path):
    """The writer fails step 3's checkpoint; the next save (at step 5) and the final wait name step 3's and step
    7's folders, not the step at hand nor 'none'."""
    trainer = Trainer(load_config(TINY, [*RUN, "train.max_steps=2", "ckpt.every_steps=0",
                                         f"run.output_dir={tmp_path}"]))
    saver = trainer.checkpointer
    _until(saver._writer.ready, "the writer process did not start")
    root = tmp_path / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for step, then in ((3, lambda: saver.save(wait=False)), (7, lambda: saver.wait(close=True))):
        trainer.state.step = step
        blocker = root / f".tmp-{store.step_dir_name(step)}"
        blocker.write_text("in the way of the writer's temp folder")
        assert saver.save(wait=False) == root / store.step_dir_name(step)
        _until(lambda: not saver._writer.busy(), "the writer did not finish")
        trainer.state.step = step + 2
        with pytest.raises(CheckpointError, match=rf"^could not save checkpoint {store.step_dir_name(step)} \(rank 0: "
                                                  rf"{blocker}: File exists\); no earlier checkpoint exists$"):
            then()
        blocker.unlink()


class _Rank0Of2:
    """The main process of a two-process run, for the Checkpointer: its collectives are recorded, not sent."""

    num_processes, process_index, is_main_process, is_local_main_process = 2, 0, True, True

    def __init__(self, acc: Any, calls: list):
        self._acc, self._calls = acc, calls

    def __getattr__(self, name: str) -> Any:
        return getattr(self._acc, name)

    def wait_for_everyone(self) -> None:
        self._calls.append(("barrier", None))


def _two_ranks(monkeypatch) -> tuple[list, list]:
    """torch.distributed as rank 0 of two sees it, rank 1 with nothing to say and nothing staged: (the collectives
    called, as (name, group), the groups made, as new_group's arguments)."""
    dist = torch.distributed
    calls, groups = [], []

    def record(name, act=None):
        def collective(*args, **kwargs):
            calls.append((name, kwargs.get("group")))
            if act is not None:
                act(*args, **kwargs)
        return collective

    def all_gather_object(out, obj, group=None):
        out[:] = [obj, None]

    def gather_object(obj, out=None, dst=0, group=None):
        out[:] = [obj, (None, [])]  # rank 1's share: no error, no files

    monkeypatch.setattr(dist, "new_group", lambda *a, **k: (groups.append(k), f"group {len(groups)}")[1])
    for name, act in (("broadcast", None), ("broadcast_object_list", None), ("all_gather_object", all_gather_object),
                      ("gather_object", gather_object), ("all_gather", None), ("all_reduce", None), ("barrier", None),
                      ("gather", None), ("reduce", None), ("scatter", None)):
        monkeypatch.setattr(dist, name, record(name, act))
    monkeypatch.setattr(agreement, "gather_object", lambda objs: (calls.append(("gather_object", None)), objs * 2)[1])
    return calls, groups


def test_a_save_attempt_is_one_agreement_on_a_gloo_group_of_its_own(tmp_path, monkeypatch):
    """With several processes a skipped save costs the step one collective, a save handed to the writer that one
    and the gather of the other ranks' shares (their RNG states): all on a gloo group made once with the run's
    collective timeout, none on the default group (a device sync under NCCL)."""
    trainer = Trainer(load_config(TINY, [*RUN, "train.max_steps=2", "ckpt.every_steps=0", "run.collective_timeout_s=45",
                                         f"run.output_dir={tmp_path}"]))
    trainer.checkpointer.wait(close=True)
    calls, groups = _two_ranks(monkeypatch)
    saver = Checkpointer(trainer.cfg, _Rank0Of2(trainer.accelerator, calls), trainer.run_dir,
                         trainer.checkpointer.parts, trainer.checkpointer.target)
    try:
        assert groups == [{"backend": "gloo", "timeout": datetime.timedelta(seconds=45)}]
        _until(saver._writer.ready, "the writer process did not start")
        trainer.state.step = 1
        assert saver.save(wait=False) is not None
        assert calls == [("broadcast", "group 1"), ("gather_object", "group 1")], calls
        os.kill(saver._writer._proc.pid, signal.SIGSTOP)  # still writing step 1 when step 2 asks
        try:
            calls.clear()
            trainer.state.step = 2
            assert saver.save(wait=False) is None
            assert calls == [("broadcast", "group 1")], calls
        finally:
            os.kill(saver._writer._proc.pid, signal.SIGCONT)
        calls.clear()
        saver.wait()
        assert calls == [("broadcast", "group 1")], calls
        store.verify_checkpoint(tmp_path / "checkpoints" / "step_00000001")
        trainer.state.step = 3  # a failure in the background: the next attempt's agreement carries its words
        (tmp_path / "checkpoints" / ".tmp-step_00000003").write_text("in the way of the writer's temp folder")
        assert saver.save(wait=False) is not None
        _until(lambda: not saver._writer.busy(), "the writer did not finish")
        calls.clear()
        trainer.state.step = 4
        with pytest.raises(CheckpointError, match=r"^could not save checkpoint step_00000003 "):
            saver.save(wait=False)
        assert calls == [("broadcast", "group 1"), ("broadcast_object_list", "group 1")], calls
    finally:
        saver.wait(close=True)


def test_the_save_clock_group_takes_the_collective_timeout(monkeypatch):
    made = []
    monkeypatch.setattr(torch.distributed, "new_group", lambda *a, **k: made.append(k))
    cadence.SaveClock(10.0, world_size=2, timeout_s=45.0)
    cadence.SaveClock(10.0, world_size=2)
    assert made == [{"backend": "gloo", "timeout": datetime.timedelta(seconds=45)}, {"backend": "gloo", "timeout": None}]


# ---------------------------------------------------------------------- a stalled, lost or failing background save
def test_a_stalled_writer_is_given_up_well_before_the_other_ranks_time_out(tmp_path):
    """The other ranks wait for the main process's decision in the save group's broadcast, for
    run.collective_timeout_s: the main process gives a stalled writer up within half of that, so the stalled
    checkpoint is the error every rank raises, not a collective's timeout."""
    trainer = Trainer(load_config(TINY, [*RUN, "train.max_steps=2", "ckpt.every_steps=0", "run.collective_timeout_s=2",
                                         f"run.output_dir={tmp_path}"]))
    saver = trainer.checkpointer
    _until(saver._writer.ready, "the writer process did not start")
    pid = saver._writer._proc.pid
    os.kill(pid, signal.SIGSTOP)  # a stalled filesystem
    trainer.state.step = 1
    assert saver.save(wait=False) is not None
    with pytest.raises(CheckpointError, match=r"^could not save checkpoint step_00000001 \(rank 0: not completed "
                                              r"within ") as raised:
        _returns(lambda: saver.wait(close=True))
    deadline = float(str(raised.value).split("within ")[1].split(" s")[0])
    assert 0 < deadline <= 2 / 2
    assert saver._writer is None


def test_a_stalled_completion_thread_is_given_up_at_the_same_deadline(tmp_path, monkeypatch):
    """On the layouts that write on the step a thread completes the checkpoint; one stalled by the filesystem is
    given up at the writer's deadline (a failure), not joined for ever."""
    trainer = Trainer(load_config(TINY, [*RUN, "train.max_steps=2", "ckpt.every_steps=0", "run.collective_timeout_s=2",
                                         f"run.output_dir={tmp_path}"]))
    saver = trainer.checkpointer
    saver._close_writer()  # saves in the background are written on the step, completed by the thread
    stalled = threading.Event()
    complete = store.complete_checkpoint
    monkeypatch.setattr(store, "complete_checkpoint", lambda *a, **k: (stalled.wait(60), complete(*a, **k))[1])
    try:
        trainer.state.step = 1
        assert saver.save(wait=False) is not None
        with pytest.raises(CheckpointError, match=r"^could not save checkpoint step_00000001 \(rank 0: not "
                                                  r"completed within [0-9.]+ s: the storage under .* stalls\)"):
            _returns(saver.wait)
    finally:
        stalled.set()


def test_a_checkpoint_lost_with_the_writer_at_a_stop_is_written_on_the_step(tmp_path, caplog, monkeypatch):
    """The writer process dies (the OOM killer) while it writes the loop's checkpoint of the step where a SIGTERM
    stops the run: the stop writes that step's checkpoint on the step, so the marker and the line that say it
    was written are true."""
    stopped_at = []
    submit = writer.BackgroundWriter.submit

    def submit_then_die(self, job):
        os.kill(self._proc.pid, signal.SIGSTOP)  # the job stays pending ...
        submit(self, job)
        if not stopped_at:
            os.kill(self._proc.pid, signal.SIGKILL)  # ... until the writer is killed under it
            stopped_at.append(trainer.state.step)
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before this returns

    monkeypatch.setattr(writer.BackgroundWriter, "submit", submit_then_die)
    trainer = Trainer(load_config(TINY, [*RUN, "train.max_steps=10000", "ckpt.every_steps=1", "task.delay_s=0.01",
                                         f"run.output_dir={tmp_path}"]))
    assert trainer.fit() == "preempted"
    step = stopped_at[0]
    assert trainer.state.step == step
    path = tmp_path / "checkpoints" / store.step_dir_name(step)
    store.verify_checkpoint(path)
    assert store.latest_checkpoint(tmp_path / "checkpoints") == path
    assert (tmp_path / "preempted.json").is_file()
    said = [r.getMessage() for r in caplog.records]
    assert f"checkpoint at step {step} written" in " ".join(said)


def test_a_writer_stalled_in_the_loop_is_said_once(tmp_path, caplog):
    """The saves in the loop skipped behind a writer stalled past the deadline: said once, naming the checkpoint
    being written and for how long, not at every skipped save."""
    trainer = Trainer(load_config(TINY, [*RUN, "train.max_steps=2", "ckpt.every_steps=0", "run.collective_timeout_s=2",
                                         f"run.output_dir={tmp_path}"]))
    saver = trainer.checkpointer
    _until(saver._writer.ready, "the writer process did not start")
    pid = saver._writer._proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        trainer.state.step = 1
        assert saver.save(wait=False) is not None

        def stalled() -> list[str]:
            return [r.getMessage() for r in caplog.records if "is still being written" in r.getMessage()]

        def skipped_until_said() -> bool:
            trainer.state.step += 1
            assert saver.save(wait=False) is None
            return bool(stalled())

        _until(skipped_until_said, "the stalled writer was not said", timeout_s=30)
        for _ in range(3):
            trainer.state.step += 1
            assert saver.save(wait=False) is None
        said = stalled()
        assert len(said) == 1 and said[0].startswith("checkpoint step_00000001 is still being written after "), said
    finally:
        os.kill(pid, signal.SIGCONT)
        saver.wait(close=True)


def test_an_error_in_the_main_process_decision_reaches_the_other_ranks(tmp_path, monkeypatch):
    """Whatever the main process's decision raises (here: the look at the writer) is the save's failure, told
    to the other ranks in the decision's broadcast: none is left waiting in it."""
    trainer = Trainer(load_config(TINY, [*RUN, "train.max_steps=2", "ckpt.every_steps=0",
                                         f"run.output_dir={tmp_path}"]))
    trainer.checkpointer._writer._proc.kill()  # not needed: closed at once
    trainer.checkpointer.wait(close=True)
    calls, _ = _two_ranks(monkeypatch)
    saver = Checkpointer(trainer.cfg, _Rank0Of2(trainer.accelerator, calls), trainer.run_dir,
                         trainer.checkpointer.parts, trainer.checkpointer.target)
    try:
        def broken() -> bool:
            raise ValueError("48 is not a valid Signals")

        saver._writer.busy = broken
        trainer.state.step = 1
        with pytest.raises(CheckpointError, match=r"^could not save checkpoint step_00000001 \(rank 0: ValueError: 48 "
                                                  r"is not a valid Signals\)"):
            saver.save(wait=False)
        assert calls == [("broadcast", "group 1"), ("broadcast_object_list", "group 1")], calls
    finally:
        del saver._writer.busy
        saver._writer._proc.kill()  # not needed ready: closed at once
        saver.wait(close=True)
