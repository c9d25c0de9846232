"""The checkpoint writer process (ckpt.async_save on the plain and DDP layouts): what it writes, how it fails,
and that it never outlives its rank."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, TINY, child_env, cli_in_process
from safetensors.torch import load_file

from trainer.core.checkpoint import store, writer
from trainer.core.checkpoint.safe_load import weights_only_loading
from trainer.core.checkpoint.writer import BackgroundWriter, StagedFile, WriteJob

pytestmark = pytest.mark.skipif(not writer.supported(), reason="needs memfd and descriptor passing (Linux)")


def _job(tmp_path, files, step=1):
    root = tmp_path / "checkpoints"
    root.mkdir(exist_ok=True)
    name = store.step_dir_name(step)
    return WriteJob(root / f".tmp-{name}", root / name, files, {"step": step}, best=False, keep_last=5, verify=True)


def _wait_ready(w: BackgroundWriter) -> None:
    deadline = time.monotonic() + 60
    while not w.ready():
        assert time.monotonic() < deadline, "the writer process did not start"
        time.sleep(0.05)


def test_the_writer_writes_every_kind_of_file_and_completes_the_checkpoint(tmp_path):
    """Tensors of several dtypes and shapes, nested trees with tuples and numpy arrays, JSON and a copied file;
    the staging memory grows for a larger second job, and each job's files are its own tensors' values."""
    artifact = tmp_path / "vocab.txt"
    artifact.write_text("a b c\n")
    w = BackgroundWriter()
    try:
        _wait_ready(w)
        for step, width in ((1, 3), (2, 50)):
            tensors = {"w": torch.randn(width, 4), "mask": torch.rand(7) > 0.5, "half": torch.randn(5).bfloat16(),
                       "count": torch.tensor(step), "empty": torch.zeros(0, 3)}
            tree = {"state": {0: {"step": torch.tensor(float(step)), "avg": torch.randn(width)}},
                    "groups": [{"betas": (0.9, 0.999), "params": [0]}], "rng": (3, tuple(range(625)), None),
                    "np": ("MT19937", np.arange(624, dtype=np.uint32), 1, 0, 0.0)}
            job = _job(tmp_path, [StagedFile("model.safetensors", "safetensors", tensors, {"format": "pt"}),
                                  StagedFile("optimizer.bin", "torch", tree),
                                  StagedFile("stats.json", "json", {"mean": 1.5}),
                                  StagedFile("vocab.txt", "copy", artifact, artifact=True)], step)
            w.submit(job)
            for t in tensors.values():  # the job holds copies: the training step goes on changing its tensors
                t.zero_() if t.dtype != torch.bool else t.fill_(False)
            assert w.wait() is None
            saved = store.verify_checkpoint(job.final)
            assert saved["step"] == step
            model = load_file(job.final / "model.safetensors")
            assert model["w"].shape == (width, 4) and model["count"].item() == step and model["w"].abs().sum() > 0
            assert model["half"].dtype == torch.bfloat16 and model["empty"].shape == (0, 3)
            with weights_only_loading():
                optimizer = torch.load(job.final / "optimizer.bin", weights_only=True)
            assert optimizer["state"][0]["step"].item() == step and optimizer["groups"][0]["betas"] == (0.9, 0.999)
            assert optimizer["rng"][1] == tuple(range(625)) and (optimizer["np"][1] == np.arange(624)).all()
            assert json.loads((job.final / "stats.json").read_text()) == {"mean": 1.5}
            assert (job.final / "vocab.txt").read_text() == "a b c\n"
    finally:
        w.close()
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000002"


def test_the_writer_rests_in_proportion_to_its_work(tmp_path):
    """At cpu_share 1/3 the writer counts as busy for twice the CPU time its last job took, then takes the next;
    a share outside (0, 1] is refused."""
    with pytest.raises(ValueError, match="cpu_share"):
        BackgroundWriter(cpu_share=0.0)
    w = BackgroundWriter(cpu_share=1 / 3)
    try:
        _wait_ready(w)
        submitted = time.monotonic()
        w.submit(_job(tmp_path, [StagedFile("model.safetensors", "safetensors", {"w": torch.randn(256, 256)})]))
        assert w.wait() is None
        cpu_s = w.jobs_cpu_s
        assert cpu_s > 0 and w.busy()
        while w.busy():
            time.sleep(0.001)
        assert time.monotonic() - submitted >= 3 * cpu_s  # the job (one thread: wall >= CPU time), then 2 x rest
        w.submit(_job(tmp_path, [StagedFile("model.safetensors", "safetensors", {"w": torch.randn(4)})], step=2))
        assert w.wait() is None and w.jobs_cpu_s > cpu_s
    finally:
        w.close()


def test_a_failure_in_the_writer_comes_back_as_the_error_the_disk_gave(tmp_path):
    """A failed job comes back as one line in the disk's words, named by the job's own checkpoint, and the writer
    goes on serving."""
    w = BackgroundWriter()
    try:
        blocker = tmp_path / "checkpoints"
        blocker.write_text("a file where the checkpoints folder should be")
        job = WriteJob(blocker / ".tmp-step_00000001", blocker / "step_00000001",
                       [StagedFile("a.json", "json", {})], {"step": 1}, best=False, keep_last=1, verify=True)
        w.submit(job)
        failure = w.wait()
        assert failure == writer.WriteFailure("step_00000001", f"{job.tmp}: {os.strerror(errno.ENOTDIR)}"), failure
        blocker.unlink()
        w.submit(_job(tmp_path, [StagedFile("a.json", "json", {"x": 1})]))
        assert w.wait() is None
    finally:
        w.close()


def test_the_writer_dies_with_its_rank(tmp_path):
    """A SIGKILLed rank takes its writer with it: no process renames checkpoints under the group that restarts."""
    code = ("import sys, time; from trainer.core.checkpoint.writer import BackgroundWriter; w = BackgroundWriter(); "
            "print(w._proc.pid, flush=True); time.sleep(120)")
    rank = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=child_env(),
                            cwd=ROOT)
    try:
        child = int(rank.stdout.readline())
        os.kill(child, 0)  # alive
        rank.send_signal(signal.SIGTERM)  # a batch system's SIGTERM to the group: the writer ignores it ...
        os.kill(child, signal.SIGTERM)
        rank.wait(timeout=30)
        deadline = time.monotonic() + 30  # ... and dies with the rank
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                return
            if open(f"/proc/{child}/stat").read().split()[2] == "Z":
                return
            time.sleep(0.1)
        pytest.fail(f"writer process {child} outlived its rank")
    finally:
        rank.kill()


def test_staged_checkpoints_hold_what_synchronous_ones_hold(tmp_path, monkeypatch):
    """ckpt.async_save on one process: the writer process writes the checkpoints, file for file the same values
    as synchronous saves at the same steps (model, optimizer, RNG, EMA, trainer state)."""
    staged = []
    submit = BackgroundWriter.submit
    monkeypatch.setattr(BackgroundWriter, "submit", lambda self, job: (staged.append(job.final.name),
                                                                       submit(self, job))[1])
    delay = "task.delay_s=0.05"  # steps long enough for the writer's start-up within the run
    runs = {}
    for mode in ("true", "false"):
        out = tmp_path / mode
        cli_in_process("train", TINY, "train.max_steps=40", "ckpt.every_steps=1", "ckpt.keep_last=50", "eval.every_steps=0",
                       "train.ema_decay=0.9", "log.progress_bar=false", "log.tensorboard=false", delay,
                       f"ckpt.async_save={mode}", f"run.output_dir={out}")
        runs[mode] = out / "checkpoints"
    assert staged, "no checkpoint went to the writer process"
    assert not (runs["true"] / ".staged-artifacts").exists()
    for name in staged:
        a, b = runs["true"] / name, runs["false"] / name
        store.verify_checkpoint(a)
        assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
        for file in ("model.safetensors", "ema.safetensors"):
            ta, tb = load_file(a / file), load_file(b / file)
            assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
        for file in ("optimizer.bin", "random_states_0.pkl"):
            with weights_only_loading():
                oa = torch.load(a / file, weights_only=True)
                ob = torch.load(b / file, weights_only=True)
            assert repr(_plain(oa)) == repr(_plain(ob)), file
        sa, sb = (json.loads((p / "trainer_state.json").read_text()) for p in (a, b))
        assert sa == sb


def _plain(tree):
    if isinstance(tree, torch.Tensor):
        return tree.tolist()
    if isinstance(tree, np.ndarray):
        return tree.tolist()
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_plain(v) for v in tree]
    return tree


# ---------------------------------------------------------------------- a writer process that is gone or stalls
def _returns(call, timeout_s: float = 60):
    """`call()`'s result, run in a thread: a call that never returns fails the test instead of hanging it."""
    result = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"{call} did not return"
    return result[0]


