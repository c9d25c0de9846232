"""Elastic membership on torch's elastic agent: a node lost or added mid-run, the run goes on at the new size and
ends at the weights of the fault-free run (1e-5).

Each "node" is an agent (`trainer train --nnodes 1:2 --nproc-per-node 1 --rdzv 127.0.0.1:PORT`) in a process group
of its own, on one host with gloo; a node is lost by SIGKILL of its whole group. The reference is one process with
the same global batch (32). The rendezvous settings are trainer's for 2 nodes (core/elastic_launch.py
`rendezvous_settings`: a dead node leaves the rendezvous after 3 s); regression steps are slowed (task.delay_s) so a
kill or a join lands mid-run.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    BIN,
    ROOT,
    TINY,
    assert_run_matches,
    child_env,
    cli_in_process,
    free_port,
    read_jsonl,
    run_cmd,
)

from trainer.core.elastic import PROGRESS_FILE, MembershipWatch, lost_peer, read_progress
from trainer.core.elastic_launch import (
    ElasticSpec,
    agent_command,
    default_run_id,
    reachable,
    refused_node_counts,
    rendezvous_settings,
    sizes_that_keep,
)
from trainer.errors import ConfigError

# backend -> (trainer train flags, environment): FSDP2 as `accelerate launch` with accelerate_configs/fsdp.yaml
# exports it (the survivor alone runs one plain process, from the converted FSDP checkpoint).
BACKENDS = {
    "ddp": ([], {}),
    "ddp_async": ([], {}),
    "fsdp": ([], {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "NO_WRAP",
                  "FSDP_RESHARD_AFTER_FORWARD": "true", "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT"}),
    "zero2": (["--deepspeed", str(ROOT / "ds_configs" / "zero2.json")], {}),
}
RUN = ["train.max_steps=30", "train.global_batch_size=32", "train.per_device_batch_size=16", "train.ema_decay=0.9",
       "eval.every_steps=0", "ckpt.every_steps=1", "ckpt.keep_last=2", "log.every_steps=1", "log.progress_bar=false",
       "log.tensorboard=false", "optim.lr=0.01"]


# ------------------------------------------------------------------------------------------------ unit
def test_spec_parses_and_builds_the_agent_command():
    spec = ElasticSpec.parse("1:2", 2, "node0:29400", None, None, "last_call_timeout=5")
    assert (spec.min_nodes, spec.max_nodes, spec.nproc_per_node, spec.max_restarts) == (1, 2, 2, 3)
    cmd = agent_command(spec, "job", ["train", "c.yaml"])
    assert "--nnodes=1:2" in cmd and "--rdzv-backend=c10d" in cmd and "--rdzv-endpoint=node0:29400" in cmd
    conf = next(w for w in cmd if w.startswith("--rdzv-conf="))
    assert "last_call_timeout=5" in conf and "keep_alive_interval=1" in conf
    assert cmd[-3:] == ["trainer", "train", "c.yaml"]
    for bad in (("2:1", 1, "h:1"), ("x", 1, "h:1"), ("1:2", 1, None)):
        with pytest.raises(ConfigError):
            ElasticSpec.parse(*bad)


def test_lost_peer_is_one_line_only_under_a_restarting_agent():
    err = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:8625. This is typically ...")
    elastic = {"TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_MAX_RESTARTS": "3", "RANK": "1"}
    line = lost_peer(err, elastic)
    assert line.startswith("trainer: rank 1 lost a peer") and "\n" not in line
    assert lost_peer(err, {"TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_MAX_RESTARTS": "0"}) is None
    assert lost_peer(ValueError("a bug"), elastic) is None


def test_a_size_that_cannot_keep_the_global_batch_names_those_that_can():
    from trainer.config import load_config
    from trainer.core.batch_plan import plan_batch

    assert sizes_that_keep(12) == [1, 2, 3, 4, 6, 12]
    spec = ElasticSpec.parse("1:4", 2, "localhost:29400")
    assert refused_node_counts(spec, 16) == (
        "--nnodes 1:4 x 2 processes: a group of 3 node(s) cannot keep the global batch of 16 (each would be refused "
        "at its start, costing a restart); node counts that keep it: 1, 2, 4")
    assert refused_node_counts(spec, 24) is None and refused_node_counts(spec, 0) is None
    cfg = load_config(TINY, ["train.global_batch_size=32"])
    with pytest.raises(ConfigError, match="the sizes that keep it: 1, 2, 4, 8, 16, 32 processes"):
        plan_batch(cfg, world=3)


def test_the_launcher_side_imports_no_torch():
    """`trainer train --nnodes` builds the agent's command line before anything imports torch."""
    import sys

    code = ("import sys, trainer.core.elastic_launch, trainer.core.launch, trainer.core.rank_errors; "
            "print([m for m in ('torch', 'accelerate') if m in sys.modules])")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip() == "[]"


