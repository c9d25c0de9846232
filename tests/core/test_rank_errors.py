"""A rank's unexpected error: a lost peer (restarted, one line) told from an error of the run's own (stops the
elastic run once, traceback shown), and every rank's traceback kept in RUN_DIR/errors/.

The classifier is checked on torch's own exception objects where one process can make them (the store's errors)
and on the texts gloo and NCCL raise (gloo's captured from 2-process runs with torch 2.13, NCCL's from its source).
"""

from __future__ import annotations

import json
import re
import subprocess
from datetime import timedelta

import pytest
from conftest import BIN, TINY, child_env, free_port

import trainer.cli as cli
from trainer.core.elastic import is_lost_peer, lost_peer
from trainer.core.rank_errors import FAILED_FILE, raise_if_run_failed, read_failure
from trainer.errors import LaunchError

GLOO_PEER_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                    "[127.0.0.1]:35565. This is typically caused by a remote worker crashing. Check the logs of the "
                    "remote worker before reporting an error. GLHF!")
GLOO_PEER_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:23939: "
                   "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the "
                   "application.")
GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                "5000ms for recv operation to complete")
GLOO_SIZE = "ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (4), got (3))"
NCCL_REMOTE = ("NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, remote process exited or there "
               "was a network error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network error "
               "or a remote process exiting prematurely.\nLast error:\nNET/IB : Got completion from peer 10.42.0.2<47534> "
               "with error 5")
NCCL_TIMEOUT = ("[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=812, OpType=ALLREDUCE, "
                "NumelIn=1048576, NumelOut=1048576, Timeout(ms)=120000) ran for 120021 milliseconds before timing out.")
NCCL_CUDA = ("NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with "
             "NCCL_DEBUG=INFO for details), NCCL version 2.21.5\nncclUnhandledCudaError: Call to CUDA function failed.\n"
             "Last error:\nCuda failure 'an illegal memory access was encountered'")
NCCL_ARGUMENT = ("NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, invalid argument (run with "
                 "NCCL_DEBUG=WARN for details), NCCL version 2.21.5\nncclInvalidArgument: Invalid value for an argument.")
NCCL_ABORTED_BY_OWN = ("NCCL communicator was aborted on rank 1. Original reason for failure was: CUDA error: an illegal "
                       "memory access was encountered")
NCCL_ABORTED_BY_PEER = ("NCCL communicator was aborted on rank 1. Original reason for failure was: NCCL error: remote "
                        "process exited or there was a network error")
NCCL_INTERNAL_LOST_PEER = ("NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, internal error - "
                           "please report this issue to the NCCL developers, NCCL version 2.21.5\nncclInternalError: "
                           "Internal check failed.\nLast error:\nnet.cc:1071 NCCL WARN Connection closed by remote peer "
                           "node7<41374>")
NCCL_INTERNAL = ("NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, internal error - please "
                 "report this issue to the NCCL developers, NCCL version 2.21.5\nncclInternalError: Internal check failed.")
GLOO_PAIR_CLOSURE = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Application timeout caused pair closure"
RESTARTING = {"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_MAX_RESTARTS": "3", "RANK": "1", "LOCAL_RANK": "0"}


@pytest.fixture(scope="module")
def torch_errors() -> dict[str, BaseException]:
    """torch.distributed's own errors, raised for real: the store unreachable and a store wait that times out."""
    import torch
    import torch.distributed as dist

    made = {}
    try:
        dist.TCPStore("127.0.0.1", free_port(), is_master=False, timeout=timedelta(seconds=0.5))
    except Exception as err:  # noqa: BLE001 - whatever torch raises is what is classified
        made["store unreachable"] = err
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=0.1))
    try:
        store.wait(["never set"])
    except Exception as err:  # noqa: BLE001
        made["store wait timeout"] = err
    try:
        torch.ones(3) + torch.ones(4)
    except Exception as err:  # noqa: BLE001
        made["shape mismatch"] = err
    made["out of memory"] = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB "
                                                   "total capacity)")
    made["nccl cuda fault"] = dist.DistBackendError(NCCL_CUDA)
    made["nccl invalid argument"] = dist.DistBackendError(NCCL_ARGUMENT)
    made["nccl aborted by own fault"] = dist.DistBackendError(NCCL_ABORTED_BY_OWN)
    made["nccl other"] = dist.DistBackendError("ProcessGroupNCCL: unsupported reduce op on this dtype")
    made["nccl remote"] = dist.DistBackendError(NCCL_REMOTE)
    made["nccl watchdog timeout"] = dist.DistBackendError(NCCL_TIMEOUT)
    made["nccl aborted by lost peer"] = dist.DistBackendError(NCCL_ABORTED_BY_PEER)
    made["nccl internal, a peer's connection closed"] = dist.DistBackendError(NCCL_INTERNAL_LOST_PEER)
    made["nccl internal"] = dist.DistBackendError(NCCL_INTERNAL)
    made["gloo pair closure"] = RuntimeError(GLOO_PAIR_CLOSURE)
    return made


