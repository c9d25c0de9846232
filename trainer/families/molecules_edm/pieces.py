"""The parallel xyz/SDF build's pieces: the input cut into texts of whole records, and the worker that turns one
into an Arrow shard (parse, validate, perceive SMILES, write).

The parent only cuts (`cut_molecule_file`: an xyz file by its atom-count lines, an SDF by its `$$$$` record
ends; nothing is parsed), so the build's serial part is reading the bytes. Each worker (`build_piece`) parses its
records with the same functions as `readers.iter_molecules`, numbered by their index in the file, and writes its
shard with pyarrow alone (`trainer.data.arrow_shards`: the bytes `datasets`' writer wrote). What a piece
cannot know alone - an id kept in an earlier piece, the property columns' types over the whole file - the parent
settles from the pieces' results in order (`dataset.build_molecule_dataset`). This module imports neither torch nor
`datasets`: a spawned worker imports its task's module, and those two are most of a worker's start.
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from trainer.data.arrow_cache import list_array
from trainer.data.arrow_shards import Features, List, Value, arrow_schema, shard_writer, write_table
from trainer.data.xyz_pieces import XyzCutError, cut_xyz_frames
from trainer.families.molecules_edm.molecule import Molecule
from trainer.families.molecules_edm.readers import (
    MoleculeDataError,
    iter_sdf_records,
    iter_xyz_records,
    open_binary,
    source_kind,
    source_stem,
    validated,
)

ARROW_BATCH = 1024
"""Molecules per Arrow record batch."""
CORE_COLUMNS = ("id", "numbers", "positions", "num_atoms", "edm_smiles")
PIECE_TARGET = 64
"""Pieces a file is cut into (by its size, never by `num_proc`, so the cache is the same for any number of
processes): enough for a few dozen workers to get several each, so the pool's tail stays short."""
MIN_PIECE_BYTES = 256 << 10
"""Smallest piece (uncompressed bytes): below that a shard's fixed costs (a file, its writer, its load) outweigh
its work."""
KINDS = {"bool": pa.bool_(), "int64": pa.int64(), "float64": pa.float64(), "string": pa.string()}


def core_features(with_smiles: bool) -> Features:
    """The columns every molecule shard starts with (GEOM's and the xyz/SDF pieces'), `edm_smiles` when perceived."""
    features: Features = {"id": Value("string"), "numbers": List(Value("int8")),
                          "positions": List(List(Value("float32"), length=3)), "num_atoms": Value("int32")}
    if with_smiles:
        features["edm_smiles"] = Value("string")
    return features


# --------------------------------------------------------------------------------------------------
# property columns


def value_kind(value: Any) -> str:
    """b / i / f / s: the class of a property value that decides its column's type."""
    if isinstance(value, bool):
        return "b"
    if isinstance(value, int):
        return "i"
    if isinstance(value, float):
        return "f"
    return "s"


def column_kind(kinds: set[str]) -> str:
    """The Arrow type name of a property column from the classes of its values: all bool -> bool, all int ->
    int64, ints and floats -> float64, anything else -> string."""
    if kinds == {"b"}:
        return "bool"
    if kinds == {"i"}:
        return "int64"
    if kinds and kinds <= {"i", "f"}:
        return "float64"
    return "string"


def merge_schema(signatures: Sequence[tuple[tuple[str, str], ...]]) -> list[tuple[str, str]]:
    """[(property, type name)] in order of first appearance over the records' signatures (each record's
    (property, value class) pairs, in order; a repeated signature adds nothing)."""
    order: list[str] = []
    kinds: dict[str, set[str]] = {}
    for sig in signatures:
        for key, kind in sig:
            if key not in kinds:
                order.append(key)
                kinds[key] = set()
            kinds[key].add(kind)
    return [(key, column_kind(kinds[key])) for key in order]


