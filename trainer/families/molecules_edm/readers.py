"""Molecule readers: xyz/extxyz (also .gz), SDF and in-memory `ase.Atoms` in, validated `Molecule`s out.

Every record becomes a `Molecule` (atomic numbers, positions in Angstrom) whose `info` holds `id` and
every per-molecule scalar or string property of the record (QM9's extxyz: `qm9_id`, `smiles`, `U0_Ha`,
`gap_Ha`, `homo_Ha`, `lumo_Ha`, `mu_D`, `alpha_bohr3`; SDF: the data fields and `name`; an extxyz
`energy` that ASE moves into a calculator comes back as `energy`). The id is `info[id_key]` when
`id_key` is given, else the record's `id`, else its `qm9_id`, else `<file stem>#<record index>`.

xyz files are read frame by frame from one forward stream: `ase.io.iread` seeks back to each frame,
which restarts the decompression of a .gz file every time (quadratic: minutes for 10,000 QM9 frames).
Each frame's text is handed to ASE's extxyz parser; a plain-xyz comment line (no `key=value`) is kept
as the `comment` property instead of being parsed as flags.

Bad records - an element outside the vocabulary, NaN/inf coordinates, no atoms, two atoms closer than
`min_distance`, a duplicate id, a frame or SDF block the parser rejects, an SDF without 3D coordinates -
raise `MoleculeDataError` naming the file, the record (index and id) and the reason; with
`on_invalid="skip"` they are skipped, counted by reason and logged. A broken atom-count line or a
truncated frame leaves no way to find the next frame: always an error.
"""

from __future__ import annotations

import gzip
import io
import logging
import math
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from trainer.errors import DataError
from trainer.families.molecules_edm.molecule import QM9_ELEMENTS, Molecule

logger = logging.getLogger(__name__)

MIN_DISTANCE = 0.5
"""Angstrom: two atoms closer than this make a record invalid (`atoms_too_close`)."""
XYZ_SUFFIXES = (".xyz", ".extxyz")
SDF_SUFFIXES = (".sdf", ".mol", ".sd")
BUNDLED_QM9 = "qm9_3k.extxyz.gz"
_SAMPLES = Path(__file__).resolve().parent / "samples"


def bundled_qm9_path() -> Path:
    """The bundled 3,000 QM9 molecules (extxyz.gz with QM9's per-molecule info); provenance in samples/README.md."""
    return _SAMPLES / BUNDLED_QM9


# --------------------------------------------------------------------------------------------------
# errors and reports


class MoleculeDataError(DataError):
    """A record that cannot be used: names the file, the record (index and id), the reason and details."""

    def __init__(self, source: str, index: int | None, record_id: str | None, reason: str, detail: str):
        self.source, self.index, self.record_id, self.reason, self.detail = source, index, record_id, reason, detail
        where = f"record {index}" if index is not None else "file"
        if record_id is not None:
            where += f" (id {record_id!r})"
        super().__init__(f"{source}: {where}: {reason}: {detail}")

    def __reduce__(self):  # picklable across processes despite the custom __init__
        return (type(self), (self.source, self.index, self.record_id, self.reason, self.detail))


@dataclass
class ReadReport:
    """What a read saw: `records` read (kept + skipped), `kept`, `skipped` counts by reason."""

    records: int = 0
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        skipped = ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items())) or "none"
        return f"{self.kept} of {self.records} molecules kept; skipped: {skipped}"


def check_policy(on_invalid: str) -> None:
    if on_invalid not in ("error", "skip"):
        raise ValueError(f"on_invalid must be 'error' or 'skip', got {on_invalid!r}")


def log_skips(skipped: Counter | dict[str, int], total: int, what: str) -> None:
    """One warning with the skip counts by reason (nothing when none were skipped)."""
    if skipped and sum(skipped.values()):
        counts = ", ".join(f"{k}={v}" for k, v in sorted(skipped.items()))
        logger.warning("%s: skipped %d of %d molecules (%s)", what, sum(skipped.values()), total, counts)


