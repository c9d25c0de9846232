"""At a stop (SIGTERM from a launcher or a batch system) the last checkpoint's wait ends inside the window the launcher
gives the rank before its SIGKILL, not at the collective timeout's deadline: a checkpoint a stalled filesystem holds
is given up, said once, and the run stops as a stop does."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest
from conftest import TINY

from trainer.config import load_config
from trainer.core.checkpoint import manager, store, writer
from trainer.core.trainer import Trainer

pytestmark = [pytest.mark.usefixtures("fresh_accelerate"),
              pytest.mark.skipif(not writer.supported(), reason="needs memfd and descriptor passing (Linux)")]
RUN = ["train.ema_decay=0", "eval.every_steps=0", "log.progress_bar=false", "log.tensorboard=false",
       "ckpt.async_save=true", "ckpt.every_steps=1", "train.max_steps=100000", "task.delay_s=0.01",
       "run.collective_timeout_s=120"]  # a deadline of tens of seconds for a save in the loop


def test_the_stop_window_is_the_agents_shutdown_timeout():
    assert manager.stop_window_s({}) == manager.AGENT_STOP_S
    assert manager.stop_window_s({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "240"}) == 240
    assert manager.stop_window_s({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"}) == manager.AGENT_STOP_S
    # An agent that restarts its group stops it for a join with its fixed default, whatever the variable says.
    elastic = {"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_MAX_RESTARTS": "3"}
    assert manager.stop_window_s({**elastic, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "240"}) == manager.AGENT_STOP_S
    assert manager.stop_window_s({**elastic, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "20"}) == 20


@pytest.mark.parametrize("signal_at", ["the save's step", "a later step"])
def test_a_checkpoint_stalled_at_a_stop_is_given_up_inside_the_stop_window(tmp_path, monkeypatch, caplog, signal_at):
    """The writer stalls (stopped, as a filesystem that does not answer) with the loop's checkpoint; SIGTERM comes
    at that step (the stop waits for it) or steps later (the saves in between were skipped: the stop's own save
    waits for it first). Either way the wait ends a few seconds after the signal, where the launcher's window
    ends less the margin, not at the save deadline (a minute here, half an hour by default): the checkpoint is given
    up in one line, no checkpoint is written at the stop, and the run stops as preempted."""
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(manager.STOP_MARGIN_S + 2))
    submit, stalled = writer.BackgroundWriter.submit, []

    def submit_and_stall(self, job):
        if not stalled:
            os.kill(self._proc.pid, signal.SIGSTOP)  # the job stays pending
            stalled.append(job.final.name)
            if signal_at == "the save's step":
                os.kill(os.getpid(), signal.SIGTERM)  # the stop comes at this step's end
            else:
                threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        submit(self, job)

    monkeypatch.setattr(writer.BackgroundWriter, "submit", submit_and_stall)
    trainer = Trainer(load_config(TINY, [*RUN, f"run.output_dir={tmp_path}"]))
    assert trainer.checkpointer._writer_timeout_s > 2 * manager.STOP_MARGIN_S
    with caplog.at_level(logging.WARNING, logger="trainer"):
        assert trainer.fit() == "preempted"
    if signal_at == "a later step":
        assert trainer.state.step > int(stalled[0].removeprefix("step_"))
    given_up = [r.getMessage() for r in caplog.records if "given up" in r.getMessage()]
    assert len(given_up) == 1, given_up
    assert given_up[0].startswith(f"stopping: checkpoint {stalled[0]} was still being written when the stop window "
                                  f"ran out ({manager.STOP_MARGIN_S + 2:g} s from the stop signal to the launcher's "
                                  f"SIGKILL (TORCH_ELASTIC_SHUTDOWN_TIMEOUT)"), given_up
    assert trainer.checkpointer._writer is None
    root = tmp_path / "checkpoints"
    assert not (root / stalled[0]).exists()
    assert not (root / f"step_{trainer.state.step:08d}").exists()  # no checkpoint written at the stop
    assert (tmp_path / "preempted.json").is_file()
    latest = store.latest_checkpoint(root)
    assert f"stop requested by SIGTERM at step {trainer.state.step}: no checkpoint of it was written (the latest " \
           f"complete one is {latest.name}), exiting with status 75" in caplog.text


def test_a_completion_thread_stalled_at_a_stop_is_given_up_too(tmp_path, monkeypatch, caplog):
    """On the layouts that write on the step a thread completes the checkpoint: at a stop, one the filesystem holds
    is given up at the stop window's end as well (said once, not raised), and the stop's save is skipped."""
    trainer = Trainer(load_config(TINY, [*RUN, "train.max_steps=2", f"run.output_dir={tmp_path}"]))
    saver = trainer.checkpointer
    saver._close_writer()  # saves in the background are written on the step, completed by the thread
    stalled = threading.Event()
    complete = manager.store.complete_checkpoint
    monkeypatch.setattr(manager.store, "complete_checkpoint", lambda *a, **k: (stalled.wait(60), complete(*a, **k))[1])
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(manager.STOP_MARGIN_S + 1))
    try:
        trainer.state.step = 1
        assert saver.save(wait=False) is not None
        monkeypatch.setattr(manager, "stop_requested_at", time.monotonic)  # a stop signal arrives now
        trainer.state.step = 2
        with caplog.at_level(logging.WARNING, logger="trainer"):
            assert saver.save() is None  # the stop's own save: skipped once the one before it was given up
            assert saver.wait(close=True) is None
        given_up = [r.getMessage() for r in caplog.records if "given up" in r.getMessage()]
        assert len(given_up) == 1 and given_up[0].startswith("stopping: checkpoint step_00000001 was still being "
                                                             "written when the stop window ran out"), given_up
    finally:
        stalled.set()


def test_a_given_up_completion_that_fails_later_is_not_raised_afterwards(tmp_path, monkeypatch):
    """The filesystem answers after the stop gave the checkpoint up, with an error: that checkpoint was already said
    to be given up, so a later wait (the run's end) does not raise its failure."""
    trainer = Trainer(load_config(TINY, [*RUN, "train.max_steps=2", f"run.output_dir={tmp_path}"]))
    saver = trainer.checkpointer
    saver._close_writer()
    stalled, failed = threading.Event(), threading.Event()

    def complete_after_the_stall(*args, **kwargs):
        stalled.wait(60)
        try:
            raise OSError(5, "Input/output error")
        finally:
            failed.set()

    monkeypatch.setattr(manager.store, "complete_checkpoint", complete_after_the_stall)
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(manager.STOP_MARGIN_S + 1))
    trainer.state.step = 1
    assert saver.save(wait=False) is not None
    monkeypatch.setattr(manager, "stop_requested_at", time.monotonic)
    assert saver.wait() is None  # given up
    stalled.set()
    assert failed.wait(10)
    time.sleep(0.2)  # the thread records what it records after the failure
    assert saver.wait(close=True) is None


@pytest.mark.parametrize("received, agreed_signal, capped", [
    ("SIGTERM", "SIGTERM", True),   # the launcher's or batch system's stop: a SIGKILL follows
    (None, "SIGTERM", True),        # a stop learnt from the other ranks: theirs may be one
    ("SIGINT", "SIGINT", False),    # Ctrl-C: nothing kills the process
    ("SIGUSR1", "SIGUSR1", False),  # SLURM's early warning: the job has minutes
    (None, None, False),            # no stop
])
def test_only_a_stop_a_sigkill_may_follow_caps_the_wait(monkeypatch, received, agreed_signal, capped):
    from trainer.core import preemption

    class Watcher:
        pass

    watcher = Watcher()
    watcher.received, watcher.stop_signal = received, agreed_signal
    watcher.received_at = 12.5 if agreed_signal else None
    monkeypatch.setattr(preemption.PreemptionWatcher, "_active", watcher)
    assert preemption.stop_requested_at() == (12.5 if capped else None)
