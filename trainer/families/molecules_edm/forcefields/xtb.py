"""GFN2-xTB (or GFN1-xTB) through `tblite.interface.Calculator`, parallel over molecules in a process pool.

Units: tblite works in atomic units. Positions go in as Angstrom / Bohr; energies come back as
Hartree * Hartree-in-eV and forces as -gradient * Hartree/Bohr (eV/Angstrom), with the constants of
`ase.units` (CODATA 2014: Bohr = 0.529177211 Angstrom, Hartree = 27.211386024 eV), the same ones
tblite's own ASE calculator uses.

Electronic state: total charge 0; unpaired electrons from the parity of the electron count
(`uhf = sum(Z) % 2`: 1 for an odd count, as a generated molecule with a missing hydrogen has, else 0;
core shells are full, so the parity of sum(Z) is that of tblite's valence electron count).

Threads: xTB on one small molecule is fastest on one thread (OpenMP threads cost more than they give, and far
more on a busy machine, where they wait for each other), so
each worker process runs one thread and the pool parallelises over molecules. Workers are started
with `spawn` (the parent may hold torch's threads, which `fork` would copy in a broken state) and set
OMP_NUM_THREADS=1 before tblite is imported there; they import this package (and so the family's
`__init__`) once. With `workers=1` the calculation runs in the calling process, with OpenMP limited
to one thread during the call (threadpoolctl, when installed).

Two kinds of evaluation share one pool:
- `compute` is the strict single point (tblite's default electronic temperature, `max_iterations`
  SCF cycles): what the evaluation of final molecules uses. A molecule that does not converge fails.
- `for_guidance()` returns an `XTBGuidance`, the evaluation of guided sampling, which must converge or
  fail fast on the distorted geometries of a denoising trajectory: an electronic-temperature ladder
  (`guidance_temperatures`, default 9.5e-4 -> 0.01 -> 0.03 Hartree, i.e. 300 K -> 3,160 K -> 9,470 K;
  Fermi smearing of the occupations makes the SCF of small-gap geometries converge), each rung capped
  at `guidance_max_iterations` cycles, converged to `guidance_accuracy` (tblite's thresholds x 10: fewer cycles,
  forces close to the strict ones; BENCHMARKS.md, "Guidance's own SCF accuracy"); a warm start from the molecule's
  wavefunction of the previous
  guided step (tblite's result object itself with one worker; its saved form, without the orbital matrices,
  through a pool);
  and a sticky rung (a molecule starts at the rung that last converged for it and tries
  one rung lower every `guidance_probe_every` steps). A molecule that fails every rung gets no force
  (its step is left unguided by the caller and counted); the worst case costs rungs x cap cycles, and
  the next step starts on the top rung. Every result records its rung, so a set reports how many
  forces came from each temperature.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import multiprocessing
import os
import tempfile
import threading
import weakref
import zipfile
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import nullcontext
from dataclasses import dataclass
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

DEFAULT_TEMPERATURE = 9.5e-4
"""tblite's default electronic temperature in Hartree (300 K): the strict evaluation's and the ladder's first rung."""
GUIDANCE_TEMPERATURES: tuple[float, ...] = (DEFAULT_TEMPERATURE, 0.01, 0.03)
"""The guidance ladder's electronic temperatures in Hartree (300 K, 3,158 K, 9,474 K)."""
GUIDANCE_MAX_ITERATIONS = 40
"""SCF cycles per rung of the guidance ladder (a converging warm start needs 5-20)."""
GUIDANCE_PROBE_EVERY = 10
"""A molecule on a raised rung tries one rung lower every this many guided steps."""
GUIDANCE_ACCURACY = 10.0
"""tblite accuracy of guidance evaluations (its SCF thresholds scale with it; 1 is tblite's default)."""

# One molecule's result: (energy eV, forces [n, 3] eV/Angstrom, error message or None).
MoleculeResult = tuple[float, np.ndarray, "str | None"]
# A guided molecule's result: (energy, forces, error or None, rung index or -1, restart data or None).
GuidedResult = tuple[float, np.ndarray, "str | None", int, "Restart | None"]
Restart = dict[str, "bytes | tuple[bytes, int]"]
"""A molecule's wavefunction as tblite saves it (npz members), the two orbital-sized matrices (density and
coefficients, which the SCF restart does not read: it restarts from the charges and multipoles) kept as
(header, size) and written back as zeros: what a pool passes is a small part of the whole file."""
_DROPPED_MEMBERS = ("tblite0_density.npy", "tblite0_coeff.npy")


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
                           "OpenMP's default threads, many times slower on small molecules (pip install threadpoolctl)")
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


