"""A collective's timeout is a lost peer only when a peer really is gone. Two gloo processes of a restartable group
(short collective timeout), each beating its counter in the group's store: a rank that skips a collective while
alive leaves its peer timing out with every rank alive, the run's own error (recorded as one, not restarted); a rank
that vanishes without closing its connections (stopped, as a node cut off) is a lost peer; a killed one too, at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env, free_port

from trainer.core import elastic
from trainer.core.rank_errors import FAILED_FILE

RANK = """
import datetime, json, os, signal, sys, time
import torch, torch.distributed as dist
from trainer.core import elastic
from trainer.core.rank_errors import describe_failure, report_rank_failure

case, run_dir = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=2))
rank = dist.get_rank()
assert elastic.start_heartbeat() is not None
dist.barrier()
if rank == 1:
    if case == "skips the collective":
        time.sleep(12)  # alive (its heartbeat goes on) but never joins the all-reduce
        os._exit(0)
    if case == "vanishes":
        os.kill(os.getpid(), signal.SIGSTOP)  # no connection closed, no heartbeat: a node cut off
    if case == "is killed":
        os.kill(os.getpid(), signal.SIGKILL)
time.sleep(0.5)
try:
    dist.all_reduce(torch.ones(1))
except Exception as err:
    verdict = {"timeout": elastic.is_timeout(err), "lost": elastic.lost_peer(err), "line": describe_failure(err)}
    report_rank_failure(err, run_dir)
    print("VERDICT " + json.dumps(verdict), flush=True)
    os._exit(1)
print("VERDICT none", flush=True)
"""


def run_pair(case: str, run_dir: Path) -> dict:
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {**child_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
               "RANK": str(rank), "LOCAL_RANK": str(rank), "TORCHELASTIC_RUN_ID": "pair",
               "TORCHELASTIC_MAX_RESTARTS": "3"}
        procs.append(subprocess.Popen([sys.executable, "-c", RANK, case, str(run_dir)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        out, err = procs[0].communicate(timeout=60)
    finally:
        for proc in procs[1:]:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    verdicts = [line.removeprefix("VERDICT ") for line in out.splitlines() if line.startswith("VERDICT ")]
    assert verdicts and verdicts[0] != "none", (out, err)
    return json.loads(verdicts[0])


def test_a_collective_skipped_by_a_live_rank_is_the_runs_own_error(tmp_path):
    verdict = run_pair("skips the collective", tmp_path)
    assert verdict["timeout"] and verdict["lost"] is None, verdict
    assert verdict["line"].startswith(f"{elastic.EVERY_RANK_ALIVE} ("), verdict
    record = json.loads((tmp_path / "errors" / FAILED_FILE).read_text())  # the run stops: a restart would repeat it
    assert record["rank"] == "0" and record["error"] == verdict["line"]
    assert "Traceback" in (tmp_path / "errors" / "rank0.txt").read_text()


def test_a_rank_that_vanishes_is_a_lost_peer_after_its_timeout(tmp_path):
    verdict = run_pair("vanishes", tmp_path)
    assert verdict["timeout"], verdict
    assert verdict["lost"].startswith("trainer: rank 0 lost a peer of its worker group ("), verdict
    assert not (tmp_path / "errors" / FAILED_FILE).exists()


def test_a_killed_rank_is_a_lost_peer_at_once(tmp_path):
    verdict = run_pair("is killed", tmp_path)
    assert not verdict["timeout"], verdict  # a closed connection needs no confirmation
    assert verdict["lost"].startswith("trainer: rank 0 lost a peer of its worker group ("), verdict
    assert not (tmp_path / "errors" / FAILED_FILE).exists()


def test_a_timeout_is_told_from_a_connection_error_by_its_text():
    assert elastic.is_timeout(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 2000ms for "
                                           "recv operation to complete"))
    assert not elastic.is_timeout(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                                               "[127.0.0.1]:1234"))
    assert not elastic.is_timeout(RuntimeError("Timed out waiting 2000ms: Connection reset by peer"))
    assert not elastic.is_timeout(ValueError("a bug"))
    # Without a heartbeat (one process, or not restartable) a timeout stays a lost peer, as before.
    restarting = {"TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_MAX_RESTARTS": "3", "RANK": "0"}
    assert not elastic.every_rank_alive(RuntimeError("Timed out waiting 2000ms for recv"), restarting)
    assert elastic.lost_peer(RuntimeError("Timed out waiting 2000ms for recv"), restarting) is not None


@pytest.mark.parametrize("alive", [True, False])
def test_the_heartbeat_watches_every_ranks_counter(alive):
    """In process, over a store of its own: a rank whose counter stops is not alive."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=datetime.timedelta(seconds=5))
    mine = elastic.PeerHeartbeat(store, 0, 2, interval_s=0.05)
    other = elastic.PeerHeartbeat(store.clone(), 1, 2, interval_s=0.05)
    try:
        if not alive:
            other.stop()
        assert mine.all_alive(within_s=1) is alive
    finally:
        mine.stop()
        other.stop()
