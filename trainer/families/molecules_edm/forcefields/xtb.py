"""GFN2-xTB (or GFN1-xTB) through `tblite.interface.Calculator`, parallel over molecules in a process pool.

Units: tblite works in atomic units. Positions go in as Angstrom / Bohr; energies come back as
Hartree * Hartree-in-eV and forces as -gradient * Hartree/Bohr (eV/Angstrom), with the constants of
`ase.units` (CODATA 2014: Bohr = 0.529177211 Angstrom, Hartree = 27.211386024 eV), the same ones
tblite's own ASE calculator uses.

Electronic state: total charge 0; unpaired electrons from the parity of the electron count
(`uhf = sum(Z) % 2`: 1 for an odd count, as a generated molecule with a missing hydrogen has, else 0;
core shells are full, so the parity of sum(Z) is that of tblite's valence electron count).

Threads: xTB on one small molecule is fastest on one thread (OpenMP threads cost more than they give:
5-25 ms per QM9 molecule on one thread, up to 20x that with default threads on a busy machine), so
each worker process runs one thread and the pool parallelises over molecules. Workers are started
with `spawn` (the parent may hold torch's threads, which `fork` would copy in a broken state) and set
OMP_NUM_THREADS=1 before tblite is imported there; they import this package (and so the family's
`__init__`) once. With `workers=1` the calculation runs in the calling process, with OpenMP limited
to one thread during the call (threadpoolctl, when installed).
"""

from __future__ import annotations

import importlib.util
import logging
import math
import multiprocessing
import os
import threading
import weakref
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import nullcontext
from typing import Any

import numpy as np
from ase.units import Bohr, Hartree

from trainer.errors import ConfigError
from trainer.families.molecules_edm.forcefields import validate_batch
from trainer.families.molecules_edm.forcefields.base import ForceResult

logger = logging.getLogger(__name__)

XTB_METHODS: dict[str, str] = {"gfn2": "GFN2-xTB", "gfn1": "GFN1-xTB"}
"""Our short names -> tblite's method names."""

_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
_CHUNKS_PER_WORKER = 4  # several chunks per worker balance molecules of unequal cost
_START_TIMEOUT = 300.0  # seconds for a worker process to start (imports included) on a loaded machine

# One molecule's result: (energy eV, forces [n, 3] eV/Angstrom, error message or None).
MoleculeResult = tuple[float, np.ndarray, "str | None"]


def default_workers() -> int:
    """This process's share of the cores: usable cores // LOCAL_WORLD_SIZE (1 if unset), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    try:
        local_world = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local_world = 1
    return max(1, cores // local_world)


def _silent(_message: str) -> None:
    """tblite's context logger: the library's printout is dropped (errors still raise)."""


def _limit_threads() -> Any:
    """A context limiting every loaded OpenMP/BLAS library to one thread, or a no-op without threadpoolctl."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        if "OMP_NUM_THREADS" not in os.environ and not _warned:
            _warned.append(True)
            logger.warning("threadpoolctl is not installed and OMP_NUM_THREADS is unset: in-process xTB runs with "
                           "OpenMP's default threads, up to 20x slower on small molecules (pip install threadpoolctl)")
        return nullcontext()
    return threadpool_limits(limits=1)


_warned: list[bool] = []


def _init_worker(ready: Any) -> None:
    """Pool initializer: one thread, load tblite, then wait until every worker of the pool is up."""
    for variable in _THREAD_VARIABLES:
        os.environ[variable] = "1"
    import tblite.interface  # noqa: F401

    # Belt and braces: if something in the import chain loaded an OpenMP runtime before the variable
    # was set, its thread count is lowered here.
    _limit_threads()
    try:
        ready.wait(timeout=_START_TIMEOUT)
    except threading.BrokenBarrierError:  # a sibling failed to start: serve anyway
        pass


def _worker_ready() -> int:
    return os.getpid()