@pytest.mark.parametrize("name", ["store unreachable", "store wait timeout", "nccl remote", "nccl watchdog timeout",
                                  "nccl aborted by lost peer", "nccl internal, a peer's connection closed",
                                  "gloo pair closure"])
def test_connection_and_store_errors_are_a_lost_peer(torch_errors, name):
    assert is_lost_peer(torch_errors[name]), torch_errors[name]


@pytest.mark.parametrize("name", ["shape mismatch", "out of memory", "nccl cuda fault", "nccl invalid argument",
                                  "nccl aborted by own fault", "nccl other", "nccl internal"])
def test_errors_of_the_run_itself_are_not_a_lost_peer(torch_errors, name):
    """A DistBackendError is not a lost peer by its type or by naming ProcessGroupNCCL: a CUDA fault, a bad argument,
    an out-of-memory would come back after a restart."""
    assert not is_lost_peer(torch_errors[name]), torch_errors[name]
    assert lost_peer(torch_errors[name], RESTARTING) is None


def test_gloo_texts_and_wrapped_errors():
    for text in (GLOO_PEER_CLOSED, GLOO_PEER_RESET, GLOO_TIMEOUT):
        assert is_lost_peer(RuntimeError(text)), text
    assert not is_lost_peer(RuntimeError(GLOO_SIZE))
    assert not is_lost_peer(BrokenPipeError(32, "Broken pipe"))  # a pipe of the run's own (a data loader's), not gloo
    assert not is_lost_peer(ValueError("Connection reset by peer"))
    try:
        try:
            raise RuntimeError(GLOO_PEER_CLOSED)
        except RuntimeError as err:
            raise RuntimeError("all_reduce of the step's loss failed") from err
    except RuntimeError as wrapped:
        assert is_lost_peer(wrapped)
    line = lost_peer(RuntimeError(GLOO_PEER_CLOSED), RESTARTING, "/runs/x/errors/rank1.txt")
    assert line == ("trainer: rank 1 lost a peer of its worker group (Connection closed by peer [127.0.0.1]:35565); "
                    "the elastic agent restarts the group; traceback: /runs/x/errors/rank1.txt")


class _FailingTrainer:
    """A Trainer whose run fails with `error` (the classification of real errors is tested above)."""

    error: BaseException = RuntimeError("unset")

    def __init__(self, *args, **kwargs):
        pass

    def fit(self):
        raise self.error


def _rank(monkeypatch, error: BaseException, **environ: str) -> None:
    import trainer.core.trainer

    for key in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_MAX_RESTARTS", "TRAINER_FRONT_END", "TRAINER_ELASTIC",
                "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", **environ}.items():
        monkeypatch.setenv(key, value)
    _FailingTrainer.error = error
    monkeypatch.setattr(trainer.core.trainer, "Trainer", _FailingTrainer)


def test_a_lost_peer_is_one_line_naming_the_kept_traceback(tmp_path, monkeypatch, capsys):
    _rank(monkeypatch, RuntimeError(GLOO_PEER_CLOSED), TORCHELASTIC_RUN_ID="job", TORCHELASTIC_MAX_RESTARTS="3",
          TORCHELASTIC_ERROR_FILE=str(tmp_path / "agent_error.json"))
    assert cli.main(["train", TINY, f"run.output_dir={tmp_path}"]) == 1
    err = capsys.readouterr().err
    kept = tmp_path / "errors" / "rank0.txt"
    assert err == (f"trainer: rank 0 lost a peer of its worker group (Connection closed by peer [127.0.0.1]:35565); "
                   f"the elastic agent restarts the group; traceback: {kept}\n")
    text = kept.read_text()
    assert "Traceback (most recent call last)" in text and GLOO_PEER_CLOSED in text and "restart 0" in text
    agent = json.loads((tmp_path / "agent_error.json").read_text())["message"]
    assert agent["message"].startswith("RuntimeError: ") and "Traceback" in agent["extraInfo"]["py_callstack"]
    assert not (tmp_path / "errors" / FAILED_FILE).exists()  # a lost peer does not stop the run


