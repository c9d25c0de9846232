"""The checkpoint writer process (ckpt.async_save on the plain and DDP layouts): what it writes, how it fails,
and that it never outlives its rank."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time

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
    """An OSError keeps its errno (a full disk is then named as such by the save that raises it), and the writer
    goes on serving."""
    w = BackgroundWriter()
    try:
        blocker = tmp_path / "checkpoints"
        blocker.write_text("a file where the checkpoints folder should be")
        job = WriteJob(blocker / ".tmp-step_00000001", blocker / "step_00000001",
                       [StagedFile("a.json", "json", {})], {"step": 1}, best=False, keep_last=1, verify=True)
        w.submit(job)
        err = w.wait()
        assert isinstance(err, OSError) and err.errno == errno.ENOTDIR, err
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