# --------------------------------------------------------------------------------------------------
# validation


def element_numbers(elements: Sequence[str]) -> tuple[int, ...]:
    """Atomic numbers of element symbols (a ValueError names an unknown symbol)."""
    from ase.data import atomic_numbers

    out = []
    for symbol in elements:
        if symbol not in atomic_numbers or atomic_numbers[symbol] == 0:
            raise ValueError(f"unknown element symbol {symbol!r} in the element vocabulary")
        out.append(atomic_numbers[symbol])
    return tuple(out)


def _closest_pair(positions: np.ndarray) -> tuple[int, int, float]:
    """(i, j, distance) of the closest pair of atoms (n >= 2), in blocks to bound memory on big molecules."""
    n = len(positions)
    best = (0, 1, math.inf)
    block = max(1, 4_000_000 // max(n, 1))
    for start in range(0, n, block):
        diff = positions[start:start + block, None, :] - positions[None, :, :]
        d = np.sqrt((diff * diff).sum(-1))
        rows = np.arange(d.shape[0])
        d[rows, start + rows] = np.inf
        k = int(np.argmin(d))
        i, j = divmod(k, n)
        if d[i, j] < best[2]:
            best = (start + i, j, float(d[i, j]))
    return best


def validate_molecule(numbers: np.ndarray, positions: np.ndarray, allowed: set[int] | None,
                      min_distance: float) -> tuple[str, str] | None:
    """(reason, detail) of the first problem of a molecule, or None: empty_molecule, unknown_element,
    non_finite_position, atoms_too_close."""
    from ase.data import chemical_symbols

    n = len(numbers)
    if n == 0:
        return "empty_molecule", "no atoms"
    bad = np.flatnonzero((numbers < 1) | (numbers >= len(chemical_symbols)))
    if allowed is not None:
        bad = np.flatnonzero(~np.isin(numbers, sorted(allowed)))
    if len(bad):
        k = int(bad[0])
        z = int(numbers[k])
        symbol = chemical_symbols[z] if 0 < z < len(chemical_symbols) else f"Z={z}"
        vocab = "" if allowed is None else f" (allowed: {' '.join(chemical_symbols[a] for a in sorted(allowed))})"
        return "unknown_element", f"atom {k} is {symbol}, outside the element vocabulary{vocab}"
    nonfinite = np.flatnonzero(~np.isfinite(positions).all(axis=1))
    if len(nonfinite):
        k = int(nonfinite[0])
        return "non_finite_position", f"atom {k} has position {positions[k].tolist()} ({len(nonfinite)} atoms non-finite)"
    if n >= 2 and min_distance > 0:
        i, j, d = _closest_pair(positions)
        if d < min_distance:
            return "atoms_too_close", f"atoms {i} and {j} are {d:.4f} Angstrom apart (< min_distance {min_distance})"
    return None


def _plain(value: Any) -> Any:
    """A per-molecule property as a plain Python scalar, or None if it is not a scalar or a string."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, str):
        return value
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return _plain(value.item())
    return None


def _properties(raw: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in raw.items():
        plain = _plain(value)
        if plain is not None:
            out[str(key)] = plain
    return out


# --------------------------------------------------------------------------------------------------
# xyz / extxyz


def _open_text(path: Path) -> IO[str]:
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="utf-8")  # type: ignore[return-value]
    return open(path, encoding="utf-8")


def iter_xyz_frames(path: str | Path) -> Iterator[tuple[int, str]]:
    """(record index, frame text) of every frame of an xyz/extxyz(.gz) file, from one forward stream.

    Blank lines between frames are allowed. A bad atom-count line or a truncated frame raises
    `MoleculeDataError` (no later frame can be located).
    """
    with _open_text(Path(path)) as f:
        yield from _frames(f, str(path))


def _frames(f: IO[str], source: str, index: int = 0) -> Iterator[tuple[int, str]]:
    """`iter_xyz_frames` of an open text stream whose first frame is record `index` of `source`."""
    line_no = 0
    while True:
        line = f.readline()
        line_no += 1
        if not line:
            return
        if not line.strip():
            continue
        try:
            n = int(line.strip())
        except ValueError:
            raise MoleculeDataError(source, index, None, "unreadable",
                                    f"line {line_no}: expected an atom count, got {line.strip()[:60]!r}") from None
        if n < 0:
            raise MoleculeDataError(source, index, None, "unreadable", f"line {line_no}: negative atom count {n}")
        lines = [line]
        for _ in range(n + 1):
            nxt = f.readline()
            if not nxt:
                raise MoleculeDataError(source, index, None, "unreadable",
                                        f"truncated frame starting at line {line_no}: expected {n} atoms, "
                                        f"file ends after {max(len(lines) - 2, 0)}")
            lines.append(nxt if nxt.endswith("\n") else nxt + "\n")
        line_no += n + 1
        yield index, "".join(lines)
        index += 1


def _parse_xyz_frame(text: str) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """(numbers, positions, properties) of one frame's text, through ASE's extxyz parser."""
    import ase.io

    count, comment, body = text.split("\n", 2)
    props: dict[str, Any] = {}
    if "=" not in comment:
        # A plain-xyz title: ASE would turn each word into a True flag.
        if comment.strip():
            props["comment"] = comment.strip()
        comment = ""
    atoms = ase.io.read(io.StringIO(f"{count}\n{comment}\n{body}"), format="extxyz")
    props.update(_properties(atoms.info))
    calc = atoms.calc
    if calc is not None:  # ASE moves `energy` & co from the comment line into a calculator
        props.update(_properties(getattr(calc, "results", {})))
    return np.asarray(atoms.numbers, dtype=np.int64), np.asarray(atoms.positions, dtype=np.float64), props


def iter_xyz_records(path: Path, piece: tuple[int, bytes] | None = None) -> Iterator[tuple[int, Any]]:
    """(index, (numbers, positions, props) or (reason, detail)) of every frame; of the frames of `piece` (the
    index of its first frame in the file, its raw text: `pieces.cut_molecule_file`) when given."""
    if piece is None:
        frames = iter_xyz_frames(path)
    else:
        # universal newlines, as the whole file's text stream reads them
        frames = _frames(io.TextIOWrapper(io.BytesIO(piece[1]), encoding="utf-8"), str(path), piece[0])
    for index, text in frames:
        try:
            yield index, _parse_xyz_frame(text)
        except KeyError as e:  # ASE's symbol table names the unknown species
            yield index, ("unknown_element", f"unknown element symbol {e.args[0]!r}")
        except Exception as e:  # ASE raises many types on a malformed frame; the next frame is still found
            yield index, ("unparsable_record", f"{type(e).__name__}: {e}")


# --------------------------------------------------------------------------------------------------
# SDF


def open_binary(path: Path) -> IO[bytes]:
    """`path` as a binary stream, decompressed when it is gzip (by its magic bytes, not its name)."""
    with open(path, "rb") as raw:
        magic = raw.read(2)
    return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")  # type: ignore[return-value]


def _sdf_records(stream: IO[bytes]) -> Iterator[bytes]:
    """The records of an SDF stream, each up to and including its `$$$$` line (a last one without it too)."""
    lines: list[bytes] = []
    for line in stream:
        lines.append(line)
        if line[:4] == b"$$$$":
            yield b"".join(lines)
            lines = []
    if any(line.strip() for line in lines):
        yield b"".join(lines)


def iter_sdf_records(path: Path, add_hydrogens: bool,
                     piece: tuple[int, bytes] | None = None) -> Iterator[tuple[int, Any]]:
    """Records of an SDF file, or of `piece` (the index of its first record in the file, its raw text)."""
    from rdkit import Chem, rdBase

    stream = open_binary(path) if piece is None else io.BytesIO(piece[1])
    with stream, rdBase.BlockLogs():
        # One supplier per record: on a stream, a record whose atom block runs into its `$$$$` makes RDKit skip to
        # the next `$$$$`, taking the following record with it, uncounted, and renumbering the rest.
        for index, block in enumerate(_sdf_records(stream), 0 if piece is None else piece[0]):
            mol = next(iter(Chem.ForwardSDMolSupplier(io.BytesIO(block), removeHs=False, sanitize=False)), None)
            if mol is None:
                yield index, ("unparsable_record", "RDKit cannot parse this SDF block")
                continue
            if mol.GetNumConformers() == 0 or not mol.GetConformer().Is3D():
                yield index, ("no_3d_coordinates", "the block has no 3D coordinates")
                continue
            if add_hydrogens:
                mol.UpdatePropertyCache(strict=False)
                if any(a.GetNumImplicitHs() for a in mol.GetAtoms()):
                    try:
                        mol = Chem.AddHs(mol, addCoords=True)
                    except Exception as e:  # RDKit's exceptions vary by failure
                        yield index, ("unparsable_record", f"cannot add the implicit hydrogens: {e}")
                        continue
            numbers = np.array([a.GetAtomicNum() for a in mol.GetAtoms()], dtype=np.int64)
            positions = np.asarray(mol.GetConformer().GetPositions(), dtype=np.float64).reshape(-1, 3)
            props = _properties(mol.GetPropsAsDict(includePrivate=False, includeComputed=False))
            name = mol.GetProp("_Name").strip() if mol.HasProp("_Name") else ""
            if name:
                props.setdefault("name", name)
            yield index, (numbers, positions, props)


# --------------------------------------------------------------------------------------------------
# in-memory


def _iter_objects(items: Sequence[Any]) -> Iterator[tuple[int, Any]]:
    for index, obj in enumerate(items):
        if isinstance(obj, Molecule):
            yield index, (obj.numbers, obj.positions, _properties(obj.info))
        elif hasattr(obj, "get_positions") and hasattr(obj, "numbers"):  # ase.Atoms
            props = _properties(obj.info)
            if obj.calc is not None:
                props.update(_properties(getattr(obj.calc, "results", {})))
            yield index, (np.asarray(obj.numbers, dtype=np.int64), np.asarray(obj.positions, dtype=np.float64), props)
        else:
            raise TypeError(f"item {index} is a {type(obj).__name__}, not an ase.Atoms or Molecule")


# --------------------------------------------------------------------------------------------------
# the reader


def source_stem(path: Path) -> str:
    """The file's name without its format suffix (and `.gz`): the prefix of its records' default ids."""
    name = path.name
    if name.endswith(".gz"):
        name = name[:-3]
    return Path(name).stem


def source_kind(path: str | Path) -> str:
    """`xyz` or `sdf` from the file name (a trailing .gz allowed); ValueError otherwise."""
    name = Path(path).name.lower().removesuffix(".gz")
    if name.endswith(XYZ_SUFFIXES):
        return "xyz"
    if name.endswith(SDF_SUFFIXES):
        return "sdf"
    raise ValueError(f"{path}: unknown molecule file type (expected .xyz/.extxyz or .sdf/.mol, optionally .gz)")


def is_path_source(source: Any) -> bool:
    return isinstance(source, (str, os.PathLike))


def iter_molecules(source: str | Path | Iterable[Any], *, elements: Sequence[str] | None = QM9_ELEMENTS,
                   min_distance: float = MIN_DISTANCE, on_invalid: str = "error", skipped: Counter | None = None,
                   id_key: str | None = None, add_hydrogens: bool = True) -> Iterator[Molecule]:
    """Valid molecules of `source`: an .xyz/.extxyz/.sdf/.mol path (optionally .gz) or a list of
    `ase.Atoms` / `Molecule`, streamed in file order.

    `elements`: the allowed element symbols (None: any element). `min_distance` (Angstrom): the
    smallest allowed interatomic distance (0 disables the check). `on_invalid`: "error" raises
    `MoleculeDataError`; "skip" counts the reason into `skipped` (a Counter you pass) and goes on;
    the skips are logged once at the end. `id_key`: the info/SDF field that holds each record's id.
    `add_hydrogens` (SDF): add the hydrogens an SDF block leaves implicit, with 3D coordinates.
    """
    check_policy(on_invalid)
    allowed = set(element_numbers(elements)) if elements is not None else None
    skipped = skipped if skipped is not None else Counter()
    if is_path_source(source):
        path = Path(source)
        name = str(path)
        if not path.is_file():
            raise MoleculeDataError(name, None, None, "missing_file", "no such file")
        kind = source_kind(path)
        records = iter_xyz_records(path) if kind == "xyz" else iter_sdf_records(path, add_hydrogens)
        prefix = source_stem(path)
    else:
        items = list(source)
        name, prefix = "<in-memory>", "molecule"
        records = _iter_objects(items)
    mine: Counter = Counter()
    total = [0]
    yield from validated(records, name, prefix, allowed=allowed, min_distance=min_distance, on_invalid=on_invalid,
                         id_key=id_key, skipped=(skipped, mine), total=total)
    log_skips(mine, total[0], name)


def validated(records: Iterable[tuple[int, Any]], name: str, prefix: str, *, allowed: set[int] | None,
              min_distance: float, on_invalid: str, id_key: str | None, skipped: Sequence[Counter],
              total: list[int], seen: set[str] | None = None) -> Iterator[Molecule]:
    """The valid molecules of parsed `records` ((index, (numbers, positions, props) or (reason, detail))), in
    order, each with its id in `info["id"]`; every skip is counted into each Counter of `skipped`, and `total[0]`
    counts the records. `seen`: the ids kept so far (a later record with one of them is a `duplicate_id`)."""
    seen = set() if seen is None else seen
    for index, record in records:
        total[0] += 1
        rid: str | None = None
        problem: tuple[str, str] | None
        if isinstance(record[0], str):
            problem = record
        else:
            numbers, positions, props = record
            if id_key is not None:
                rid = None if props.get(id_key) is None else str(props[id_key])
            else:
                rid = str(props.get("id", props.get("qm9_id", f"{prefix}#{index}")))
            if rid is None:
                problem = ("missing_id", f"no {id_key!r} field")
            else:
                problem = validate_molecule(numbers, positions.reshape(-1, 3), allowed, min_distance)
            if problem is None and rid in seen:
                problem = ("duplicate_id", "an earlier record has the same id")
        if problem is not None:
            err = MoleculeDataError(name, index, rid, *problem)
            if on_invalid == "error":
                raise err
            for counter in skipped:
                counter[err.reason] += 1
            logger.debug("skipped: %s", err)
            continue
        seen.add(rid)
        props["id"] = rid
        yield Molecule(numbers, positions, props)


def read_molecules(source: str | Path | Iterable[Any], **kwargs: Any) -> tuple[list[Molecule], ReadReport]:
    """All valid molecules of `source` and a `ReadReport` (see `iter_molecules` for the options)."""
    skipped: Counter = Counter()
    molecules = list(iter_molecules(source, skipped=skipped, **kwargs))
    return molecules, ReadReport(len(molecules) + sum(skipped.values()), len(molecules), dict(skipped))


def molecules_from_atoms(atoms: Sequence[Any], **kwargs: Any) -> list[Molecule]:
    """Validated `Molecule`s of a list of `ase.Atoms` (info properties kept; see `iter_molecules`)."""
    return list(iter_molecules(list(atoms), **kwargs))