def _dead(w: BackgroundWriter) -> None:
    os.kill(w._proc.pid, signal.SIGKILL)
    while w._proc.poll() is None:
        time.sleep(0.01)


def test_a_writer_killed_before_it_is_ready_is_noticed_at_once():
    """Killed while it imports (OOM, a kill): the rank neither spins nor waits; the writer says how it ended."""
    w = BackgroundWriter()
    try:
        _dead(w)
        assert _returns(lambda: (w.ready(), w.busy())) == (False, False)
        assert w.stopped == "the checkpoint writer process was killed by SIGKILL before it was ready"
    finally:
        _returns(w.close)


def test_a_writer_that_cannot_start_is_noticed_with_its_exit_code(monkeypatch):
    monkeypatch.setattr(sys, "executable", shutil.which("false"))  # exits 1 at once, as a failed import does
    w = BackgroundWriter()
    monkeypatch.undo()
    try:
        assert _returns(lambda: _until(lambda: w.stopped is not None or w.ready())) is True
        assert not w.ready() and not w.busy()
        assert w.stopped == "the checkpoint writer process exited with code 1 before it was ready"
    finally:
        _returns(w.close)


def _until(condition, timeout_s: float = 50) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_submit_to_a_dead_writer_says_it_is_gone(tmp_path):
    """Killed while idle: the next look notices it (no broken pipe on the step); a submit says so too."""
    w = BackgroundWriter()
    try:
        _wait_ready(w)
        _dead(w)
        assert _returns(w.busy) is False and not w.ready()
        with pytest.raises(writer.WriterStopped, match="killed by SIGKILL"):
            w.submit(_job(tmp_path, [StagedFile("a.json", "json", {"x": 1})]))
        assert w.wait() is None and not (tmp_path / "checkpoints" / "step_00000001").exists()
    finally:
        _returns(w.close)