def test_an_error_of_the_run_under_a_restarting_agent_stops_it_once(tmp_path, monkeypatch, capsys):
    """Bare torchrun with restarts: the traceback propagates (torchrun's log shows it) and is kept; the failure is
    recorded, and the group the agent restarts refuses to train instead of hitting it again."""
    error = RuntimeError("CUDA error: an illegal memory access was encountered")
    _rank(monkeypatch, error, TORCHELASTIC_RUN_ID="job", TORCHELASTIC_MAX_RESTARTS="3", RANK="3")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        cli.main(["train", TINY, f"run.output_dir={tmp_path}"])
    kept = tmp_path / "errors" / "rank3.txt"
    assert "illegal memory access" in kept.read_text()
    record = read_failure(tmp_path, "job", since=0)
    assert record["rank"] == "3" and record["traceback"] == str(kept) and "illegal memory access" in record["error"]
    assert read_failure(tmp_path, "another run", since=0) is None
    assert read_failure(tmp_path, "job", since=record["time"] + 1) is None  # a later launch of the run

    # The restarted group (its agent, the parent process, started before the failure; rank 0 says it) refuses
    # before building a Trainer.
    import trainer.core.rank_errors

    monkeypatch.setattr(trainer.core.rank_errors, "agent_start_time", lambda: record["time"] - 60)
    _FailingTrainer.error = AssertionError("the restarted group trained")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert cli.main(["train", TINY, f"run.output_dir={tmp_path}"]) == 1
    said = capsys.readouterr().err
    assert said.startswith("trainer: error: not restarting the elastic run: rank 3 on ") and str(kept) in said
    with pytest.raises(LaunchError):
        raise_if_run_failed(tmp_path, {"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_MAX_RESTARTS": "3"}, since=0)
    raise_if_run_failed(tmp_path, {"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_MAX_RESTARTS": "3"},
                        since=record["time"] + 1)  # an agent started after it: a new launch trains


def test_under_the_front_end_the_failed_rank_says_one_line(tmp_path, monkeypatch, capsys):
    _rank(monkeypatch, torch_oom(), TRAINER_ELASTIC="1", TORCHELASTIC_RUN_ID="job", TRAINER_FRONT_END="1")
    assert cli.main(["train", TINY, f"run.output_dir={tmp_path}"]) == 1
    kept = tmp_path / "errors" / "rank0.txt"
    assert capsys.readouterr().err == (f"trainer: rank 0 failed: OutOfMemoryError: CUDA out of memory. Tried to "
                                       f"allocate 2.00 GiB (traceback: {kept}); the elastic run stops\n")
    assert read_failure(tmp_path, "job", since=0)["error"].startswith("OutOfMemoryError: CUDA out of memory")


def test_without_restarts_the_traceback_propagates_and_is_kept(tmp_path, monkeypatch):
    _rank(monkeypatch, RuntimeError(GLOO_PEER_CLOSED), TORCHELASTIC_RUN_ID="job", TORCHELASTIC_MAX_RESTARTS="0")
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        cli.main(["train", TINY, f"run.output_dir={tmp_path}"])
    assert "Connection closed by peer" in (tmp_path / "errors" / "rank0.txt").read_text()
    assert not (tmp_path / "errors" / FAILED_FILE).exists()


def torch_oom() -> BaseException:
    import torch

    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.slow
def test_an_elastic_run_that_fails_on_its_own_error_stops_once_with_its_traceback(tmp_path):
    """`trainer train --nnodes` whose worker fails at its first step (task.delay_s=-1: time.sleep raises ValueError):
    the front end stops its agent instead of restarting the group --max-restarts times, and ends with the traceback
    and one line naming its file. The agent hosts the store itself here, and says that its loss ends the job."""
    out = tmp_path / "run"
    port = free_port()
    done = subprocess.run(
        [str(BIN / "trainer"), "train", TINY, "--nnodes", "1:1", "--nproc-per-node", "1", "--rdzv",
         f"127.0.0.1:{port}", "--max-restarts", "3", "task.delay_s=-1", "train.max_steps=4", "log.progress_bar=false",
         "log.tensorboard=false", f"run.output_dir={out}"],
        env=child_env(), capture_output=True, text=True, timeout=300)
    said = done.stdout + done.stderr
    kept = out / "errors" / "rank0.txt"
    assert done.returncode == 1, said[-4000:]
    assert f"this node's agent hosts the rendezvous store at 127.0.0.1:{port}" in said, said[-4000:]
    assert "ValueError: sleep length must be non-negative" in said and "Traceback (most recent call last)" in said
    assert "trainer: error: the elastic run stopped: rank 0 on " in said and str(kept) in said.splitlines()[-1], said[-4000:]
    assert len(re.findall(r"^--- .* ---$", kept.read_text(), re.M)) == 1  # one start failed: no restart repeated it