def _input_error(numbers: np.ndarray, positions: np.ndarray) -> str | None:
    if len(numbers) == 0:
        return "no atoms"
    if not np.all(np.isfinite(positions)):
        return "non-finite positions"
    if numbers.min() < 1 or numbers.max() > 86:  # tblite silently accepts 0 (a ghost atom)
        return f"atomic numbers must be 1-86 for GFN-xTB, got {sorted(set(numbers.tolist()))}"
    return None


def _calculator(method: str, numbers: np.ndarray, positions: np.ndarray, accuracy: float, max_iterations: int) -> Any:
    from tblite.interface import Calculator

    calc = Calculator(method, numbers, positions / Bohr, charge=0.0, uhf=int(numbers.sum()) % 2, logger=_silent)
    calc.set("verbosity", 0)
    calc.set("accuracy", float(accuracy))
    calc.set("max-iter", int(max_iterations))
    return calc


def _energy_forces(result: Any) -> tuple[float, np.ndarray]:
    return float(result.get("energy")) * Hartree, -np.asarray(result.get("gradient"), dtype=np.float64) * (Hartree / Bohr)


def xtb_molecule(method: str, numbers: np.ndarray, positions: np.ndarray, accuracy: float,
                 max_iterations: int) -> MoleculeResult:
    """One single point: (energy eV, forces eV/Angstrom, None), or (NaN, zeros, reason) if it failed."""
    numbers = np.asarray(numbers, dtype=np.int64)
    positions = np.asarray(positions, dtype=np.float64)
    zeros = np.zeros_like(positions)
    error = _input_error(numbers, positions)
    if error is not None:
        return math.nan, zeros, error
    try:
        energy, forces = _energy_forces(_calculator(method, numbers, positions, accuracy, max_iterations).singlepoint())
    except Exception as error:  # tblite raises on coincident atoms, unknown elements, SCF failure
        return math.nan, zeros, f"{type(error).__name__}: {error}"
    if not (math.isfinite(energy) and np.all(np.isfinite(forces))):
        return math.nan, zeros, "non-finite energy or forces"
    return energy, forces, None


_scratch: list[tempfile.TemporaryDirectory] = []


def _scratch_file() -> str:
    """This process's file for tblite's wavefunction save/load (tblite reads and writes files only)."""
    if not _scratch:
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        _scratch.append(tempfile.TemporaryDirectory(prefix="trainer-xtb-", dir=shm))
    return os.path.join(_scratch[0].name, "wavefunction.npz")


def _save_restart(result: Any) -> Restart | None:
    try:
        path = _scratch_file()
        result.save(path)
        out: Restart = {}
        with zipfile.ZipFile(path) as archive:
            for name in archive.namelist():
                data = archive.read(name)
                if name in _DROPPED_MEMBERS:
                    header = data.index(b"\n") + 1  # the .npy header ends with a newline
                    out[name] = (data[:header], len(data) - header)
                else:
                    out[name] = data
        return out
    except Exception:  # a warm start is an optimisation: without it the next step starts cold
        return None


def _load_restart(restart: Restart) -> Any:
    from tblite.interface import Result

    try:
        path = _scratch_file()
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:  # tblite reads stored members only
            for name, data in restart.items():
                archive.writestr(name, data if isinstance(data, bytes) else data[0] + bytes(data[1]))
        result = Result()
        result.load(path)
        return result
    except Exception:
        return None