def test_a_submit_that_meets_a_broken_pipe_says_the_writer_is_gone(tmp_path):
    w = BackgroundWriter()
    try:
        _wait_ready(w)
        _dead(w)  # not looked at since: the submit is the first to meet it
        with pytest.raises(writer.WriterStopped, match="killed by SIGKILL"):
            w.submit(_job(tmp_path, [StagedFile("w.safetensors", "safetensors", {"w": torch.randn(64)})]))
        assert w.stopped == "the checkpoint writer process was killed by SIGKILL" and not w.busy()
    finally:
        _returns(w.close)


def test_a_writer_killed_while_writing_gives_the_checkpoint_up(tmp_path):
    """The job it held is told as lost (not the disk's failure), named by its own checkpoint."""
    w = BackgroundWriter()
    try:
        _wait_ready(w)
        os.kill(w._proc.pid, signal.SIGSTOP)  # holds the job, as a write in progress does
        w.submit(_job(tmp_path, [StagedFile("a.json", "json", {"x": 1})], step=7))
        assert w.busy()
        os.kill(w._proc.pid, signal.SIGKILL)
        failure = _returns(w.wait)
        assert failure.lost and failure.checkpoint == "step_00000007", failure
        assert failure.reason == "the checkpoint writer process was killed by SIGKILL while writing it"
        assert not w.busy() and not w.ready()
    finally:
        _returns(w.close)


def test_a_write_that_stalls_past_the_deadline_is_an_error(tmp_path):
    """A stalled filesystem (here: the writer stopped) does not hold the rank past the deadline: the checkpoint is
    a failure, the writer process is ended, and closing returns."""
    w = BackgroundWriter()
    try:
        _wait_ready(w)
        os.kill(w._proc.pid, signal.SIGSTOP)
        w.submit(_job(tmp_path, [StagedFile("a.json", "json", {"x": 1})], step=3))
        failure = _returns(lambda: w.wait(timeout_s=0.5))
        assert not failure.lost and failure.checkpoint == "step_00000003", failure
        assert "not completed within 0.5 s" in failure.reason
        assert w.stopped is not None and w._proc.poll() is not None
    finally:
        _returns(w.close)


