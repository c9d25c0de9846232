"""GEOM-Drugs (`drugs_crude.msgpack`) into the molecules cache, read in parallel, with EDM's conformer rule and split.

The public file is a stream of msgpack maps {smiles: {"conformers": [{"xyz": [[Z, x, y, z], ...],
"totalenergy": ..., "boltzmannweight": ..., ...}, ...], ...}, ...}. EDM (`build_geom_dataset.py`) keeps, per
molecule, the `conformations` (30) conformers of lowest `totalenergy` (numpy's `argsort` of the energies, so ties
fall as EDM's), hydrogens included unless `remove_h`, in file order; each kept conformer is one training row.

`build_geom_dataset` scans the file once for the byte offset of each molecule (msgpack `skip`, nothing is
decoded), cuts it into shards of `molecules_per_shard` molecules (by default `SHARD_TARGET` shards, whatever
`num_proc` is), and converts the shards in a spawn pool
(`arrow_cache.build_shards`): each worker decodes only its own molecules, one at a time, applies the rule and
perceives each conformer's SMILES (`metrics.molecule_smiles`, the function generated molecules are scored with), so
the SMILES are computed in parallel once and cached with the shards. The rows are in file order whatever
`num_proc` is. Columns: those of `dataset.build_molecule_dataset` (`id` = "<molecule>/<rank by energy>", `numbers`,
`positions`, `num_atoms`, `edm_smiles`) plus `smiles` (GEOM's key), `molecule` (its index in the file),
`conformer` (its rank by energy), `totalenergy` and `boltzmannweight`.

`geom_split` is EDM's split: a permutation of the conformers (seeded here; EDM's own `geom_permutation.npy` can be
given instead), the first `val_fraction` of it validation, the next `test_fraction` test, the rest training.
"""

from __future__ import annotations

import logging
import os
from array import array
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from trainer.data.arrow_cache import (
    build_shards,
    cache_root,
    digest,
    file_keys,
    list_array,
    load_arrow,
    read_meta,
    write_meta,
)
from trainer.data.arrow_shards import Features, Value, arrow_schema, shard_writer, write_table
from trainer.families.molecules_edm.pieces import core_features
from trainer.families.molecules_edm.readers import MoleculeDataError, ReadReport, element_numbers, log_skips

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)

GEOM_FORMAT_VERSION = "geom-drugs-v2"
"""Bump when the conversion, the columns or the shards' layout change, so that old caches are not reused (v2: one
record batch a shard)."""
GEOM_DRUGS_ELEMENTS = ("H", "B", "C", "N", "O", "F", "Al", "Si", "P", "S", "Cl", "As", "Br", "I", "Hg", "Bi")
"""EDM's GEOM-Drugs atom vocabulary (its `geom_with_h` dataset info), in its order."""
GEOM_CONFORMATIONS = 30
"""Conformers kept per molecule (EDM's `--conformations` default)."""
MOLECULES_PER_SHARD = 1000
"""Most molecules per shard (up to 30 conformers each), when `molecules_per_shard` is left to the build."""
MIN_MOLECULES_PER_SHARD = 8
"""Fewest molecules per shard the build chooses: below that a shard's fixed costs (a file, its writer, its load)
outweigh its work."""
SHARD_TARGET = 64
"""Shards the build cuts a file into when `molecules_per_shard` is left to it (within the two bounds above): a
fixed count per file, never per `num_proc`, so the cache is the same for any number of processes, and enough
shards for each of a few dozen workers to get several, so the pool's tail (the last shard still running) stays
short. A shard is the unit of parallel work: a file cut into fewer shards than workers leaves workers idle."""


