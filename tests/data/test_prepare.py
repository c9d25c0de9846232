"""`trainer data prepare CONFIG` for any family: the Task contract's default `prepare_data()` builds the data
(`build_data()`) under the run's build lock and the command prints what was built. The protein task's own
`prepare_data` and the run after it: tests/families/protein_sedd/test_prepare_data.py."""

from __future__ import annotations

import json

from conftest import ROOT, cli_in_process

from trainer.config import load_config
from trainer.data.build_lock import task_build_key
from trainer.data.fetch import human_size
from trainer.task import Task

CONFIG = str(ROOT / "configs" / "regression" / "tiny.yaml")


def test_default_prepare_builds_the_data_under_the_build_lock(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRAINER_CACHE_DIR", str(tmp_path))  # the lock folder of a task without task.cache_dir
    calls = []
    real = Task.prepare_data
    monkeypatch.setattr(Task, "prepare_data", lambda self: calls.append(self.cfg.name) or real(self))
    cli_in_process("data", "prepare", CONFIG, "task.num_train=300")
    out = capsys.readouterr().out
    assert calls == ["regression"]
    assert "prepared the data of task regression" in out and "records: train 300, eval 50" in out  # tiny.yaml's eval
    assert f"cache:   {tmp_path}" in out
    stamp = json.loads((tmp_path / ".build-regression.lock").read_text())  # the lock a run's build_data takes
    cfg = load_config(CONFIG, ["task.num_train=300"])
    assert stamp["built"] == task_build_key(cfg.task, cfg.run.seed)


def test_human_size():
    assert [human_size(n) for n in (999, 1000, 3_400_000, 24_000_000_000)] == ["999 B", "1.0 KB", "3.4 MB", "24.0 GB"]