def test_the_writer_judges_the_disk_before_it_removes_the_partial_output(tmp_path, monkeypatch):
    """A write that fails with words that name no cause, on a disk left with less than 1 MiB: a full disk, with
    what the job had written (measured before the writer removed it); the temp folder is then gone."""
    from collections import namedtuple

    def save(tensors, path, metadata=None):
        Path(path).write_bytes(b"x" * 3000)
        raise RuntimeError("basic_ios::clear: iostream error")

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(writer, "save_file", save)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, (1 << 30) - 4096, 4096))
    job = _job(tmp_path, [StagedFile("model.safetensors", "safetensors", {"w": torch.zeros(4)})], step=4)
    reply, warnings = writer.write_job(job, None)
    kind, reason = reply
    assert kind == "error" and reason.startswith(f"no space left on device writing {job.tmp} ("), reply
    assert reason.endswith(" of it written)") and " (0 B of it written)" not in reason, reason  # measured before
    assert warnings == [] and not job.tmp.exists()


def test_a_rank_that_leaves_a_reply_unread_ends_its_writer_quietly(tmp_path):
    """A rank that exits between a job's end and reading its reply (an elastic restart) resets the connection:
    the writer process ends as at a plain close, without a traceback on the rank's terminal."""
    w = BackgroundWriter()
    try:
        _wait_ready(w)
        w.submit(_job(tmp_path, [StagedFile("a.json", "json", {"x": 1})]))
        assert _until(lambda: w._readable(0.0)), "the writer did not reply"
        w._selector.close()
        w._sock.close()  # the reply unread
        assert w._proc.wait(timeout=30) == 0
    finally:
        w._proc.kill()
        w._proc.wait()


def test_the_writer_serves_a_rank_with_more_than_a_thousand_open_files(tmp_path):
    """The connection's descriptor past 1023 (a rank with many open files: data shards, sockets): still watched."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1100:
        pytest.skip(f"the hard limit on open files ({hard}) is below 1100")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1100), hard))
    held = []
    try:
        while not held or held[-1] < 1030:
            held.append(os.open(os.devnull, os.O_RDONLY))
        w = BackgroundWriter()
        try:
            assert w._sock.fileno() >= 1024
            _wait_ready(w)
            w.submit(_job(tmp_path, [StagedFile("a.json", "json", {"x": 1})]))
            assert w.wait() is None and w.stopped is None
        finally:
            w.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_closing_a_writer_that_a_kill_does_not_end_returns(tmp_path, monkeypatch):
    """A writer stuck in uninterruptible I/O (here: stopped, its kills lost) past the deadline: `wait` gives the job
    up and `close` returns, the process left with its SIGKILL pending; no wait on it is unbounded."""
    monkeypatch.setattr(writer, "_REAP_S", 0.2, raising=False)
    monkeypatch.setattr(writer, "_EXIT_S", 0.2, raising=False)
    w = BackgroundWriter()
    pid = w._proc.pid
    try:
        _wait_ready(w)
        os.kill(pid, signal.SIGSTOP)
        monkeypatch.setattr(w._proc, "kill", lambda: None)  # the kill does not take effect
        w.submit(_job(tmp_path, [StagedFile("a.json", "json", {"x": 1})], step=2))
        failure = _returns(lambda: w.wait(timeout_s=0.2))
        assert failure.checkpoint == "step_00000002" and "not completed within 0.2 s" in failure.reason, failure
        _returns(w.close, timeout_s=30)
    finally:
        os.kill(pid, signal.SIGKILL)
        w._proc.wait(timeout=30)


@pytest.mark.skipif(not hasattr(signal, "SIGRTMIN"), reason="needs real-time signals")
def test_a_writer_killed_by_a_signal_python_has_no_name_for_is_said_by_number():
    """A real-time signal (SIGRTMIN + 6) ends the writer: it is told as 'signal N', not a ValueError on the step."""
    w = BackgroundWriter()
    try:
        _wait_ready(w)
        number = signal.SIGRTMIN + 6
        os.kill(w._proc.pid, number)
        assert _returns(lambda: _until(lambda: not w.ready())) is True
        assert w.stopped == f"the checkpoint writer process was killed by signal {number}"
    finally:
        _returns(w.close)