def xtb_molecule(method: str, numbers: np.ndarray, positions: np.ndarray, accuracy: float,
                 max_iterations: int) -> MoleculeResult:
    """One single point: (energy eV, forces eV/Angstrom, None), or (NaN, zeros, reason) if it failed."""
    numbers = np.asarray(numbers, dtype=np.int64)
    positions = np.asarray(positions, dtype=np.float64)
    zeros = np.zeros_like(positions)
    if len(numbers) == 0:
        return math.nan, zeros, "no atoms"
    if not np.all(np.isfinite(positions)):
        return math.nan, zeros, "non-finite positions"
    if numbers.min() < 1 or numbers.max() > 86:  # tblite silently accepts 0 (a ghost atom)
        return math.nan, zeros, f"atomic numbers must be 1-86 for GFN-xTB, got {sorted(set(numbers.tolist()))}"
    try:
        from tblite.interface import Calculator

        calc = Calculator(method, numbers, positions / Bohr, charge=0.0, uhf=int(numbers.sum()) % 2, logger=_silent)
        calc.set("verbosity", 0)
        calc.set("accuracy", float(accuracy))
        calc.set("max-iter", int(max_iterations))
        result = calc.singlepoint()
        energy = float(result.get("energy")) * Hartree
        forces = -np.asarray(result.get("gradient"), dtype=np.float64) * (Hartree / Bohr)
    except Exception as error:  # tblite raises on coincident atoms, unknown elements, SCF failure
        return math.nan, zeros, f"{type(error).__name__}: {error}"
    if not (math.isfinite(energy) and np.all(np.isfinite(forces))):
        return math.nan, zeros, "non-finite energy or forces"
    return energy, forces, None


def xtb_chunk(method: str, accuracy: float, max_iterations: int,
              molecules: list[tuple[np.ndarray, np.ndarray]]) -> list[MoleculeResult]:
    """`xtb_molecule` over a list of (numbers, positions): the unit of work sent to a pool worker."""
    return [xtb_molecule(method, numbers, positions, accuracy, max_iterations) for numbers, positions in molecules]


def _shutdown(pool: ProcessPoolExecutor) -> None:
    pool.shutdown(wait=True, cancel_futures=True)