def _signature(info: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple((k, value_kind(v)) for k, v in info.items() if k != "id" and v is not None)


def _column_values(values: list[Any], kind: str) -> list[Any]:
    if kind == "string":
        return [None if v is None else str(v) for v in values]
    if kind == "float64":
        return [None if v is None else float(v) for v in values]
    return values


def property_schema(molecules: Sequence[Molecule]) -> list[tuple[str, str]]:
    """The property columns of `molecules` ([(property, type name)]), as `write_molecule_rows` writes them."""
    return merge_schema(list(dict.fromkeys(_signature(m.info) for m in molecules)))


def write_molecule_rows(molecules: list[Molecule], smiles: list[str | None] | None, path: str,
                        schema: Sequence[tuple[str, str]] | None = None) -> dict[str, Any]:
    """Write the molecules to the Arrow file `path` (a temp name `build_shards` renames into place); `schema`: the
    property columns ([(property, type name)], default `property_schema(molecules)`)."""
    schema = property_schema(molecules) if schema is None else list(schema)
    props = [(f"info_{key}" if key in CORE_COLUMNS else key, key, kind) for key, kind in schema]
    features = core_features(smiles is not None)
    for name, _, kind in props:
        features[name] = Value(kind)
    arrow = arrow_schema(features)
    with shard_writer(arrow, path) as writer:
        for start in range(0, len(molecules), ARROW_BATCH):
            chunk = molecules[start:start + ARROW_BATCH]
            cols = {
                "id": pa.array([str(m.info["id"]) for m in chunk], pa.string()),
                "numbers": list_array([m.numbers for m in chunk], np.int8, None),
                "positions": list_array([m.positions for m in chunk], np.float32, 3),
                "num_atoms": pa.array([m.num_atoms for m in chunk], pa.int32()),
            }
            if smiles is not None:
                cols["edm_smiles"] = pa.array(smiles[start:start + ARROW_BATCH], pa.string())
            for name, key, kind in props:
                cols[name] = pa.array(_column_values([m.info.get(key) for m in chunk], kind), KINDS[kind])
            write_table(writer, pa.Table.from_arrays([cols[n] for n in features], schema=arrow))
    return {"columns": list(features)}


# --------------------------------------------------------------------------------------------------
# cutting


@dataclass(frozen=True)
class MoleculePiece:
    """Whole records of one file: `kind` xyz or sdf, `start` the index of the first record in the file, `text`
    the raw bytes (small enough to pickle)."""

    kind: str
    path: str
    start: int
    text: bytes


def text_size(path: Path) -> int:
    """The bytes of `path`'s text: its size, or a gzip file's recorded uncompressed size (modulo 2**32, as gzip
    stores it; never less than the compressed size)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if f.read(2) != b"\x1f\x8b" or size < 18:
            return size
        f.seek(-4, 2)
        return max(size, struct.unpack("<I", f.read(4))[0])


def piece_bytes_for(path: Path) -> int:
    """Bytes per piece: the file's text cut into `PIECE_TARGET` pieces, none under `MIN_PIECE_BYTES`."""
    return max(MIN_PIECE_BYTES, -(-text_size(path) // PIECE_TARGET))


def cut_molecule_file(path: str | Path, piece_bytes: int | None = None) -> Iterator[MoleculePiece]:
    """The file cut into `MoleculePiece`s of about `piece_bytes` (default `piece_bytes_for`) without parsing a
    record: an xyz file at its frames' atom-count lines (a bad count line or a truncated frame raises
    `MoleculeDataError` after the pieces before it), an SDF after its `$$$$` lines."""
    path = Path(path)
    size = piece_bytes_for(path) if piece_bytes is None else int(piece_bytes)
    kind = source_kind(path)
    with open_binary(path) as f:
        if kind == "xyz":
            try:
                for piece in cut_xyz_frames(f, piece_bytes=size, blank="skip", truncated="error"):
                    yield MoleculePiece("xyz", str(path), piece.start, piece.text)
            except XyzCutError as e:
                raise MoleculeDataError(str(path), e.index, None, "unreadable", e.detail) from None
            return
        start = index = held = 0
        lines: list[bytes] = []
        for line in f:
            lines.append(line)
            held += len(line)
            if line[:4] == b"$$$$":  # where RDKit's SDF supplier ends a record
                index += 1
                if held >= size:
                    yield MoleculePiece("sdf", str(path), start, b"".join(lines))
                    lines, start, held = [], index, 0
        if lines:
            yield MoleculePiece("sdf", str(path), start, b"".join(lines))


# --------------------------------------------------------------------------------------------------
# the worker


def build_piece(piece: MoleculePiece, settings: dict[str, Any], schema: Sequence[tuple[str, str]] | None,
                seen: Sequence[str], path: str) -> dict[str, Any]:
    """Parse, validate, perceive the SMILES of and write one piece to the Arrow file `path` (the task of
    `arrow_cache.build_shards`).

    `settings`: `elements` (atomic numbers allowed, or None), `min_distance`, `on_invalid`, `id_key`,
    `add_hydrogens`, `compute_smiles`. `schema`: the property columns to write (None: this piece's own). `seen`:
    ids an earlier piece kept (their records here are duplicates). Returns `records`, `skipped` (by reason),
    `ids` and `indices` (of the kept records, in order), `signatures` (each distinct (property, value class)
    signature, in order of first use) and `signature_of` (each kept record's, as uint32 bytes), `schema` (the
    property columns written) and `error`: with on_invalid="error", the first bad record's `MoleculeDataError`
    (returned, not raised, so that the parent can first report a duplicate of an earlier piece's id that comes
    before it in the file; the shard is then empty, `ids` and `indices` those of the records before it).
    """
    file = Path(piece.path)
    text = (piece.start, piece.text)
    records = (iter_xyz_records(file, text) if piece.kind == "xyz"
               else iter_sdf_records(file, settings["add_hydrogens"], text))
    allowed = None if settings["elements"] is None else set(settings["elements"])
    skipped: Counter = Counter()
    total = [0]
    molecules: list[Molecule] = []
    indices: list[int] = []
    kept_indices: list[int] = []
    error: MoleculeDataError | None = None

    def numbered() -> Iterator[tuple[int, Any]]:
        for index, record in records:
            indices.append(index)
            yield index, record

    try:
        for mol in validated(numbered(), str(file), source_stem(file), allowed=allowed,
                             min_distance=settings["min_distance"], on_invalid=settings["on_invalid"],
                             id_key=settings["id_key"], skipped=(skipped,), total=total, seen=set(seen)):
            molecules.append(mol)
            kept_indices.append(indices[-1])  # the record just validated
    except MoleculeDataError as e:
        if settings["on_invalid"] != "error":
            raise
        error = e
    ids = [str(m.info["id"]) for m in molecules]
    if error is not None:
        molecules = []  # nothing of a failed build is kept; the ids before the error are still checked
    signatures: dict[tuple[tuple[str, str], ...], int] = {}
    signature_of = np.array([signatures.setdefault(_signature(m.info), len(signatures)) for m in molecules],
                            dtype=np.uint32)
    written = merge_schema(list(signatures)) if schema is None else list(schema)
    smiles = None
    if settings["compute_smiles"]:
        from trainer.families.molecules_edm.metrics import smiles_of

        smiles = smiles_of([(m.numbers, m.positions) for m in molecules])
    write_molecule_rows(molecules, smiles, path, written)
    return {"records": total[0], "skipped": dict(skipped), "ids": ids, "indices": kept_indices,
            "signatures": list(signatures), "signature_of": signature_of.tobytes(),
            "schema": written, "error": error}
