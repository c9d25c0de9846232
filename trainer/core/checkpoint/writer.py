"""Checkpoints written by a process of their own (ckpt.async_save on the plain and DDP layouts).

The training step hands a checkpoint over as host copies: its tensors are copied once into memory shared with a
writer process (a memfd: nothing is left behind when either process dies), the rest of each file's content is
pickled with the job. The writer process serializes the files (safetensors, torch.save, JSON, copies of the
task's artifacts), then completes the checkpoint as a synchronous save does (`store.complete_checkpoint`:
hashes, fsync, manifest, rename, pointers, rotation). A process rather than a thread, because serializing and
hashing hold the interpreter lock in long stretches that a thread would take from the training step.

One job at a time: the Checkpointer skips a save asked for while the last one is still being written
(`BackgroundWriter.busy`), so the staging memory is never overwritten under the writer. After each job the writer
also rests in proportion to the CPU time the job took (`cpu_share`): where it shares a core with the training
step (a laptop, a small VM, SMT siblings) its work slows the step, and the rest bounds that share, at the price of
checkpoints completed less often when steps are short. The writer dies with
its parent (PR_SET_PDEATHSIG): a killed rank leaves at most a temp folder, as a killed synchronous save does,
never a second process renaming checkpoints under the group that restarts after it. It ignores SIGINT and
SIGTERM, which a batch system sends to the whole process group: the rank decides when its writer stops.

A writer process that dies (it could not start, the kernel's OOM killer, a kill) is noticed at the next look
(`busy`, `ready`, `submit`), never waited on: `stopped` says how it ended, and a job it held comes back from `wait`
as lost. `wait` takes a deadline: a job not completed by then (a stalled filesystem) is a failure, and the writer
process is ended. Every wait on the process is bounded (`ENDING_S` in all): a writer stuck in uninterruptible I/O
is left with its SIGKILL pending, never waited for. A job that fails in the writer comes back as one line, the
storage's fault (a full disk, a quota, an I/O error) judged by the writer before it removed the partial output.
"""

from __future__ import annotations

import json
import mmap
import os
import pickle
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

if TYPE_CHECKING:
    from trainer.core.checkpoint.store import Generation

STAGED_KINDS = ("safetensors", "torch", "json", "copy")
_ALIGN = 64
_HEADER = struct.Struct("!Q")
_EXIT_S = 5.0
"""How long `close` waits for the writer process to exit after it was told to, before it is killed."""
_REAP_S = 5.0
"""How long a killed writer process is waited for: one in uninterruptible I/O keeps its SIGKILL pending (and its
PR_SET_PDEATHSIG), and is left to the kernel."""
ENDING_S = _EXIT_S + _REAP_S
"""The longest that ending the writer process takes the rank, once its job is done or given up (`close`)."""


@dataclass(frozen=True)
class StagedFile:
    """One file of a checkpoint as host data, written by the writer process.

    kind: "safetensors" (`data`: name -> tensor, with `metadata`), "torch" (`data`: any picklable tree with tensors,
    written with torch.save), "json" (`data`: JSON-able) or "copy" (`data`: a file or folder to copy in)."""

    name: str
    kind: str
    data: Any
    metadata: dict[str, str] | None = None
    artifact: bool = False
    """Listed among the checkpoint's artifacts (files the task reads back when sampling or exporting)."""


@dataclass(frozen=True)
class WriteJob:
    """A checkpoint to write into `tmp` and complete as `final` under `root` (store.complete_checkpoint)."""

    tmp: Path
    final: Path
    files: list[StagedFile]
    record: dict[str, Any]
    best: bool
    keep_last: int
    verify: bool
    set_aside_existing: bool = False
    """`final` failed verification when the run resumed from an older checkpoint: kept, renamed, not replaced."""
    generation: Generation | None = None
    """The worker group's generation (store.Generation): a newer one on disk leaves the checkpoints alone."""


@dataclass(frozen=True)
class _Ref:
    """A tensor in the staging memory."""

    offset: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class WriteFailure:
    """A job the writer did not complete (`BackgroundWriter.wait`)."""

    checkpoint: str
    """The folder name of the job's checkpoint (step_N)."""
    reason: str
    """One line: what failed, a full disk or quota named as such with what the job had written."""
    lost: bool = False
    """The writer process died under it (`BackgroundWriter.stopped` says how): not the checkpoint's own failure."""
    timed_out: bool = False
    """Not completed within the wait's deadline (a stalled filesystem): the writer process was ended."""


class WriterStopped(RuntimeError):
    """The writer process is gone: the job was not handed over."""


def supported() -> bool:
    """Whether this platform can share the staging memory (Linux: memfd and descriptor passing)."""
    return hasattr(os, "memfd_create") and hasattr(socket, "send_fds")