def _cores() -> int:
    return max(1, len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _features(compute_smiles: bool) -> Features:
    feats = core_features(compute_smiles)
    feats.update({"smiles": Value("string"), "molecule": Value("int64"), "conformer": Value("int32"),
                  "totalenergy": Value("float64"), "boltzmannweight": Value("float64")})
    return feats


def _molecule_offsets(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(byte offset, top-level map) of each molecule of the file, in file order: one pass with msgpack's `skip`
    (nothing is decoded), so the shards can be cut after the molecules are counted."""
    import msgpack

    offsets, maps = array("q"), array("q")
    index = m = 0
    with open(path, "rb") as f:
        unpacker = msgpack.Unpacker(f, raw=False)
        while True:
            at = unpacker.tell()
            try:
                n = unpacker.read_map_header()
            except msgpack.OutOfData:
                break
            except Exception as exc:  # msgpack's errors for a wrong type or bad bytes differ by version
                raise MoleculeDataError(str(path), index, None, "not_geom_msgpack",
                                        f"expected a msgpack map {{smiles: molecule}} at byte {at}: {exc}") from exc
            for _ in range(n):
                offsets.append(unpacker.tell())
                maps.append(m)
                try:
                    unpacker.skip()
                    unpacker.skip()
                except msgpack.OutOfData as exc:
                    raise MoleculeDataError(str(path), index, None, "truncated",
                                            f"the file ends inside molecule {index} (byte {unpacker.tell()})") from exc
                index += 1
            m += 1
    return np.frombuffer(offsets, dtype=np.int64), np.frombuffer(maps, dtype=np.int64)


def auto_molecules_per_shard(molecules: int) -> int:
    """Molecules per shard for a file of `molecules`: `SHARD_TARGET` shards, within `MIN_MOLECULES_PER_SHARD`
    and `MOLECULES_PER_SHARD` molecules each."""
    return int(min(MOLECULES_PER_SHARD, max(MIN_MOLECULES_PER_SHARD, -(-int(molecules) // SHARD_TARGET))))


def _plan_shards(offsets: np.ndarray, maps: np.ndarray,
                 molecules_per_shard: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """(first molecule index, [(byte offset, molecules), ...]) per shard of at most `molecules_per_shard`
    molecules, in file order: a segment is a run of molecules within one top-level map (a worker seeks to its
    offset and decodes `molecules` key/value pairs)."""
    shards = []
    for first in range(0, len(offsets), molecules_per_shard):
        last = min(len(offsets), first + molecules_per_shard)
        cuts = [first, *(first + 1 + np.flatnonzero(np.diff(maps[first:last]))).tolist(), last]
        shards.append((first, [(int(offsets[a]), b - a) for a, b in zip(cuts[:-1], cuts[1:])]))
    return shards


def _shard_segments(path: str | Path, molecules_per_shard: int | None = None) -> list[tuple[int, list[tuple[int, int]]]]:
    """`_plan_shards` of the file's molecules; `molecules_per_shard` None: `auto_molecules_per_shard`."""
    offsets, maps = _molecule_offsets(path)
    size = auto_molecules_per_shard(len(offsets)) if molecules_per_shard is None else int(molecules_per_shard)
    return _plan_shards(offsets, maps, size)


def _conformer_problem(xyz: Any, allowed: np.ndarray) -> tuple[str, str] | None:
    """(reason, message) when `xyz` is not a conformer of the vocabulary (`allowed`: [119] bool by Z), else None."""
    if not isinstance(xyz, np.ndarray) or xyz.ndim != 2 or xyz.shape[1] != 4 or len(xyz) == 0:
        return "bad_xyz", f"xyz must be a non-empty [n, 4] list of [Z, x, y, z], got shape {np.shape(xyz)}"
    if not np.isfinite(xyz).all():
        return "non_finite", "xyz holds NaN or inf"
    z = xyz[:, 0]
    # a lookup in a [119] table: `np.isin` sorts on every call, a cost paid per conformer in the workers
    zi = z.astype(np.int64)
    if (z != zi).any() or (zi < 0).any() or (zi >= len(allowed)).any() or not allowed[zi].all():
        inside = (z == zi) & (zi >= 0) & (zi < len(allowed))
        bad = z[~inside | ~allowed[np.where(inside, zi, 0)]]
        return "unknown_element", f"atomic number {bad[0]:g} is not in the element vocabulary"
    return None


def _write_geom_shard(path: str, segments: list[tuple[int, int]], first: int, settings: dict[str, Any],
                      tmp: str) -> dict[str, Any]:
    """Convert the molecules of `segments` (molecule indices from `first`) into the Arrow shard `tmp`."""
    import msgpack

    allowed = np.zeros(119, dtype=bool)  # allowed[Z]: Z is in the element vocabulary
    allowed[list(element_numbers(settings["elements"]))] = True
    keep, remove_h, policy = settings["conformations"], settings["remove_h"], settings["on_invalid"]
    compute_smiles = settings["compute_smiles"]
    if compute_smiles:
        from trainer.families.molecules_edm.metrics import molecule_smiles
    cols: dict[str, list[Any]] = {k: [] for k in ("id", "numbers", "positions", "edm_smiles", "smiles", "molecule",
                                                  "conformer", "totalenergy", "boltzmannweight")}
    skipped: Counter = Counter()
    index = first
    with open(path, "rb") as f:
        for offset, count in segments:
            f.seek(offset)
            unpacker = msgpack.Unpacker(f, raw=False)
            for _ in range(count):
                smiles, info = unpacker.unpack(), unpacker.unpack()
                conformers = info.get("conformers") if isinstance(info, dict) else None
                if not conformers:
                    if policy == "error":
                        raise MoleculeDataError(path, index, str(smiles), "no_conformers",
                                                "the molecule has no 'conformers' list")
                    skipped["no_conformers"] += 1
                    index += 1
                    continue
                try:
                    energies = np.array([c["totalenergy"] for c in conformers], dtype=np.float64)
                except (KeyError, TypeError, ValueError) as exc:
                    raise MoleculeDataError(path, index, str(smiles), "bad_totalenergy",
                                            f"every conformer needs a numeric 'totalenergy' to rank it: {exc!r}") from exc
                for rank, k in enumerate(np.argsort(energies)[:keep]):  # EDM's call: ties fall as in EDM
                    conformer = conformers[int(k)]
                    try:
                        xyz = np.asarray(conformer.get("xyz"), dtype=np.float64)
                    except (TypeError, ValueError):
                        xyz = None
                    problem = _conformer_problem(xyz, allowed)
                    if problem is not None:
                        if policy == "error":
                            raise MoleculeDataError(path, index, f"{index}/{rank}", problem[0],
                                                    f"field 'xyz' of conformer {int(k)}: {problem[1]}")
                        skipped[problem[0]] += 1
                        continue
                    if remove_h:
                        xyz = xyz[xyz[:, 0] != 1.0]
                    numbers = xyz[:, 0].astype(np.int8)
                    positions = xyz[:, 1:].astype(np.float32)
                    cols["id"].append(f"{index}/{rank}")
                    cols["numbers"].append(numbers)
                    cols["positions"].append(positions)
                    cols["smiles"].append(str(smiles))
                    cols["molecule"].append(index)
                    cols["conformer"].append(rank)
                    cols["totalenergy"].append(float(energies[k]))
                    weight = conformer.get("boltzmannweight")
                    cols["boltzmannweight"].append(None if weight is None else float(weight))
                    if compute_smiles:
                        try:
                            cols["edm_smiles"].append(molecule_smiles(numbers, positions.astype(np.float64)))
                        except Exception:  # a geometry RDKit cannot take is an invalid molecule, not a failed build
                            cols["edm_smiles"].append(None)
                index += 1
    features = _features(compute_smiles)
    rows = len(cols["id"])
    schema = arrow_schema(features)
    arrays = {
        "id": pa.array(cols["id"], pa.string()),
        "numbers": list_array(cols["numbers"], np.int8, None),
        "positions": list_array(cols["positions"], np.float32, 3),
        "num_atoms": pa.array([len(x) for x in cols["numbers"]], pa.int32()),
        "edm_smiles": pa.array(cols["edm_smiles"], pa.string()),
        "smiles": pa.array(cols["smiles"], pa.string()),
        "molecule": pa.array(cols["molecule"], pa.int64()),
        "conformer": pa.array(cols["conformer"], pa.int32()),
        "totalenergy": pa.array(cols["totalenergy"], pa.float64()),
        "boltzmannweight": pa.array(cols["boltzmannweight"], pa.float64()),
    }
    with shard_writer(schema, tmp) as writer:
        # One record batch a shard (an empty one for a shard without rows): every batch has its own headers and
        # chunk objects, which each rank reads and holds for every shard it opens, so batches of a fixed row
        # count would make a rank's memory grow with the data set.
        write_table(writer, pa.Table.from_arrays([arrays[n] for n in features], schema=schema),
                    batch_rows=max(rows, 1))
    return {"molecules": index - first, "conformers": rows, "skipped": dict(skipped)}


def build_geom_dataset(path: str | Path, elements: Sequence[str] = GEOM_DRUGS_ELEMENTS,
                       cache_dir: str | Path | None = None, *, conformations: int = GEOM_CONFORMATIONS,
                       remove_h: bool = False, on_invalid: str = "error", compute_smiles: bool = True,
                       num_proc: int | None = None, molecules_per_shard: int | None = None) -> datasets.Dataset:
    """GEOM's `drugs_crude.msgpack` (or any file of its layout) as a memory-mapped molecule dataset (see the module).

    Cached by the file's content fingerprint and the settings (`elements`, `conformations`, `remove_h`,
    `on_invalid`, `compute_smiles`, `molecules_per_shard`; not `num_proc`, which changes neither rows nor
    shards). `molecules_per_shard` None cuts the file into `SHARD_TARGET` shards (`auto_molecules_per_shard`:
    the same shards for any `num_proc`, enough of them for every worker). `on_invalid="skip"` drops a
    molecule without conformers or a conformer whose `xyz` is malformed or holds an element outside
    `elements`, counted by reason (`molecule_report.skipped`, in conformers; a molecule without any counts
    once); "error" raises on the first, naming the file, the molecule, the conformer and the field.
    `num_proc` (default: the cores this process may use) workers convert the shards. The result has
    `molecule_report` (`readers.ReadReport` of conformers), `geom_molecules` and `cache_hit`.
    """
    if on_invalid not in ("error", "skip"):
        raise ValueError(f"on_invalid must be 'error' or 'skip', got {on_invalid!r}")
    if conformations < 1 or (molecules_per_shard is not None and molecules_per_shard < 1):
        raise ValueError("conformations and molecules_per_shard must be >= 1")
    path = Path(path)
    if not path.is_file():
        raise MoleculeDataError(str(path), None, None, "missing_file", "no such file")
    elements = tuple(str(e) for e in elements)
    element_numbers(elements)  # an unknown symbol fails here, before any parsing
    settings = {"version": GEOM_FORMAT_VERSION, "elements": list(elements), "conformations": int(conformations),
                "remove_h": bool(remove_h), "on_invalid": on_invalid, "compute_smiles": bool(compute_smiles),
                "molecules_per_shard": (int(molecules_per_shard) if molecules_per_shard is not None else
                                        {"auto": [SHARD_TARGET, MIN_MOLECULES_PER_SHARD, MOLECULES_PER_SHARD]})}
    inputs = file_keys(path)
    fingerprint = digest({"inputs": inputs, "settings": settings})
    root = cache_root(cache_dir, "molecules_edm")
    sidecar = root / f"{fingerprint}.json"
    meta = read_meta(sidecar)
    hit = bool(meta and meta.get("shards") and all((root / s).exists() for s in meta["shards"]))
    if not hit:
        workers = _cores() if num_proc is None else max(1, int(num_proc))
        # the location pass first (the only serial part: it skips through the file without decoding), so the
        # shards are cut from the molecule count; the workers get byte offsets and read the file themselves
        plan = _shard_segments(path, molecules_per_shard)
        shards = [f"{fingerprint}-{k:05d}.arrow" for k in range(len(plan))]
        jobs = [(_write_geom_shard, (str(path.resolve()), segments, first, settings), root / name)
                for (first, segments), name in zip(plan, shards)]
        renamed: list[str] = []
        try:
            results = build_shards(jobs, workers, max_in_flight=2 * workers + 2, renamed=renamed)
        except BaseException:  # the file fails as a whole: no shards of it are left without their sidecar
            for final in renamed:
                Path(final).unlink(missing_ok=True)
            raise
        if not results:
            raise MoleculeDataError(str(path), None, None, "no_records", "no molecules in the file")
        skipped = Counter()
        for r in results:
            skipped.update(r["skipped"])
        kept = sum(r["conformers"] for r in results)
        if kept == 0:
            raise MoleculeDataError(str(path), None, None, "no_records", f"no valid conformers ({dict(skipped)} skipped)")
        meta = {"fingerprint": fingerprint, "shards": shards, "records": kept + sum(skipped.values()), "kept": kept,
                "skipped": dict(skipped), "molecules": sum(r["molecules"] for r in results), "settings": settings,
                "inputs": inputs}
        write_meta(sidecar, meta)
        log_skips(skipped, meta["records"], f"GEOM dataset {fingerprint[:8]}")
    assert meta is not None
    ds = load_arrow([root / s for s in meta["shards"]], fingerprint)
    ds.molecule_report = ReadReport(meta["records"], meta["kept"], dict(meta["skipped"]))
    ds.geom_molecules = meta["molecules"]
    ds.cache_hit = hit
    return ds


def geom_split(num_conformers: int, seed: int = 0, val_fraction: float = 0.1, test_fraction: float = 0.1,
               permutation: str | Path | np.ndarray | None = None) -> dict[str, np.ndarray]:
    """EDM's GEOM split of rows 0..num_conformers-1: {"train", "validation", "test"} row indices.

    The rows are permuted (`numpy.random.default_rng(seed)`, or `permutation`: EDM's `geom_permutation.npy` or an
    array), then the first int(n * val_fraction) are validation, the next int(n * test_fraction) test and the rest
    training, as EDM's `load_split_data`. Conformers of one molecule can fall in different splits, as in EDM.
    The rows are int32 below 2**31 conformers (else int64), views of one permutation.
    """
    n = int(num_conformers)
    if permutation is None:
        perm = np.random.default_rng(seed).permutation(n)
    else:
        perm = np.load(permutation, allow_pickle=False) if isinstance(permutation, (str, Path)) else permutation
        perm = np.asarray(perm).astype(np.int64).reshape(-1)
        if len(perm) != n or not np.array_equal(np.sort(perm), np.arange(n)):
            raise ValueError(f"the permutation must hold each of 0..{n - 1} once ({len(perm)} values given)")
    if n < 2**31:  # a rank keeps the permutation for the run (its selections' indices view it): 4 bytes a row
        perm = perm.astype(np.int32)
    val, test = int(n * val_fraction), int(n * test_fraction)
    return {"train": perm[val + test:], "validation": perm[:val], "test": perm[val:val + test]}