def test_rendezvous_settings_grow_with_the_node_count():
    """Short timeouts up to a few nodes; above, eviction and the last call grow with the node count up to torch's
    defaults (5 s x 3, 30 s), so a stall of one agent among many does not evict it and late survivors make the round."""
    assert rendezvous_settings(2) == rendezvous_settings(4) == {
        "join_timeout": 600, "last_call_timeout": 2, "close_timeout": 10, "keep_alive_interval": 1,
        "keep_alive_max_attempt": 3}
    eight, sixteen, many = rendezvous_settings(8), rendezvous_settings(16), rendezvous_settings(256)
    assert (eight["keep_alive_interval"], eight["last_call_timeout"]) == (2, 4)
    assert (sixteen["keep_alive_interval"], sixteen["last_call_timeout"]) == (4, 8)
    assert (many["keep_alive_interval"], many["keep_alive_max_attempt"], many["last_call_timeout"]) == (5, 3, 30)
    for key in ("keep_alive_interval", "last_call_timeout", "close_timeout"):
        values = [rendezvous_settings(n)[key] for n in range(1, 300)]
        assert values == sorted(values), key
    # The agent gets the settings for MAX nodes, the user's --rdzv-conf over them.
    conf = next(w for w in agent_command(ElasticSpec.parse("2:16", 8, "head:29400", rdzv_conf="last_call_timeout=9"),
                                         "job", ["train", "c.yaml"]) if w.startswith("--rdzv-conf="))
    assert "keep_alive_interval=4" in conf and "last_call_timeout=9" in conf and "last_call_timeout=8" not in conf


def test_the_default_run_id_is_the_output_folder_also_under_slurm(tmp_path):
    """Two runs in one SLURM allocation (two folders) are two rendezvous runs; every node of one agrees."""
    slurm = {"SLURM_JOB_ID": "4242"}
    a, b = default_run_id(tmp_path / "a", slurm), default_run_id(tmp_path / "b", slurm)
    assert a != b and a.startswith("slurm-4242-") and b.startswith("slurm-4242-")
    assert default_run_id(tmp_path / "a" / ".." / "a", slurm) == a
    assert default_run_id(tmp_path / "a", {}) != a and default_run_id(tmp_path / "a", {}).startswith("run-")


def test_progress_is_rewritten_at_most_every_interval_and_when_the_group_stops(tmp_path):
    """elastic.json on a shared file system: the first step, then at most every `every_s`, and a stopped group's last
    step exactly (the next group counts the steps it redoes from it); 0 rewrites every step."""
    environ = {"TORCHELASTIC_RUN_ID": "job", "GROUP_WORLD_SIZE": "2"}
    watch = MembershipWatch(tmp_path, True, 4, 0, lambda record: None, environ, every_s=3600)
    for step in range(1, 6):
        watch.after_step(step)
    assert read_progress(tmp_path)["step"] == 1
    watch.finish("preempted")
    assert read_progress(tmp_path) | {"time": 0} == {"run_id": "job", "step": 5, "time": 0, "world_size": 4, "nodes": 2}
    watch.finish("completed")
    assert not (tmp_path / PROGRESS_FILE).exists()

    every_step = MembershipWatch(tmp_path, True, 4, 0, lambda record: None, {**environ, "TRAINER_ELASTIC_PROGRESS_S": "0"})
    for step in range(1, 4):
        every_step.after_step(step)
        assert read_progress(tmp_path)["step"] == step
    assert MembershipWatch(tmp_path, True, 4, 0, lambda record: None, environ).every_s == 1.0  # the default