def xtb_guided_molecule(method: str, numbers: np.ndarray, positions: np.ndarray, accuracy: float,
                        max_iterations: int, temperatures: Sequence[float], start: int,
                        restart: Restart | Any | None, keep_restart: str | None) -> GuidedResult:
    """A guidance single point on the temperature ladder, from rung `start` up, each rung capped at
    `max_iterations` SCF cycles and warm-started from `restart` (the molecule's previous wavefunction: its
    saved form, or tblite's result object itself in the process that made it).

    Returns (energy eV, forces eV/Angstrom, None, rung, this wavefunction), or (NaN, zeros, the last reason,
    -1, None) when no rung converged. `keep_restart`: None keeps no wavefunction, "saved" its saved form (to
    cross processes), "object" tblite's result (same process: no file round trip, which would be a noticeable
    share of a guided step)."""
    numbers = np.asarray(numbers, dtype=np.int64)
    positions = np.asarray(positions, dtype=np.float64)
    zeros = np.zeros_like(positions)
    error = _input_error(numbers, positions)
    if error is not None:
        return math.nan, zeros, error, -1, None
    try:
        calc = _calculator(method, numbers, positions, accuracy, max_iterations)
    except Exception as error:  # coincident atoms: no temperature helps
        return math.nan, zeros, f"{type(error).__name__}: {error}", -1, None
    guess = _load_restart(restart) if isinstance(restart, dict) else restart
    error = "no rung tried"
    for rung in range(start, len(temperatures)):
        try:
            calc.set("temperature", float(temperatures[rung]))
            # copy=True: a failed rung leaves the guess intact for the next one
            result = calc.singlepoint(guess, copy=True) if guess is not None else calc.singlepoint()
            energy, forces = _energy_forces(result)
        except Exception as exc:  # SCF not converged within the cap
            error = f"{type(exc).__name__}: {exc}"
            continue
        if not (math.isfinite(energy) and np.all(np.isfinite(forces))):
            error = "non-finite energy or forces"
            continue
        kept = None if keep_restart is None else result if keep_restart == "object" else _save_restart(result)
        return energy, forces, None, rung, kept
    return math.nan, zeros, error, -1, None


def xtb_chunk(method: str, accuracy: float, max_iterations: int,
              molecules: list[tuple[np.ndarray, np.ndarray]]) -> list[MoleculeResult]:
    """`xtb_molecule` over a list of (numbers, positions): the unit of work sent to a pool worker."""
    return [xtb_molecule(method, numbers, positions, accuracy, max_iterations) for numbers, positions in molecules]


def xtb_guided_chunk(method: str, accuracy: float, max_iterations: int, temperatures: Sequence[float],
                     keep_restart: str | None, items: list[tuple[np.ndarray, np.ndarray, int, Restart | Any | None]]
                     ) -> list[GuidedResult]:
    """`xtb_guided_molecule` over (numbers, positions, start rung, restart) items: a pool worker's unit."""
    return [xtb_guided_molecule(method, numbers, positions, accuracy, max_iterations, temperatures, start, restart,
                                keep_restart) for numbers, positions, start, restart in items]


def _shutdown(pool: ProcessPoolExecutor) -> None:
    pool.shutdown(wait=True, cancel_futures=True)