class BackgroundWriter:
    """The training process's side: stages a `WriteJob`'s tensors, hands the job to the writer process, and tells
    whether it is done (`busy`) and how it ended (`wait`)."""

    def __init__(self, cpu_share: float = 1.0) -> None:
        if not 0 < cpu_share <= 1:
            raise ValueError(f"cpu_share must be in (0, 1], got {cpu_share}")
        self.cpu_share = cpu_share
        """The share of one CPU the writer may use on average: `busy` after a job for its CPU time x (1/share - 1)."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock = parent
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        # -c, not -m: the classes of a job must be this module's, not those of a second copy run as __main__
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from trainer.core.checkpoint.writer import main; main()", str(child.fileno()),
             str(os.getpid())], pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, env=env)
        child.close()
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        self._buffer: torch.Tensor | None = None
        self._selector = selectors.DefaultSelector()  # select.select fails for descriptors past 1023
        self._selector.register(self._sock, selectors.EVENT_READ)
        self._pending = False
        self._job: WriteJob | None = None
        self._submitted_at = 0.0
        self._ready = False
        self._result: WriteFailure | None = None
        self.stopped: str | None = None
        """How the writer process ended ('... was killed by SIGKILL'), once it is gone; None while it serves."""
        self._resting_until = 0.0
        self.jobs_cpu_s = 0.0
        """CPU seconds the writer process spent on the jobs it completed (start-up excluded)."""
        self._layout_key: tuple | None = None
        self._views: list[torch.Tensor] = []
        self.warnings: list[str] = []
        """What the writer reported besides failures (e.g. old checkpoints it could not remove), to be logged."""

    # ------------------------------------------------------------------ the training process
    def submit(self, job: WriteJob) -> None:
        """Copy the job's tensors into the staging memory and hand it over (the last job must be done). Raises
        WriterStopped where the writer process is gone (the job is then the caller's to write)."""
        self._drain()
        if self.stopped is not None:
            raise WriterStopped(self.stopped)
        if self._pending:
            raise RuntimeError("the checkpoint writer is still writing the last checkpoint")
        layout = _Layout()
        files = [StagedFile(f.name, f.kind, layout.add(f.data), f.metadata, f.artifact) for f in job.files]
        try:
            self._stage(layout)
            self._send(("write", replace(job, files=files)))
        except ConnectionError as err:  # a broken pipe: it died since it was last looked at
            self._gone()
            raise WriterStopped(self.stopped) from err
        self._pending, self._job, self._result = True, job, None
        self._submitted_at = time.monotonic()

    def writing(self) -> tuple[str, float] | None:
        """The checkpoint being written (its folder's name) and for how many seconds; None when no job is pending."""
        self._drain()
        if not self._pending:
            return None
        return self._job.final.name, time.monotonic() - self._submitted_at

    def busy(self) -> bool:
        """Whether the last job is still being written, or the writer rests after it (`cpu_share`); never waits."""
        self._drain()
        return self._pending or (self.stopped is None and time.monotonic() < self._resting_until)

    def ready(self) -> bool:
        """Whether the writer process has started (its imports take a while: until then a save writes its files
        on the step; False once it is gone)."""
        self._drain()
        return self._ready and self.stopped is None

    def _drain(self) -> None:
        """Take what the writer sent; its end of the connection closed is its death (EOF stays readable: noticed
        here, once)."""
        while self.stopped is None and self._readable(0.0):
            self._take_reply()

    def wait(self, timeout_s: float | None = None) -> WriteFailure | None:
        """Wait for the last job: None when it is complete, else its failure. Past `timeout_s` (None: no limit) a
        job not yet complete is a failure and the writer process is ended: a stalled filesystem does not hold the
        rank past its peers' collective timeout or its launcher's grace period."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._pending:
            left = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if self._readable(max(left, 0.0)):  # a reply already there counts, even at the deadline
                self._take_reply()
            elif self._proc.poll() is not None:  # exited, its connection not closed (held by a process it left)
                self._gone()
            elif deadline is not None and time.monotonic() >= deadline:
                final, waited = self._job.final, f"{round(timeout_s, 1):g} s"
                self._gone(f"the checkpoint writer process was ended: {final.name} was not completed within {waited}")
                self._result = WriteFailure(final.name, f"not completed within {waited}: the storage under "
                                                        f"{final.parent} stalls (the writer process was ended)",
                                            timed_out=True)
        result, self._result = self._result, None
        return result

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for the last job (up to `timeout_s`), then stop the writer process (its failure is `wait`'s to
        tell). Ending it takes at most `ENDING_S`: one that does not exit is killed, and one that a kill does not end
        at once (uninterruptible I/O) is left to the kernel, its SIGKILL pending."""
        if self._pending:
            self.wait(timeout_s)
        try:
            self._send(("close", None))
        except OSError:
            pass
        self._selector.close()
        self._sock.close()
        if self.stopped is None:  # an idle writer told to close exits at once
            try:
                self._proc.wait(timeout=_EXIT_S)
            except subprocess.TimeoutExpired:
                pass
        if self._proc.poll() is None:
            self._proc.kill()
            try:
                self._proc.wait(timeout=_REAP_S)
            except subprocess.TimeoutExpired:
                pass
        if self._map is not None:
            self._buffer, self._views = None, []
            self._map.close()
            os.close(self._fd)
            self._map = self._fd = None

    def _stage(self, layout: _Layout) -> None:
        """Copy the layout's tensors into the staging memory (the same layout as last time reuses its views)."""
        key = tuple(layout.refs)  # offsets follow from dtypes and shapes: equal refs, equal layout
        if key != self._layout_key:
            if self._buffer is None or self._buffer.numel() < layout.size:
                self._allocate(max(layout.size + layout.size // 4, _ALIGN))
            self._views = [_view(self._buffer, ref) for ref in layout.refs]
            self._layout_key = key
        if self._views:
            torch._foreach_copy_(self._views, [t.detach() for t in layout.tensors])

    def _allocate(self, size: int) -> None:
        """A new staging memory (the model or the optimizer's state grew), shared with the writer."""
        fd = os.memfd_create("trainer-checkpoint", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size)
            self._send(("buffer", size))
            socket.send_fds(self._sock, [b"\0"], [fd])
        except BaseException:
            os.close(fd)
            raise
        if self._map is not None:
            self._buffer, self._views = None, []
            self._map.close()
            os.close(self._fd)
        self._fd, self._map = fd, mapping
        self._buffer = torch.frombuffer(mapping, dtype=torch.uint8)

    def _send(self, message: tuple[str, Any]) -> None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._sock.sendall(_HEADER.pack(len(payload)) + payload)

    def _readable(self, timeout: float) -> bool:
        return bool(self._selector.select(timeout))

    def _gone(self, why: str | None = None) -> None:
        """The writer process died, or is ended (`why`): reap it, say how it ended, and give up a job it held."""
        if self.stopped is not None:
            return
        if why is not None:
            self._proc.kill()
        try:
            code = self._proc.wait(timeout=_REAP_S)
        except subprocess.TimeoutExpired:  # closed its end but lives on, or stuck in the kernel: not waited for
            self._proc.kill()
            code = None
        if why is None:
            if code is None:
                why = "the checkpoint writer process stopped answering"
            elif code < 0:
                why = f"the checkpoint writer process was killed by {_signal_name(-code)}"
            else:
                why = f"the checkpoint writer process exited with code {code}"
            why += "" if self._ready else " before it was ready"
        self.stopped = why
        if self._pending:
            self._result = WriteFailure(self._job.final.name, f"{why} while writing it", lost=True)
        self._pending, self._job = False, None

    def _take_reply(self) -> None:
        try:
            kind, value = _receive(self._sock)
        except (EOFError, OSError):
            self._gone()
            return
        if kind == "ready":
            self._ready = True
            return
        if kind == "warnings":
            self.warnings += value
            return
        if kind == "done":
            value, cpu_s = value
            self.jobs_cpu_s += cpu_s
            self._resting_until = time.monotonic() + cpu_s * (1 / self.cpu_share - 1)
            self._result = None
        else:
            self._result = WriteFailure(self._job.final.name, value)
        self._pending, self._job = False, None


def _signal_name(number: int) -> str:
    """SIGKILL's name, or 'signal 40' for one Python has no name for (the real-time signals)."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# ---------------------------------------------------------------------- staging
_LEAVES = frozenset((str, bytes, int, float, bool, type(None)))


class _Layout:
    """The tensors of a job's files, each given its place in the staging memory (`add`)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.refs: list[_Ref] = []
        self.size = 0

    def add(self, tree: Any) -> Any:
        """`tree` with every tensor replaced by its `_Ref`."""
        if isinstance(tree, torch.Tensor):
            ref = _Ref(self.size, str(tree.dtype).removeprefix("torch."), tuple(tree.shape))
            self.tensors.append(tree)
            self.refs.append(ref)
            self.size += -(-tree.numel() * tree.element_size() // _ALIGN) * _ALIGN
            return ref
        if isinstance(tree, dict):
            return type(tree)((k, self.add(v)) for k, v in tree.items())
        if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
            if set(map(type, tree)) <= _LEAVES:  # e.g. Python's random state: 625 ints
                return tree
            return type(tree)(self.add(v) for v in tree)
        return tree


def _view(buffer: torch.Tensor, ref: _Ref) -> torch.Tensor:
    dtype = getattr(torch, ref.dtype)
    count = 1
    for n in ref.shape:
        count *= n
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    return buffer[ref.offset:ref.offset + nbytes].view(dtype).view(ref.shape)


def _materialize(tree: Any, buffer: torch.Tensor | None) -> Any:
    """The writer's side of `_place`: each tensor a copy of its own (torch.save writes a view's whole storage)."""
    if isinstance(tree, _Ref):
        return _view(buffer, tree).clone()
    if isinstance(tree, dict):
        return type(tree)((k, _materialize(v, buffer)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        if set(map(type, tree)) <= _LEAVES:
            return tree
        return type(tree)(_materialize(v, buffer) for v in tree)
    return tree


def _receive(sock: socket.socket) -> tuple[str, Any]:
    header = _read_exactly(sock, _HEADER.size)
    return pickle.loads(_read_exactly(sock, _HEADER.unpack(header)[0]))


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the other end closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# ---------------------------------------------------------------------- the writer process
def write_files(directory: Path, files: list[StagedFile], buffer: torch.Tensor | None) -> None:
    """Write `files` into `directory` (which exists)."""
    for f in files:
        path = directory / f.name
        data = _materialize(f.data, buffer)
        if f.kind == "safetensors":
            save_file(data, str(path), metadata=f.metadata)
        elif f.kind == "torch":
            torch.save(data, path)
        elif f.kind == "json":
            path.write_text(json.dumps(data, indent=1))
        elif f.kind == "copy":
            source = Path(data)
            if source.is_dir():
                shutil.copytree(source, path)
            else:
                shutil.copy2(source, path)
        else:
            raise ValueError(f"unknown staged file kind {f.kind!r} for {f.name} (known: {', '.join(STAGED_KINDS)})")


def write_job(job: WriteJob, buffer: torch.Tensor | None) -> tuple[tuple[str, Any], list[str]]:
    """The writer process's work on one job: write its files into `job.tmp` and complete the checkpoint. Returns
    the reply for the rank (done: the folder's name and the CPU seconds; error: one line) and the warnings."""
    from trainer.core.checkpoint import store
    from trainer.core.checkpoint.agreement import describe_write_failure

    started = time.process_time()
    try:
        shutil.rmtree(job.tmp, ignore_errors=True)
        job.tmp.mkdir(parents=True)
        write_files(job.tmp, job.files, buffer)
        warnings = store.complete_checkpoint(job.tmp, job.final, job.record, best=job.best, verify=job.verify,
                                             keep_last=job.keep_last, set_aside_existing=job.set_aside_existing,
                                             generation=job.generation)
    except Exception as err:  # noqa: BLE001 - told to the training process, which raises it on every rank
        reason = describe_write_failure(err, job.tmp)  # while the partial output is there: a full disk shows
        shutil.rmtree(job.tmp, ignore_errors=True)
        return ("error", reason), []
    return ("done", (job.final.name, time.process_time() - started)), warnings


def _serve(sock: socket.socket) -> None:
    buffer, mapping = None, None
    while True:
        try:
            kind, value = _receive(sock)
        except (EOFError, ConnectionError):  # the rank is gone (a reset: it left a reply of ours unread)
            return
        if kind == "close":
            return
        if kind == "buffer":
            _, fds, _, _ = socket.recv_fds(sock, 1, 1)
            if mapping is not None:
                buffer = None
                mapping.close()
            mapping = mmap.mmap(fds[0], value)
            os.close(fds[0])
            buffer = torch.frombuffer(mapping, dtype=torch.uint8)
            continue
        reply, warnings = write_job(value, buffer)
        try:
            if reply[0] == "done" and warnings:
                _reply(sock, ("warnings", warnings))
            _reply(sock, reply)
        except OSError:  # the rank is gone (a kill, an elastic restart): nobody to tell
            return


def _reply(sock: socket.socket, message: tuple[str, Any]) -> None:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def main(argv: list[str] | None = None) -> None:
    """The writer process: `SOCKET_FD PARENT_PID`."""
    from trainer.core.watchdog import set_parent_death_signal

    fd, parent = (int(a) for a in (argv if argv is not None else sys.argv[1:]))
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the kernel was asked to tell
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    # A message from the rank wakes this process on the rank's CPU (a socket's wake-up is synchronous), where it
    # would preempt the training step; as a batch process it waits for a free CPU instead.
    if hasattr(os, "sched_setscheduler"):
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        except OSError:
            pass
    torch.set_num_threads(1)
    import safetensors.torch  # noqa: F401 - loaded before the rank hears it is ready

    from trainer.core.checkpoint import agreement, store  # noqa: F401

    with socket.socket(fileno=fd) as sock:
        try:
            _reply(sock, ("ready", None))
        except OSError:
            return
        _serve(sock)