class XTBForceField:
    """GFN2-xTB (default) or GFN1-xTB energies and forces for padded batches of neutral molecules.

    Args:
        method: `gfn2` (GFN2-xTB) or `gfn1` (GFN1-xTB); tblite's names (`GFN2-xTB`) work too.
        workers: worker processes, one thread each; default `default_workers()` (this rank's share of
            the cores). 1 computes in this process, without a pool.
        accuracy: tblite's numerical accuracy (SCC thresholds scale with it; smaller is tighter).
        max_iterations: SCC iteration cap; a molecule that does not converge is `ok = False`.

    The pool is started on the first batch and reused until `close()` (also called at interpreter exit).
    After each `compute`, `last_errors` maps the batch index of every failed molecule to the reason.
    """

    def __init__(self, method: str = "gfn2", workers: int | None = None, accuracy: float = 1.0,
                 max_iterations: int = 250) -> None:
        key = method.strip().lower().removesuffix("-xtb")
        if key not in XTB_METHODS:
            raise ConfigError(f"unknown xTB method {method!r}; choices: {', '.join(XTB_METHODS)}")
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise ConfigError(f"xTB workers must be a positive integer (or unset: this rank's share of cores), got {workers!r}")
        if not (isinstance(accuracy, int | float) and accuracy > 0):
            raise ConfigError(f"xTB accuracy must be a positive number, got {accuracy!r}")
        if isinstance(max_iterations, bool) or not isinstance(max_iterations, int) or max_iterations < 1:
            raise ConfigError(f"xTB max_iterations must be a positive integer, got {max_iterations!r}")
        if importlib.util.find_spec("tblite") is None:
            raise ConfigError("the GFN-xTB force field needs tblite: pip install tblite "
                              "(or pip install 'trainer[molecules_edm]')")
        self.method = XTB_METHODS[key]
        self.name = f"{key}-xtb"
        self.workers = default_workers() if workers is None else workers
        self.accuracy = float(accuracy)
        self.max_iterations = max_iterations
        self.last_errors: dict[int, str] = {}
        self._pool: ProcessPoolExecutor | None = None
        self._finalizer: Any = None

    def __repr__(self) -> str:
        return f"XTBForceField(method={self.method!r}, workers={self.workers}, accuracy={self.accuracy})"

    def compute(self, numbers: np.ndarray, positions: np.ndarray, mask: np.ndarray) -> ForceResult:
        """numbers [B, N] int, positions [B, N, 3] Angstrom, mask [B, N] bool -> ForceResult (eV, eV/Angstrom)."""
        numbers, positions, mask = validate_batch(numbers, positions, mask, name=self.name)
        batch, width = numbers.shape
        molecules = [(numbers[b, mask[b]], positions[b, mask[b]]) for b in range(batch)]
        if self.workers == 1 or batch <= 1:
            with _limit_threads():
                results = xtb_chunk(self.method, self.accuracy, self.max_iterations, molecules)
        else:
            results = self._compute_in_pool(molecules)
        out = ForceResult.empty(batch, width)
        self.last_errors = {}
        for b, (energy, forces, error) in enumerate(results):
            if error is not None:
                self.last_errors[b] = error
                continue
            out.record(b, mask[b], energy, forces)
        if self.last_errors:
            logger.debug("%s failed on %d of %d molecules: %s", self.name, len(self.last_errors), batch, self.last_errors)
        return out

    def close(self) -> None:
        """Stop the worker pool (idempotent; a later `compute` starts a new one)."""
        if self._finalizer is not None:
            self._finalizer()  # runs _shutdown once and unregisters it from interpreter exit
            self._finalizer = None
        self._pool = None

    def __enter__(self) -> XTBForceField:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _get_pool(self) -> ProcessPoolExecutor:
        """The pool, started on first use with all its workers up before the first batch.

        ProcessPoolExecutor starts workers on demand, and a worker's start (imports) can take longer than
        a batch, so one worker could do a whole batch alone: one task per worker is submitted at once
        (none can finish before all have started: the initializer waits on a barrier) and awaited.
        """
        if self._pool is None:
            context = multiprocessing.get_context("spawn")
            pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=context, initializer=_init_worker,
                                       initargs=(context.Barrier(self.workers),))
            # weakref.finalize runs at interpreter exit too, without keeping this object alive
            self._pool, self._finalizer = pool, weakref.finalize(self, _shutdown, pool)
            try:
                for future in [pool.submit(_worker_ready) for _ in range(self.workers)]:
                    future.result()
            except BrokenProcessPool as error:
                self.close()
                raise RuntimeError(f"{self.name}: the {self.workers} xTB worker processes did not start (their error is "
                                   "printed above); workers=1 computes in this process") from error
        return self._pool

    def _compute_in_pool(self, molecules: list[tuple[np.ndarray, np.ndarray]]) -> list[MoleculeResult]:
        size = max(1, math.ceil(len(molecules) / (self.workers * _CHUNKS_PER_WORKER)))
        starts = list(range(0, len(molecules), size))
        results: list[MoleculeResult | None] = [None] * len(molecules)
        pending: list[int] = []
        pool = self._get_pool()
        try:
            futures: list[Future] = [pool.submit(xtb_chunk, self.method, self.accuracy, self.max_iterations,
                                                 molecules[start:start + size]) for start in starts]
        except BrokenProcessPool:  # a worker died since the last batch
            futures, pending = [], list(range(len(molecules)))
        for start, future in zip(starts, futures):
            try:
                results[start:start + size] = future.result()
            except BrokenProcessPool:
                pending.extend(range(start, min(start + size, len(molecules))))
        if pending:
            self._recover(molecules, pending, results)
        lost = "the worker process died"
        return [r if r is not None else (math.nan, np.zeros_like(m[1]), lost) for r, m in zip(results, molecules)]

    def _recover(self, molecules: list[tuple[np.ndarray, np.ndarray]], pending: list[int],
                 results: list[MoleculeResult | None]) -> None:
        """A worker died (a crash in the native library, or killed): restart the pool and retry the lost
        molecules one at a time, so that only a molecule that kills a worker again is marked failed."""
        logger.warning("%s: a worker process died; retrying %d molecules one at a time", self.name, len(pending))
        self.close()
        for index in pending:
            numbers, positions = molecules[index]
            try:
                results[index] = self._get_pool().submit(xtb_molecule, self.method, numbers, positions, self.accuracy,
                                                         self.max_iterations).result()
            except BrokenProcessPool:
                results[index] = (math.nan, np.zeros_like(positions), "the worker process died on this molecule")
                self.close()