class XTBForceField:
    """GFN2-xTB (default) or GFN1-xTB energies and forces for padded batches of neutral molecules.

    Args:
        method: `gfn2` (GFN2-xTB) or `gfn1` (GFN1-xTB); tblite's names (`GFN2-xTB`) work too.
        workers: worker processes, one thread each; default `default_workers()` (this rank's share of
            the cores). 1 computes in this process, without a pool.
        accuracy: tblite's numerical accuracy (SCC thresholds scale with it; smaller is tighter).
        max_iterations: SCC iteration cap of `compute` (the strict evaluation); a molecule that does not
            converge is `ok = False`.
        guidance_temperatures: electronic temperatures (Hartree) of the guidance ladder, lowest first.
        guidance_max_iterations: SCC cycles per rung of the guidance ladder.
        guidance_warm_start: start each guided evaluation from the molecule's previous wavefunction.
        guidance_probe_every: a molecule on a raised rung tries one rung lower every this many steps.
        guidance_accuracy: tblite accuracy of guidance evaluations (default 10: looser SCF thresholds; a
            guidance force needs far less precision than a reported energy).

    The pool is started on the first batch and reused until `close()` (also called at interpreter exit).
    After each `compute`, `last_errors` maps the batch index of every failed molecule to the reason.
    """

    def __init__(self, method: str = "gfn2", workers: int | None = None, accuracy: float = 1.0,
                 max_iterations: int = 250, guidance_temperatures: Sequence[float] = GUIDANCE_TEMPERATURES,
                 guidance_max_iterations: int = GUIDANCE_MAX_ITERATIONS, guidance_warm_start: bool = True,
                 guidance_probe_every: int = GUIDANCE_PROBE_EVERY,
                 guidance_accuracy: float = GUIDANCE_ACCURACY) -> None:
        key = method.strip().lower().removesuffix("-xtb")
        if key not in XTB_METHODS:
            raise ConfigError(f"unknown xTB method {method!r}; choices: {', '.join(XTB_METHODS)}")
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise ConfigError(f"xTB workers must be a positive integer (or unset: this rank's share of cores), got {workers!r}")
        for name, value in (("accuracy", accuracy), ("guidance_accuracy", guidance_accuracy)):
            if isinstance(value, bool) or not (isinstance(value, int | float) and value > 0):
                raise ConfigError(f"xTB {name} must be a positive number, got {value!r}")
        for name, value in (("max_iterations", max_iterations), ("guidance_max_iterations", guidance_max_iterations),
                            ("guidance_probe_every", guidance_probe_every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"xTB {name} must be a positive integer, got {value!r}")
        temperatures = list(guidance_temperatures) if isinstance(guidance_temperatures, Sequence) else []
        if (not temperatures or any(isinstance(t, bool) or not isinstance(t, int | float) or not t > 0 for t in temperatures)
                or temperatures != sorted(temperatures)):
            raise ConfigError("xTB guidance_temperatures must be a non-empty increasing list of electronic temperatures "
                              f"in Hartree (> 0; tblite's default is {DEFAULT_TEMPERATURE}), got {guidance_temperatures!r}")
        if not isinstance(guidance_warm_start, bool):
            raise ConfigError(f"xTB guidance_warm_start must be true or false, got {guidance_warm_start!r}")
        if importlib.util.find_spec("tblite") is None:
            raise ConfigError("the GFN-xTB force field needs tblite: pip install tblite "
                              "(or pip install 'trainer[molecules_edm]')")
        self.method = XTB_METHODS[key]
        self.name = f"{key}-xtb"
        self.workers = default_workers() if workers is None else workers
        self.accuracy = float(accuracy)
        self.max_iterations = max_iterations
        self.guidance_temperatures = tuple(float(t) for t in temperatures)
        self.guidance_max_iterations = guidance_max_iterations
        self.guidance_warm_start = guidance_warm_start
        self.guidance_probe_every = guidance_probe_every
        self.guidance_accuracy = float(guidance_accuracy)
        self.last_errors: dict[int, str] = {}
        self._pool: ProcessPoolExecutor | None = None
        self._finalizer: Any = None

    def __repr__(self) -> str:
        return f"XTBForceField(method={self.method!r}, workers={self.workers}, accuracy={self.accuracy})"

    def compute(self, numbers: np.ndarray, positions: np.ndarray, mask: np.ndarray) -> ForceResult:
        """numbers [B, N] int, positions [B, N, 3] Angstrom, mask [B, N] bool -> ForceResult (eV, eV/Angstrom).

        The strict single point: tblite's default electronic temperature, `max_iterations` cycles."""
        numbers, positions, mask = validate_batch(numbers, positions, mask, name=self.name)
        batch, width = numbers.shape
        rows = [b for b in range(batch) if mask[b].any()]  # a row with no atoms (routed elsewhere) is skipped
        molecules = [(numbers[b, mask[b]], positions[b, mask[b]]) for b in rows]
        results = self._map(xtb_chunk, (self.method, self.accuracy, self.max_iterations), molecules) if rows else []
        out = ForceResult.empty(batch, width)
        self.last_errors = {}
        for b, (energy, forces, error) in zip(rows, results):
            if error is not None:
                self.last_errors[b] = error
                continue
            out.record(b, mask[b], energy, forces)
        if self.last_errors:
            logger.debug("%s failed on %d of %d molecules: %s", self.name, len(self.last_errors), batch, self.last_errors)
        return out

    def for_guidance(self, needs_spread: bool = False) -> XTBGuidance:
        """A fresh guidance evaluator (its own per-molecule rungs and wavefunctions) on this force field's pool:
        one per guided sampling call, whose batch rows are the same molecules at every step (xTB has no spread:
        `needs_spread` changes nothing)."""
        return XTBGuidance(self)

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

    def _map(self, chunk: Callable[..., list], args: tuple, items: list) -> list:
        """`chunk(*args, items)` over all items, in this process (one worker or one item) or split over the pool."""
        if self.workers == 1 or len(items) <= 1:
            with _limit_threads():
                return chunk(*args, items)
        return self._compute_in_pool(chunk, args, items)

    def _compute_in_pool(self, chunk: Callable[..., list], args: tuple, items: list) -> list:
        size = max(1, math.ceil(len(items) / (self.workers * _CHUNKS_PER_WORKER)))
        starts = list(range(0, len(items), size))
        results: list[Any] = [None] * len(items)
        pending: list[int] = []
        pool = self._get_pool()
        try:
            futures: list[Future] = [pool.submit(chunk, *args, items[start:start + size]) for start in starts]
        except BrokenProcessPool:  # a worker died since the last batch
            futures, pending = [], list(range(len(items)))
        for start, future in zip(starts, futures):
            try:
                results[start:start + size] = future.result()
            except BrokenProcessPool:
                pending.extend(range(start, min(start + size, len(items))))
        if pending:
            self._recover(chunk, args, items, pending, results)
        lost = "the worker process died"
        return [r if r is not None else _lost(chunk, item, lost) for r, item in zip(results, items)]

    def _recover(self, chunk: Callable[..., list], args: tuple, items: list, pending: list[int],
                 results: list[Any]) -> None:
        """A worker died (a crash in the native library, or killed): restart the pool and retry the lost
        molecules one at a time, so that only a molecule that kills a worker again is marked failed."""
        logger.warning("%s: a worker process died; retrying %d molecules one at a time", self.name, len(pending))
        self.close()
        for index in pending:
            try:
                results[index] = self._get_pool().submit(chunk, *args, [items[index]]).result()[0]
            except BrokenProcessPool:
                results[index] = _lost(chunk, items[index], "the worker process died on this molecule")
                self.close()


def _lost(chunk: Callable[..., list], item: tuple, reason: str) -> Any:
    """The failed result of `chunk`'s kind for an item whose worker died."""
    zeros = np.zeros_like(np.asarray(item[1], dtype=np.float64))
    return (math.nan, zeros, reason, -1, None) if chunk is xtb_guided_chunk else (math.nan, zeros, reason)


@dataclass
class _Row:
    """The guidance state of one batch row (one molecule of the sampling call)."""

    start: int = 0
    steps_on_rung: int = 0
    restart: Restart | Any | None = None


class XTBGuidance:
    """Guided evaluations of one sampling call (`XTBForceField.for_guidance()`): rows are the same molecules at
    every step, so each row keeps its rung and wavefunction. `compute` returns a ForceResult whose `rung` holds
    each molecule's ladder rung (-1: failed); `rung_labels` name the rungs (`etemp_<Hartree>`)."""

    def __init__(self, forcefield: XTBForceField) -> None:
        self.forcefield = forcefield
        self.name = forcefield.name
        self.temperatures = forcefield.guidance_temperatures
        self.rung_labels = [f"etemp_{t:g}" for t in self.temperatures]
        self.last_errors: dict[int, str] = {}
        self._rows: dict[int, _Row] = {}

    def compute(self, numbers: np.ndarray, positions: np.ndarray, mask: np.ndarray) -> ForceResult:
        ff = self.forcefield
        numbers, positions, mask = validate_batch(numbers, positions, mask, name=ff.name)
        batch, width = numbers.shape
        top = len(self.temperatures) - 1
        items = []
        rows = [b for b in range(batch) if mask[b].any()]  # a row with no atoms (routed elsewhere) keeps its state
        for b in rows:
            row = self._rows.setdefault(b, _Row())
            start = row.start
            if start > 0 and row.steps_on_rung >= ff.guidance_probe_every:
                start, row.steps_on_rung = start - 1, 0  # probe: maybe the molecule converges cooler now
            # the previous step's wavefunction even when the decoded types changed: tblite starts cold
            # where its orbital dimensions differ, and a same-shaped one is as good a guess as any
            items.append((numbers[b, mask[b]], positions[b, mask[b]], start, row.restart))
        # one worker computes in this process, so tblite's result objects can stay here as they are
        keep = None if not ff.guidance_warm_start else "object" if ff.workers == 1 else "saved"
        results = ff._map(xtb_guided_chunk, (ff.method, ff.guidance_accuracy, ff.guidance_max_iterations, self.temperatures,
                                             keep), items) if items else []
        out = ForceResult.empty(batch, width)
        out.rung = np.full(batch, -1, dtype=np.int64)
        self.last_errors = {}
        for b, (energy, forces, error, rung, restart) in zip(rows, results):
            row = self._rows[b]
            if error is not None:  # every rung failed: start on the top rung next step, cold
                self.last_errors[b] = error
                row.start, row.steps_on_rung, row.restart = top, 0, None
                continue
            if rung != row.start:
                row.start, row.steps_on_rung = rung, 0
            row.steps_on_rung += 1
            row.restart = restart
            out.record(b, mask[b], energy, forces)
            out.rung[b] = rung
        return out

    def close(self) -> None:
        """Nothing to release (the pool belongs to the force field)."""