def test_the_agent_that_hosts_the_store_says_that_its_loss_ends_the_job():
    import socket

    from trainer.core.launch import store_host_line

    port = free_port()
    line = store_host_line(ElasticSpec.parse("1:2", 1, f"127.0.0.1:{port}"))
    assert line is not None and "losing this node ends the job" in line and f"trainer rendezvous --port {port}" in line
    assert store_host_line(ElasticSpec.parse("1:2", 1, f"127.0.0.1:{port}", rdzv_conf="is_host=false")) is None
    assert store_host_line(ElasticSpec.parse("1:2", 1, f"192.0.2.1:{port}")) is None  # another machine (TEST-NET)
    with socket.socket() as held:  # a `trainer rendezvous` (or an agent before this one) holds the port
        held.bind(("127.0.0.1", 0))
        held.listen()
        assert store_host_line(ElasticSpec.parse("1:2", 1, f"127.0.0.1:{held.getsockname()[1]}")) is None


def test_the_rendezvous_store_survives_a_hang_up_and_ends_on_sigterm():
    """`trainer rendezvous` started from a shell that closes (SIGHUP) goes on serving; SIGTERM ends it cleanly."""
    import re

    store = subprocess.Popen([str(BIN / "trainer"), "rendezvous", "--host", "127.0.0.1", "--port", "0"],
                             env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while "rendezvous store on" not in line:
            line = store.stderr.readline()
            assert line or store.poll() is None, "trainer rendezvous ended before serving"
        port = int(re.search(r"rendezvous store on 127\.0\.0\.1:(\d+)", line).group(1))
        store.send_signal(signal.SIGHUP)
        with pytest.raises(subprocess.TimeoutExpired):
            store.wait(timeout=1)
        assert _listening(port)
        store.send_signal(signal.SIGTERM)
        assert store.wait(timeout=30) == 0
    finally:
        if store.poll() is None:
            store.kill()
            store.wait()


# ------------------------------------------------------------------------------------------------ agents
@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("elastic") / "reference"
    run_cmd([str(BIN / "trainer"), "train", TINY, *RUN, f"run.output_dir={out}"], timeout=300)
    return out


def _listening(port: int) -> bool:
    return reachable(f"127.0.0.1:{port}")


def _wait(what: str, until, timeout: float = 120, procs: tuple[subprocess.Popen, ...] = ()):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = until()
        if value:
            return value
        for proc in procs:
            assert proc.poll() is None, f"an agent ended (status {proc.returncode}) while waiting for {what}"
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Agents:
    """Agents of one elastic run, each in a process group of its own; the output of agent i in `out`.i.log."""

    def __init__(self, out: Path, port: int, extra: list[str], backend: str = "ddp"):
        self.out, self.port, self.extra = out, port, extra
        self.flags, self.env = BACKENDS[backend]
        self.procs: list[subprocess.Popen] = []

    def start(self) -> subprocess.Popen:
        log = open(f"{self.out}.{len(self.procs)}.log", "w")  # noqa: SIM115 - closed with the test's tmp dir
        proc = subprocess.Popen(
            [str(BIN / "trainer"), "train", TINY, "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv",
             f"127.0.0.1:{self.port}", *self.flags, *RUN, f"run.output_dir={self.out}", *self.extra],
            env={**child_env(), **self.env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def progress(self) -> dict:
        return read_progress(self.out) or {}

    def output(self, i: int) -> str:
        return Path(f"{self.out}.{i}.log").read_text()

    def finish(self, *survivors: int, timeout: float = 180) -> str:
        for i in survivors:
            assert self.procs[i].wait(timeout=timeout) == 0, self.output(i)[-4000:]
        return "".join(self.output(i) for i in survivors)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def agents(tmp_path):
    made: list[Agents] = []

    def make(port: int | None = None, *extra: str, backend: str = "ddp") -> Agents:
        made.append(Agents(tmp_path / "run", port or free_port(), list(extra), backend))
        return made[-1]
    yield make
    for group in made:
        group.close()


def _check_membership(out: Path, output: str, change: str, reference: Path, max_redone: int = 1) -> None:
    assert f"membership changed: {change}" in output, output[-4000:]
    assert "Traceback" not in output and "torch/distributed/elastic" not in output, output[-4000:]
    records = [r for r in read_jsonl(out) if r.get("event") == "membership"]
    assert records and records[-1]["steps_redone"] <= max_redone and records[-1]["recovery_s"] > 0, records
    assert_run_matches(reference, out, 1e-5)


def _kill_at_random_step(group: Agents, victim: int) -> None:
    step = random.randint(3, 12)
    _wait(f"step {step} at world size 2", lambda: group.progress().get("world_size") == 2
          and group.progress().get("step", 0) >= step, procs=tuple(group.procs))
    os.killpg(group.procs[victim].pid, signal.SIGKILL)
    group.procs[victim].wait()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["ddp_async", "fsdp", pytest.param("zero2", marks=pytest.mark.extended)])
def test_a_node_lost_the_survivor_finishes_at_world_size_one(agents, reference, backend):
    # ddp_async: each checkpoint completed by the main process's background thread (ckpt.async_save)
    extra = ["ckpt.async_save=true"] if backend.endswith("_async") else []
    group = agents(None, "task.delay_s=0.05", *extra, backend=backend)
    group.start()
    _wait("the first agent to host the rendezvous store", lambda: _listening(group.port), procs=tuple(group.procs))
    group.start()
    _kill_at_random_step(group, victim=1)
    # ckpt.async_save skips a save asked for while the previous one is being written, so on a busy machine the
    # newest complete checkpoint may be a few steps behind the last step; exactness is what assert_run_matches checks
    _check_membership(group.out, group.finish(0), "2 -> 1 nodes (world 2 -> 1)", reference,
                      max_redone=5 if extra else 1)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_node_joins_the_group_restarts_at_world_size_two(agents, reference):
    group = agents(None, "task.delay_s=0.35")  # the run outlasts the new agent's start-up
    group.start()
    _wait("two steps at world size 1", lambda: group.progress().get("step", 0) >= 2, procs=tuple(group.procs))
    group.start()
    output = group.finish(0, 1)
    _check_membership(group.out, output, "1 -> 2 nodes (world 1 -> 2)", reference)


@pytest.mark.slow
@pytest.mark.distributed
def test_the_agent_that_would_host_the_store_dies_the_job_finishes(agents, reference, tmp_path):
    port = free_port()
    store = subprocess.Popen([str(BIN / "trainer"), "rendezvous", "--host", "127.0.0.1", "--port", str(port)],
                             env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait("the rendezvous store", lambda: _listening(port), procs=(store,))
        # The time cadence instead of the step cadence: the two ranks agree on the step of each save.
        group = agents(port, "task.delay_s=0.05", "ckpt.every_steps=0", "ckpt.every_seconds=0.01")
        group.start()
        group.start()
        _kill_at_random_step(group, victim=0)
        # The agreed time cadence saves at most every other step (a rank reads the agreement one step late), and a
        # step's progress is recorded before its save: a kill during a save redoes two steps.
        _check_membership(group.out, group.finish(1), "2 -> 1 nodes (world 2 -> 1)", reference, max_redone=2)
    finally:
        store.send_signal(signal.SIGTERM)
        assert store.wait(timeout=30) == 0
    assert f"rendezvous store on 127.0.0.1:{port}" in store.stdout.read()


def test_the_time_cadence_is_due_once_the_time_is_up(monkeypatch):
    from trainer.core.checkpoint import cadence

    now = [100.0]
    monkeypatch.setattr(cadence.time, "monotonic", lambda: now[0])
    clock = cadence.SaveClock(60.0, world_size=1)
    assert not clock.due()
    now[0] += 61
    assert clock.due()
    clock.reset()
    assert not clock.due()
    assert not cadence.SaveClock(0.0, world_size=1).due()


def test_async_saves_end_where_synchronous_ones_do(tmp_path):
    """ckpt.async_save: checkpoints completed in the background (or skipped while one is), every one complete and
    verified, the last one the final step's, and the same weights as synchronous saves."""
    from trainer.core.checkpoint import store

    runs = {}
    for mode in ("true", "false"):
        out = tmp_path / mode
        cli_in_process("train", TINY, *RUN, "train.max_steps=12", f"ckpt.async_save={mode}", "ckpt.keep_last=20",
                       f"run.output_dir={out}")
        checkpoints = sorted((out / "checkpoints").glob("step_*"))
        assert checkpoints[-1].name == "step_00000012" and not list((out / "checkpoints").glob(".tmp-*"))
        for path in checkpoints:
            store.verify_checkpoint(path)
        runs[mode] = out
    assert_run_matches(runs["false"], runs["true"], 0.0)


def test_a_restarted_group_takes_over_the_lock_of_an_earlier_one(tmp_path, monkeypatch):
    """The lock of an earlier worker group of the same elastic run, still flocked (a lost node's, as a shared file
    system may keep it), is taken over at once; another run's is not."""
    import sys

    from trainer.core.run_lock import RunLockedError, acquire_run_lock

    lock = tmp_path / ".lock"
    holder = json.dumps({"host": "lost-node", "pid": 1, "elastic_run": "job-1"})
    hold = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX); "
        "os.write(fd, sys.argv[2].encode()); print('held', flush=True); time.sleep(60)"), str(lock), holder],
        stdout=subprocess.PIPE, text=True)
    try:
        assert hold.stdout.readline().strip() == "held"
        monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-2")
        with pytest.raises(RunLockedError):
            acquire_run_lock(tmp_path)
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
        taken = acquire_run_lock(tmp_path)
        assert json.loads(lock.read_text())["pid"] == os.getpid()
        taken.release()
    finally:
        hold.kill()
        hold.wait()


def test_only_a_restarted_group_overrides_run_resume(tmp_path):
    from trainer.config import load_config
    from trainer.core.elastic import resume_on_restart

    (tmp_path / "elastic.json").write_text(json.dumps({"run_id": "r", "step": 3, "nodes": 2}))
    cfg = load_config(TINY, [f"run.output_dir={tmp_path}", "run.resume=none"])
    same = {"TORCHELASTIC_RUN_ID": "r", "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "0"}
    assert resume_on_restart(cfg, same).run.resume == "none"  # a new launch of the same run at the same size
    assert resume_on_restart(cfg, {**same, "GROUP_WORLD_SIZE": "1"}).run.resume == "auto"  # a node lost or added
    assert resume_on_restart(cfg, {**same, "TORCHELASTIC_RESTART_COUNT": "1"}).run.resume == "auto"  # a failure
    assert resume_on_restart(cfg, {**same, "TORCHELASTIC_RUN_ID": "other"}).run.resume == "none"


def test_progress_is_read_back(tmp_path):
    (tmp_path / "elastic.json").write_text(json.dumps({"run_id": "r", "step": 3}))
    assert read_progress(tmp_path) == {"run_id": "r", "step": 3}
    assert read_progress(tmp_path / "none") is None
