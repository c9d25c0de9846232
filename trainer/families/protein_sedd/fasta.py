"""FASTA reader for protein sequences (`.fasta/.fa/.faa`, optionally `.gz`), as released by UniProt.

`iter_fasta_tables` yields Arrow tables (`FASTA_SCHEMA`, one per block of the file) and `iter_fasta`
one dict per record, with a fixed column schema (`FASTA_COLUMNS`; missing string fields are None,
missing integer fields -1) so that Arrow types are stable across files and header styles.

Speed: gzip is decompressed by ISA-L in a thread of its own; each block of whole records is parsed
with numpy and `bytes` operations at once (record and line boundaries, residue classes, lengths,
and headers by `fasta_headers.parse_header_block`), so the per-record Python work is limited to the
rare records off the usual shape, which take the exact reference path (`parse_header`, `_clean`).

Chunks, for a parallel conversion: `iter_record_chunks` cuts a file's text into chunks of whole records, each
starting at the first header at or after a multiple of a fixed size (so they depend on the file alone);
`plan_chunks` finds the same chunks of an uncompressed file as byte ranges by seeking; `iter_chunk_tables`
parses one chunk (a range or a chunk's text) into the tables, counts and errors `iter_fasta_tables` gives
for those records.

Header styles:

* UniRef (`>UniRef50_A0A5A9P0L4 Peptidylprolyl isomerase n=1 Tax=Triplophysa tibetana
  TaxID=1572043 RepID=A0A5A9P0L4_9TELE`): id = `UniRef50_A0A5A9P0L4`, db = `UniRef50`,
  description = cluster name, n, tax, taxid, rep_id.
* UniProtKB (`>sp|P12345|NAME_HUMAN Desc OS=Homo sapiens OX=9606 GN=ABC PE=1 SV=2`): db = sp/tr,
  accession (also the id), entry_name, description, os, ox, gn, pe, sv.
* anything else: id = first word, description = the rest.

`KEY=value` tags the style does not know (e.g. `Split=0`), and integer tags whose value is not an
int64, are kept verbatim in `extra`.

Residue policy (every change or skip is counted in `FastaStats`, nothing is dropped silently):

* line endings may be `\\n`, `\\r\\n` (Windows) or `\\r` alone (classic Mac, detected on the first
  block); a leading UTF-8 byte-order mark is skipped, a UTF-16 one is an error; trailing whitespace
  is stripped from every line; blank lines are ignored;
* lowercase residues are upper-cased (`stats.lowercase` records);
* one terminal `*` (stop) is removed (`stats.terminal_stop`); an internal `*` is an error;
* gap characters `-` and `.` are removed (`stats.gaps` records);
* any other character that is not a letter A-Z is an error;
* the non-standard residues B, Z, J, U, O, X (`stats.nonstandard` records contain one) follow
  `nonstandard`: "keep" keeps them, except J which becomes X because the tokenizer has no J
  (`stats.j_to_x`); "map" maps B/Z/J/U/O to X (`stats.nonstandard_mapped`); "drop" skips the record
  (`stats.dropped_nonstandard`);
* `min_length` / `max_length` (0 = no limit) apply to the cleaned sequence and skip records
  (`stats.dropped_short`, `stats.dropped_long`);
* kept records of 10 or more residues made only of nucleotide letters A C G T U N (DNA or RNA given
  as protein, probably) are kept and counted (`stats.nucleotide_only`); duplicate ids are counted by
  the cached build over all its files (`dataset.build_fasta_dataset`), which warns about both.

Errors (`FastaFormatError`, naming the file, line and record): a sequence line before the first
header, a record with an empty sequence, an illegal character, a file without any record (empty,
blank lines only, or an empty `.gz`), a truncated or corrupt gzip stream (after the whole records
before the damage were read: the error says how many and the last good line).
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from isal import isal_zlib
from isal.igzip import open as _gzip_open  # ISA-L: a faster gzip decoder than zlib's
from isal.igzip_threaded import open as _gzip_open_threaded
from isal.isal_zlib import error as _IsalError

from trainer.data.splits import in_holdout
from trainer.errors import DataError
from trainer.families.protein_sedd.fasta_headers import gather_ranges, parse_header_block

_GZIP_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error, _IsalError)

NONSTANDARD_POLICIES = ("keep", "map", "drop")
CANONICAL = b"ACDEFGHIKLMNPQRSTVWY"
NONSTANDARD = b"BZJUOX"
_LETTERS = bytes(range(ord("A"), ord("Z") + 1))
_LOWER = bytes(range(ord("a"), ord("z") + 1))
_GAPS = b"-."
_J_TO_X = bytes.maketrans(b"J", b"X")
_MAP_TO_X = bytes.maketrans(b"BZJUO", b"XXXXX")
_READ_SIZE = 1 << 21
NUCLEOTIDES = b"ACGTUN"
_NUCLEOTIDE_MIN_LENGTH = 10  # shorter all-ACGTUN records are as likely peptides (e.g. GAGA) as DNA
_UTF8_BOM = b"\xef\xbb\xbf"
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")

STRING_COLUMNS = ("id", "description", "db", "accession", "entry_name", "tax", "rep_id", "os", "gn",
                  "extra")
INT_COLUMNS = ("n", "taxid", "ox", "pe", "sv")
FASTA_COLUMNS = ("id", "sequence", "length", "split") + STRING_COLUMNS[1:] + INT_COLUMNS
"""Column order of every record; `split` is "train" or "validation" (`trainer.data.splits.in_holdout` of
the id with `val_fraction` and `salt`: validation is the held-out share)."""

DECOMPRESS_IN_THREAD = True
"""Decompress gzip in a second thread while the calling thread parses (False: in the calling thread)."""

PARSE_CALLS = 0
"""Number of times a FASTA file was opened for parsing (tests use it to prove cache hits)."""


class FastaFormatError(DataError):
    """A FASTA file that cannot be read under the documented policy."""


@dataclass
class FastaStats:
    """Counters of what the reader did; `records` = `kept` + the `dropped_*` counters."""

    files: int = 0
    records: int = 0
    """Headers read."""
    kept: int = 0
    residues: int = 0
    """Residues in kept records."""
    train: int = 0
    validation: int = 0
    lowercase: int = 0
    terminal_stop: int = 0
    gaps: int = 0
    nonstandard: int = 0
    """Records containing B, Z, J, U, O or X (whatever the policy)."""
    j_to_x: int = 0
    nonstandard_mapped: int = 0
    dropped_nonstandard: int = 0
    dropped_short: int = 0
    dropped_long: int = 0
    nucleotide_only: int = 0
    """Kept records of 10+ residues made only of A C G T U N: DNA or RNA rather than protein, probably."""
    duplicate_ids: int = 0
    """Records whose id an earlier record already had: counted by `build_fasta_dataset` over all its
    files (it needs every id at once), 0 from the reader and the stream."""
    splits: dict[str, SplitCounts] | None = dataclasses.field(default=None, compare=False, repr=False)
    """Not a counter: the token counts and length histogram of each split's kept records ("train",
    "validation"), summed over the chunks by `build_fasta_dataset`; None from the reader and the stream."""

    @classmethod
    def counters(cls) -> tuple[str, ...]:
        """The names of the integer counters (every field but `splits`)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "splits")

    def __iadd__(self, other: FastaStats) -> FastaStats:
        for name in self.counters():
            setattr(self, name, getattr(self, name) + getattr(other, name))
        if other.splits is not None:
            mine = self.splits if self.splits is not None else {}
            for split, counts in other.splits.items():
                mine.setdefault(split, SplitCounts())
                mine[split] += counts
            self.splits = mine
        return self

    def to_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.counters()}

    @classmethod
    def from_dict(cls, d: dict[str, int]) -> FastaStats:
        return cls(**{k: int(v) for k, v in d.items() if k in cls.counters()})

    def summary(self) -> str:
        """One line listing the non-zero counters, for logs."""
        return ", ".join(f"{k}={v}" for k, v in self.to_dict().items() if v)


@dataclass
class SplitCounts:
    """What the task statistics of one split need, counted while converting: how often each token id occurs in
    its kept records, and how many records have each exact length."""

    token_counts: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """int64, indexed by token id (as long as the longest `token_counts` added)."""
    length_counts: dict[int, int] = dataclasses.field(default_factory=dict)
    """length -> records of that length (lengths that occur only)."""

    def add_counts(self, token_counts: np.ndarray, lengths: np.ndarray) -> None:
        """Count records whose token ids occur `token_counts` times (indexed by id) and whose lengths are
        `lengths`."""
        self._add_tokens(token_counts)
        for n, k in zip(*np.unique(lengths, return_counts=True)):
            self.length_counts[int(n)] = self.length_counts.get(int(n), 0) + int(k)

    def _add_tokens(self, counts: np.ndarray) -> None:
        if len(counts) > len(self.token_counts):
            self.token_counts = np.pad(self.token_counts, (0, len(counts) - len(self.token_counts)))
        self.token_counts[:len(counts)] += counts.astype(np.int64, copy=False)

    def __iadd__(self, other: SplitCounts) -> SplitCounts:
        self._add_tokens(other.token_counts)
        for n, k in other.length_counts.items():
            self.length_counts[n] = self.length_counts.get(n, 0) + k
        return self

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (a chunks sidecar's): lengths as string keys, in increasing order."""
        return {"token_counts": self.token_counts.tolist(),
                "length_counts": {str(n): k for n, k in sorted(self.length_counts.items())}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SplitCounts:
        return cls(np.asarray(d["token_counts"], dtype=np.int64), {int(n): int(k) for n, k in d["length_counts"].items()})


# A tag starts at whitespace followed by KEY=; descriptions rarely hold " Word=" so this is safe for
# UniProt's own files, and anything unexpected ends up in `extra` rather than being lost.
_TAG = re.compile(r"\s+([A-Za-z][A-Za-z0-9_]*)=")
_UNIREF_TAGS = {"n": "n", "Tax": "tax", "TaxID": "taxid", "RepID": "rep_id"}
_UNIPROT_TAGS = {"OS": "os", "OX": "ox", "GN": "gn", "PE": "pe", "SV": "sv"}
_INT_FIELDS = set(INT_COLUMNS)


def _empty_fields() -> dict[str, Any]:
    d: dict[str, Any] = {k: None for k in STRING_COLUMNS}
    d.update({k: -1 for k in INT_COLUMNS})
    return d


def parse_header(header: str) -> dict[str, Any]:
    """Header fields (without the leading '>') in the fixed schema of `FASTA_COLUMNS`."""
    fields = _empty_fields()
    # The id ends at the first whitespace of any kind: `>seq1<TAB>description` has the id `seq1`.
    parts = header.split(None, 1)
    first = parts[0] if parts else ""
    rest = parts[1].strip() if len(parts) > 1 else ""
    known: dict[str, str] = {}
    if first.startswith("UniRef") and "_" in first:
        fields["db"] = first.split("_", 1)[0]
        known = _UNIREF_TAGS
    elif first.count("|") == 2 and first.split("|", 1)[0] in ("sp", "tr"):
        db, accession, entry_name = first.split("|")
        fields.update(db=db, accession=accession, entry_name=entry_name or None)
        first = accession
        known = _UNIPROT_TAGS
    fields["id"] = first
    if not known:
        fields["description"] = rest or None
        return fields
    # The description ends at the first known tag; tags before it are part of the free text.
    matches = [m for m in _TAG.finditer(" " + rest)]
    start = next((i for i, m in enumerate(matches) if m.group(1) in known), None)
    if start is None:
        fields["description"] = rest or None
        return fields
    text = " " + rest
    fields["description"] = text[: matches[start].start()].strip() or None
    extra = []
    tags = matches[start:]
    for i, m in enumerate(tags):
        end = tags[i + 1].start() if i + 1 < len(tags) else len(text)
        key, value = m.group(1), text[m.end(): end].strip()
        column = known.get(key)
        if column is None or fields[column] not in (None, -1):
            extra.append(f"{key}={value}")
        elif column in _INT_FIELDS:
            try:
                number = int(value)
            except ValueError:
                number = None
            if number is None or not -2**63 <= number < 2**63:  # Arrow's int64 column
                extra.append(f"{key}={value}")
            else:
                fields[column] = number
        else:
            fields[column] = value or None
    fields["extra"] = " ".join(extra) or None
    return fields


def _is_gzip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def open_fasta(path: str | Path) -> BinaryIO:
    """Binary handle on a FASTA file, decompressing `.gz` (detected by magic bytes, not name).

    gzip is read with ISA-L (`isal.igzip`, faster than zlib), in a thread of its own unless
    `DECOMPRESS_IN_THREAD` is False.
    """
    path = Path(path)
    if _is_gzip(path):
        if DECOMPRESS_IN_THREAD:  # ISA-L releases the GIL: decompression overlaps parsing
            return _gzip_open_threaded(path, "rb", threads=1)  # type: ignore[return-value]
        return _gzip_open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def _bad_line(path: Path, lines: list[bytes], first_line: int, record_id: str, bad: bytes,
              what: str = "illegal character") -> FastaFormatError:
    """Error naming the first sequence line that holds one of `bad` (only runs on the error path)."""
    for i, line in enumerate(lines):
        hit = next((chr(c) for c in line.rstrip() if c in bad), None)
        if hit is not None:
            return FastaFormatError(f"{path}:{first_line + i}: record {record_id!r}: {what} {hit!r} in sequence")
    return FastaFormatError(f"{path}:{first_line}: record {record_id!r}: illegal characters {bad!r}")


def _clean(seq: bytes, path: Path, lines: list[bytes], first_line: int, record_id: str, nonstandard: str,
           stats: FastaStats) -> bytes | None:
    """Apply the residue policy; None means the record is skipped by policy (already counted)."""
    if not seq.translate(None, CANONICAL):
        return seq  # the common case: canonical uppercase residues only
    if seq.translate(None, _LOWER) != seq:
        seq = seq.upper()
        stats.lowercase += 1
    if seq.endswith(b"*"):
        seq = seq[:-1]
        stats.terminal_stop += 1
    if b"-" in seq or b"." in seq:
        seq = seq.translate(None, _GAPS)
        stats.gaps += 1
    bad = seq.translate(None, _LETTERS)
    if bad:
        if b"*" in bad:
            raise _bad_line(path, lines, first_line, record_id, b"*", what="internal stop")
        raise _bad_line(path, lines, first_line, record_id, bytes(sorted(set(bad))))
    if not seq:
        raise FastaFormatError(f"{path}:{first_line}: record {record_id!r}: empty sequence after removing "
                               f"gaps/stop")
    if seq.translate(None, CANONICAL):
        stats.nonstandard += 1
        if nonstandard == "drop":
            stats.dropped_nonstandard += 1
            return None
        if nonstandard == "map":
            mapped = seq.translate(_MAP_TO_X)
            if mapped != seq:
                stats.nonstandard_mapped += 1
            seq = mapped
        elif b"J" in seq:
            seq = seq.translate(_J_TO_X)
            stats.j_to_x += 1
    return seq


# Residue classes for the vectorised path: 0 canonical, 1 non-standard letter (counted, maybe
# mapped or dropped), 2 anything that needs `_clean` (lowercase, '*', gaps, '\r', illegal bytes).
_CLASS = np.full(256, 2, dtype=np.uint8)
_CLASS[np.frombuffer(CANONICAL, dtype=np.uint8)] = 0
_CLASS[np.frombuffer(NONSTANDARD, dtype=np.uint8)] = 1
_CLASS_TABLE = _CLASS.tobytes()  # bytes.translate tables: one C pass over the bytes, cheaper than numpy indexing
_NUCLEOTIDE = np.zeros(256, dtype=bool)
_NUCLEOTIDE[np.frombuffer(NUCLEOTIDES + NUCLEOTIDES.lower(), dtype=np.uint8)] = True
_KEEP_TABLE = bytes(range(256)).translate(_J_TO_X)
_MAP_TABLE = bytes(range(256)).translate(_MAP_TO_X)


def _nonzero(values: np.ndarray) -> np.ndarray:
    """np.flatnonzero of a uint8 array whose non-zero bytes are rare, 8 bytes per comparison."""
    whole = len(values) // 8 * 8
    words = np.flatnonzero(values[:whole].view(np.uint64))
    candidates = np.concatenate([(words[:, None] * 8 + np.arange(8)).ravel(), np.arange(whole, len(values))])
    return candidates[values[candidates] != 0]


FASTA_SCHEMA = pa.schema([("id", pa.string()), ("sequence", pa.string()), ("length", pa.int32()),
                          ("split", pa.string())]
                         + [(c, pa.string()) for c in STRING_COLUMNS[1:]] + [(c, pa.int64()) for c in INT_COLUMNS])
"""Arrow schema of the reader's tables (`FASTA_COLUMNS` in order)."""


def _records_with(positions: np.ndarray, starts: np.ndarray, n: int) -> np.ndarray:
    """Boolean mask over n records: which records hold one of the residue `positions`."""
    mask = np.zeros(n, dtype=bool)
    if len(positions):
        mask[np.searchsorted(starts, positions, side="right") - 1] = True
    return mask


@dataclass
class _Reader:
    """Settings and running counters of one `iter_fasta_tables` call."""

    path: Path
    min_length: int
    max_length: int
    nonstandard: str
    val_fraction: float
    salt: str
    stats: FastaStats
    shard_index: int
    shard_count: int
    ordinal: int = -1
    """Ordinal of the last header seen (counting every header of the file, all shards)."""

    def block(self, data: bytes, first_line: int) -> pa.Table | None:
        """Table of the records in `data`: whole records, '>' first, '\\n' last, at line `first_line`."""
        buf = np.frombuffer(data, dtype=np.uint8)
        newlines = _nonzero((buf == 10).view(np.uint8))
        line_starts = np.empty_like(newlines)
        line_starts[0] = 0
        line_starts[1:] = newlines[:-1] + 1
        header_lines = np.flatnonzero(buf[line_starts] == 62)
        body_end = np.append(line_starts[header_lines[1:]], len(buf))  # the next record's '>'
        first_ordinal = self.ordinal + 1
        self.ordinal += len(header_lines)
        if self.shard_count > 1:  # other shards' records are not looked at
            mine = np.arange(first_ordinal, first_ordinal + len(header_lines)) % self.shard_count == self.shard_index
            header_lines, body_end = header_lines[mine], body_end[mine]
        n = len(header_lines)
        stats = self.stats
        stats.records += n
        if not n:
            return None
        rec_start, header_end = line_starts[header_lines], newlines[header_lines]
        body_start = header_end + 1

        # Residues of the records in file order: their sequence lines joined, newlines removed.
        residue_bytes = b"".join([data[a:b] for a, b in zip(body_start.tolist(), body_end.tolist())]).translate(
            None, b"\n")
        residues = np.frombuffer(residue_bytes, dtype=np.uint8)
        counts = (body_end - body_start) - (np.searchsorted(newlines, body_end) - np.searchsorted(newlines, body_start))
        res_start = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=res_start[1:])
        odd = _nonzero(np.frombuffer(residue_bytes.translate(_CLASS_TABLE), dtype=np.uint8))  # non-canonical: few
        odd_class = _CLASS[residues[odd]]
        needs_clean = _records_with(odd[odd_class == 2], res_start[:-1], n) | (counts == 0)
        nonstd_pos = odd[odd_class == 1]
        has_nonstd = _records_with(nonstd_pos, res_start[:-1], n) & ~needs_clean
        stats.nonstandard += int(np.count_nonzero(has_nonstd))
        lut = None
        if len(nonstd_pos) and self.nonstandard != "drop":
            lut, counter = ((_KEEP_TABLE, "j_to_x") if self.nonstandard == "keep"
                            else (_MAP_TABLE, "nonstandard_mapped"))
            found = residues[nonstd_pos]
            changed = nonstd_pos[np.frombuffer(lut, dtype=np.uint8)[found] != found]
            changed_records = _records_with(changed, res_start[:-1], n) & ~needs_clean
            setattr(stats, counter, getattr(stats, counter) + int(np.count_nonzero(changed_records)))
            lut = lut if len(changed) else None

        header_start = rec_start + 1
        cols, slow_header = parse_header_block(buf, header_start, header_end, STRING_COLUMNS, INT_COLUMNS)
        lengths = counts.copy()
        dropped = has_nonstd if self.nonstandard == "drop" else np.zeros(n, dtype=bool)
        stats.dropped_nonstandard += int(np.count_nonzero(dropped))

        # The few records that need Python, in file order so that the first error is the one raised:
        # headers off the usual shape, and sequences with anything but upper-case residue letters.
        slow_fields: dict[int, dict[str, Any]] = {}
        cleaned: dict[int, bytes] = {}
        for j in np.flatnonzero(slow_header | needs_clean).tolist():
            header_line = first_line + int(header_lines[j])
            if slow_header[j]:
                fields = parse_header(data[header_start[j]:header_end[j]].decode("utf-8", errors="replace"))
                if not fields["id"]:
                    raise FastaFormatError(f"{self.path}:{header_line}: header without an id")
                slow_fields[j] = fields
                record_id = fields["id"]
            else:
                record_id = cols["id"][j].as_py()
            if needs_clean[j]:
                seq = self._clean_record(data[body_start[j]:body_end[j]], header_line, record_id)
                if seq is None:
                    dropped[j] = True
                else:
                    cleaned[j] = seq
                    lengths[j] = len(seq)
        keep = ~dropped
        if self.min_length:
            short = keep & (lengths < self.min_length)
            stats.dropped_short += int(np.count_nonzero(short))
            keep &= ~short
        if self.max_length:
            long = keep & (lengths > self.max_length)
            stats.dropped_long += int(np.count_nonzero(long))
            keep &= ~long
        if slow_fields:
            mask = np.zeros(n, dtype=bool)
            where = np.fromiter(slow_fields, dtype=np.int64, count=len(slow_fields))
            mask[where] = True
            for name in (*STRING_COLUMNS, *INT_COLUMNS):
                cols[name] = pc.replace_with_mask(cols[name], pa.array(mask), pa.array(
                    [slow_fields[j][name] for j in where.tolist()], cols[name].type))
        kept = np.flatnonzero(keep)
        if not len(kept):
            return None
        stats.nucleotide_only += self._nucleotide_only(data, residue_bytes, res_start, lengths, kept, cleaned,
                                                       body_start, body_end)

        # Sequences of the kept records: straight from `residues` when nothing was cleaned or dropped.
        source = np.frombuffer(residue_bytes.translate(lut), dtype=np.uint8) if lut is not None else residues
        kept_lengths = lengths[kept]
        if not cleaned and len(kept) == n:
            values, offsets = source, res_start
        else:
            starts = res_start[kept]
            fixed = [(k, cleaned[j]) for k, j in enumerate(kept.tolist()) if j in cleaned]
            if fixed:  # cleaned sequences are appended to the source and read from there
                where = np.array([k for k, _ in fixed], dtype=np.int64)
                starts[where] = len(source) + np.cumsum(kept_lengths[where]) - kept_lengths[where]
                source = np.concatenate([source, np.frombuffer(b"".join(seq for _, seq in fixed), dtype=np.uint8)])
            values, offsets = gather_ranges(source, starts, kept_lengths)

        take = pa.array(kept)
        ids = pc.take(cols["id"], take)
        validation = in_holdout(ids.to_pylist(), self.val_fraction, self.salt)
        n_val = int(np.count_nonzero(validation))
        stats.kept += len(kept)
        stats.residues += int(offsets[-1])
        stats.validation += n_val
        stats.train += len(kept) - n_val
        sequence = pa.StringArray.from_buffers(len(kept), pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(values))
        split = pc.if_else(pa.array(validation), "validation", "train")
        arrays = [ids, sequence, pa.array(kept_lengths.astype(np.int32)), split]
        arrays += [pc.take(cols[name], take) for name in FASTA_COLUMNS[4:]]
        return pa.Table.from_arrays(arrays, schema=FASTA_SCHEMA)

    @staticmethod
    def _nucleotide_only(data: bytes, residue_bytes: bytes, res_start: np.ndarray, lengths: np.ndarray,
                         kept: np.ndarray, cleaned: dict[int, bytes], body_start: np.ndarray,
                         body_end: np.ndarray) -> int:
        """How many kept records of 10+ residues hold only nucleotide letters (ACGTUN).

        Their first 10 residues are checked at once and only the rare records passing that are read
        whole, so proteins cost a small gather per block. Records that were cleaned are judged on
        their raw letters, as the others are (before any non-standard mapping).
        """
        long = kept[lengths[kept] >= _NUCLEOTIDE_MIN_LENGTH]
        if not len(long):
            return 0
        # raw residues: a cleaned record has at least as many raw bytes as cleaned residues
        index = np.minimum(res_start[long, None] + np.arange(_NUCLEOTIDE_MIN_LENGTH), len(residue_bytes) - 1)
        residues = np.frombuffer(residue_bytes, dtype=np.uint8)
        candidates = _NUCLEOTIDE[residues[index]].all(axis=1)
        found = 0
        for j in long[candidates].tolist():
            if j in cleaned:
                body = data[body_start[j]:body_end[j]]
                found += not body.upper().translate(None, NUCLEOTIDES + b"*-.\n\t\x0b\x0c\r ")
            else:
                found += not residue_bytes[res_start[j]:res_start[j + 1]].translate(None, NUCLEOTIDES)
        return found

    def _clean_record(self, body: bytes, header_line: int, record_id: str) -> bytes | None:
        """Sequence of a record from its lines by the exact per-line path (rare: anything but plain residues)."""
        lines = [raw.rstrip() for raw in body.split(b"\n")]
        if lines and not lines[-1]:
            lines.pop()
        seq = b"".join(lines)
        if not seq:
            raise FastaFormatError(f"{self.path}:{header_line}: record {record_id!r}: empty sequence")
        return _clean(seq, self.path, lines, header_line + 1, record_id, self.nonstandard, self.stats)


def _check_settings(nonstandard: str, val_fraction: float) -> None:
    if nonstandard not in NONSTANDARD_POLICIES:
        raise ValueError(f"nonstandard must be one of {NONSTANDARD_POLICIES}, got {nonstandard!r}")
    if not 0.0 <= val_fraction <= 1.0:  # NaN included
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction!r}")


def iter_fasta_tables(path: str | Path, *, min_length: int = 0, max_length: int = 0, nonstandard: str = "keep",
                      val_fraction: float = 0.0, salt: str = "", stats: FastaStats | None = None,
                      shard: tuple[int, int] = (0, 1)) -> Iterator[pa.Table]:
    """Records of one FASTA file as Arrow tables (`FASTA_SCHEMA`), one per block of about 2 MiB.

    `shard=(index, count)` keeps only records whose ordinal (counting every header, kept or not)
    is `index` modulo `count`; records of other shards are neither decoded nor validated, and are
    not counted in `stats`. A block is parsed as a whole with numpy (line and record boundaries,
    residue classes, lengths) and only headers are looked at one by one; records with anything but
    upper-case residue letters take the exact per-line path (`_clean`). An error is raised before
    any record of the block that holds it is yielded.
    """
    global PARSE_CALLS
    _check_settings(nonstandard, val_fraction)
    shard_index, shard_count = shard
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"bad shard {shard}")
    path = Path(path)
    stats = stats if stats is not None else FastaStats()
    PARSE_CALLS += 1
    stats.files += 1
    reader = _Reader(path, min_length, max_length, nonstandard, val_fraction, salt, stats, shard_index, shard_count)
    for chunk in _record_chunks(path, None):
        table = reader.block(chunk.data, chunk.first_line)
        if table is not None:
            yield table


@dataclass(frozen=True)
class TextChunk:
    """A piece of a FASTA file's (decompressed) text made of whole records: `data` starts with '>' and ends
    with '\\n', with Unix line endings; its first line is line `first_line` of the file and its first byte
    lies at `offset` of the text."""

    data: bytes
    first_line: int
    offset: int


@dataclass(frozen=True)
class ChunkSpan:
    """Bytes [start, end) of an uncompressed FASTA file, whole records (`start` is a header's '>').

    `first_line` is the line number of `start` where known, 0 where not (counted only to name an error's
    line); `cr_only` says that the file ends lines with a lone '\\r'."""

    start: int
    end: int
    first_line: int
    cr_only: bool


def is_compressed(path: str | Path) -> bool:
    """Whether `open_fasta` decompresses `path` (gzip, known by its magic bytes): such a file is read in order."""
    return _is_gzip(Path(path))


def iter_record_chunks(path: str | Path, chunk_bytes: int) -> Iterator[TextChunk]:
    """The whole text of a FASTA file (decompressed) in order, as `TextChunk`s of whole records.

    A chunk starts at the first header at or after each multiple of `chunk_bytes` of the text (byte offsets
    of the decompressed file), so where the chunks fall depends on the file and `chunk_bytes` alone. The
    file-level checks and errors are those of `iter_fasta_tables` (byte-order marks, line endings, text
    before the first header, no records, a damaged gzip stream: raised after the chunks before it).
    """
    global PARSE_CALLS
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    PARSE_CALLS += 1
    yield from _record_chunks(Path(path), chunk_bytes)


def _first_header(path: Path, data: bytes, lineno: int) -> int:
    """Index of the first header in `data` (text from the file's start), -1 if none yet; only blank
    lines may come before it."""
    if data[:1] == b">":
        return 0
    cut = data.find(b"\n>")
    prefix = data if cut < 0 else data[:cut + 1]
    for k, line in enumerate(prefix.split(b"\n")):
        if line.strip():
            raise FastaFormatError(f"{path}:{lineno + k}: sequence line before the first header '>'")
    return cut if cut < 0 else cut + 1


def _last_header(chunk: bytes) -> bytes | None:
    """The last header line of a piece of whole records (Unix line endings), without its '>'."""
    if not chunk:
        return None
    start = chunk.rfind(b"\n>") + 1
    return chunk[start + 1:chunk.find(b"\n", start)]


def _cuts(data: bytes, offset: int, chunk_bytes: int | None) -> list[int]:
    """Where to cut `data` (text at `offset`, from a header on) into chunks: each cut is the '\\n' before a
    header; the rest after the last cut waits for more text."""
    if chunk_bytes is None:  # every whole record read so far
        cut = data.rfind(b"\n>")
        return [cut] if cut >= 0 else []
    cuts: list[int] = []
    base = 0
    while True:  # the first header at or after the next multiple of chunk_bytes
        nominal = ((offset + base) // chunk_bytes + 1) * chunk_bytes - offset
        cut = data.find(b"\n>", nominal - 1) if nominal <= len(data) else -1
        if cut < 0:
            return cuts
        cuts.append(cut)
        base = cut + 1


def _record_chunks(path: Path, chunk_bytes: int | None) -> Iterator[TextChunk]:
    """`iter_record_chunks`; `chunk_bytes` None: each read's whole records (about `_READ_SIZE`)."""
    read_size = _READ_SIZE if chunk_bytes is None else max(_READ_SIZE, min(chunk_bytes, 64 * _READ_SIZE))
    lineno = 1  # line number of the first line of `pending`
    offset = 0  # offset of `pending` in the text
    pending = b""
    started = False
    first_block, cr_only = True, False
    delivered = 0  # decompressed bytes read so far
    records = 0  # headers in the chunks yielded (for the damaged-gzip error)
    last: bytes = b""  # the last chunk yielded
    with open_fasta(path) as f:
        while True:
            error = None
            try:
                block = f.read(read_size)
                delivered += len(block)
            except _GZIP_ERRORS as e:
                # the failed read dropped what it had decompressed: recover it, and read the whole
                # records before the damage below
                error, block = e, _decompressible_tail(path, delivered)
            if first_block:
                first_block = False
                raw = len(block)
                block, cr_only = _first_block(path, block)
                offset = raw - len(block)  # a byte-order mark
            if cr_only:
                block = block.replace(b"\r", b"\n")
            end = error is not None or not block
            data = pending + block if pending else block
            if not started:  # blank lines may precede the first header; anything else is an error
                first = _first_header(path, data, lineno)
                if first < 0:
                    pending = data
                    if not end:
                        continue
                    if error is None:
                        raise _no_records(path, data)
                else:
                    lineno += data.count(b"\n", 0, first)
                    offset += first
                    data, started = data[first:], True
            if error is not None:
                cut = data.rfind(b"\n>") if started else -1
                pending = data[cut + 1:] if cut >= 0 else data
                if cut >= 0:  # the records before the damaged one are whole: yield them
                    last = _unix(data[:cut + 1])
                    yield TextChunk(last, lineno, offset)
                    records += 1 + last.count(b"\n>")
                    lineno += last.count(b"\n")
                raise _truncated(path, error, pending, lineno, records, _last_header(last)) from error
            if not block:
                if data:
                    yield TextChunk(_unix(data if data.endswith(b"\n") else data + b"\n"), lineno, offset)
                return
            cuts = _cuts(data, offset, chunk_bytes)
            if not cuts:
                pending = data
                continue
            begin = 0
            for cut in cuts:
                piece = data[begin:cut + 1]
                last = _unix(piece)
                yield TextChunk(last, lineno, offset + begin)
                records += 1 + last.count(b"\n>")
                lineno += piece.count(b"\n")
                begin = cut + 1
            pending, offset = data[begin:], offset + begin


def plan_chunks(path: str | Path, chunk_bytes: int) -> list[ChunkSpan]:
    """The chunks of an uncompressed FASTA file that `iter_record_chunks` gives, as byte ranges, found
    with a seek and a short read per chunk (not a pass over the file); raises the same file-level errors."""
    global PARSE_CALLS
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    if is_compressed(path):
        raise ValueError(f"{path}: a compressed file has no byte ranges to plan: read it with iter_record_chunks")
    PARSE_CALLS += 1
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(_READ_SIZE)
        data, cr_only = _first_block(path, head)
        bom = len(head) - len(data)
        if cr_only:
            data = data.replace(b"\r", b"\n")
        while (first := _first_header(path, data, 1)) < 0:  # a long run of blank lines: read on
            more = f.read(_READ_SIZE)
            if not more:
                raise _no_records(path, data)
            data += more.replace(b"\r", b"\n") if cr_only else more
        starts = [bom + first]
        first_line = 1 + data.count(b"\n", 0, first)
        separator = b"\r>" if cr_only else b"\n>"
        while (nominal := (starts[-1] // chunk_bytes + 1) * chunk_bytes) < size:
            header = _next_header(f, nominal, separator)
            if header >= size:
                break
            starts.append(header)
    ends = starts[1:] + [size]
    return [ChunkSpan(a, b, first_line if k == 0 else 0, cr_only) for k, (a, b) in enumerate(zip(starts, ends))]


def _next_header(f: BinaryIO, position: int, separator: bytes) -> int:
    """Offset of the first header at or after `position` (a line-start '>'), or past the end of the file."""
    f.seek(position - 1)
    base, tail = position - 1, b""
    while piece := f.read(1 << 16):
        data = tail + piece
        hit = data.find(separator)
        if hit >= 0:
            return base + hit + 1
        base += len(data) - 1
        tail = data[-1:]
    return 1 << 62


def _read_blocks(read: Callable[[int], bytes], cr_only: bool) -> Iterator[tuple[bytes, int]]:
    """Blocks of whole records (Unix line endings) of a source that starts at a header, each with the
    number of lines before it in the source."""
    pending, lines = b"", 0
    while True:
        block = read(_READ_SIZE)
        if cr_only:
            block = block.replace(b"\r", b"\n")
        data = pending + block if pending else block
        if not block:
            if data:
                yield _unix(data if data.endswith(b"\n") else data + b"\n"), lines
            return
        cut = data.rfind(b"\n>")
        if cut < 0:
            pending = data
            continue
        piece, pending = data[:cut + 1], data[cut + 1:]
        yield _unix(piece), lines
        lines += piece.count(b"\n")


def _chunk_tables(reader: _Reader, chunk: ChunkSpan | TextChunk, first_line: int) -> Iterator[pa.Table]:
    if isinstance(chunk, TextChunk):
        blocks = _read_blocks(io.BytesIO(chunk.data).read, False)
        yield from _parsed(reader, blocks, first_line)
        return
    with open(reader.path, "rb") as f:
        f.seek(chunk.start)
        left = chunk.end - chunk.start

        def read(n: int) -> bytes:
            nonlocal left
            piece = f.read(min(n, left))
            left -= len(piece)
            return piece

        yield from _parsed(reader, _read_blocks(read, chunk.cr_only), first_line)


def _parsed(reader: _Reader, blocks: Iterator[tuple[bytes, int]], first_line: int) -> Iterator[pa.Table]:
    for block, lines in blocks:
        table = reader.block(block, first_line + lines)
        if table is not None:
            yield table


def _lines_before(path: Path, offset: int, cr_only: bool) -> int:
    """Lines that end before byte `offset` of an uncompressed file (read on an error path only)."""
    end = b"\r" if cr_only else b"\n"
    count, left = 0, offset
    with open(path, "rb") as f:
        while left and (piece := f.read(min(left, 16 << 20))):
            count += piece.count(end)
            left -= len(piece)
    return count


def iter_chunk_tables(path: str | Path, chunk: ChunkSpan | TextChunk, *, min_length: int = 0, max_length: int = 0,
                      nonstandard: str = "keep", val_fraction: float = 0.0, salt: str = "",
                      stats: FastaStats | None = None) -> Iterator[pa.Table]:
    """The records of one chunk of a FASTA file as Arrow tables: a `ChunkSpan` of `plan_chunks` (read
    from `path` here) or a `TextChunk` of `iter_record_chunks` (its text).

    The tables, counts (`stats.files` excepted: a chunk does not count its file) and errors are those
    `iter_fasta_tables` gives for the same records. An error in a span whose first line is not known
    names the line all the same: the lines before the span are counted, on that path only.
    """
    _check_settings(nonstandard, val_fraction)
    path = Path(path)
    stats = stats if stats is not None else FastaStats()
    reader = _Reader(path, min_length, max_length, nonstandard, val_fraction, salt, stats, 0, 1)
    if chunk.first_line:
        yield from _chunk_tables(reader, chunk, chunk.first_line)
        return
    try:
        yield from _chunk_tables(reader, chunk, 1)
        return
    except FastaFormatError:
        pass
    assert isinstance(chunk, ChunkSpan)
    first_line = _lines_before(path, chunk.start, chunk.cr_only) + 1
    # the same parse again, numbered from the right line, to the same error
    again = _Reader(path, min_length, max_length, nonstandard, val_fraction, salt, FastaStats(), 0, 1)
    for _ in _chunk_tables(again, chunk, first_line):
        pass
    raise AssertionError(f"{path}: a chunk's error did not recur")  # the parse is deterministic


def _decompressible_tail(path: Path, skip: int) -> bytes:
    """What a damaged gzip file decompresses to after its first `skip` bytes, up to the damage.

    A second pass, on the error path only: the fast readers drop the whole output of the read that
    fails, while a streaming decompressor returns every byte it could decode (of a truncated file:
    all of them; of a corrupt one: all but the last 64 KiB of input's worth).
    """
    out: list[bytes] = []
    seen = 0
    decompressor = isal_zlib.decompressobj(wbits=31)  # a gzip member
    with open(path, "rb") as raw:
        while chunk := raw.read(1 << 16):
            pieces = []
            try:
                pieces.append(decompressor.decompress(chunk))
                while decompressor.eof and decompressor.unused_data:  # the next member of a multi-member file
                    rest, decompressor = decompressor.unused_data, isal_zlib.decompressobj(wbits=31)
                    pieces.append(decompressor.decompress(rest))
            except _GZIP_ERRORS:
                break
            finally:
                for piece in pieces:
                    if seen + len(piece) > skip:
                        out.append(piece[max(0, skip - seen):])
                    seen += len(piece)
    return b"".join(out)


def _first_block(path: Path, block: bytes) -> tuple[bytes, bool]:
    """The first block without a UTF-8 byte-order mark, and whether lines end with a lone `\\r`."""
    if block.startswith(_UTF16_BOMS):
        raise FastaFormatError(f"{path}:1: the file is UTF-16 encoded (byte-order mark {block[:2]!r}); FASTA "
                               f"is read as ASCII: convert it first, e.g. `iconv -f UTF-16 -t ASCII`")
    # Classic Mac files end lines with '\r' alone: no '\n' in the file's first `_READ_SIZE` bytes means that. The
    # same window in every path (the stream, `plan_chunks`, the chunked gzip read of bigger blocks): they agree.
    probe = block[:_READ_SIZE]
    if block.startswith(_UTF8_BOM):
        block = block[len(_UTF8_BOM):]
    return block, b"\r" in probe and b"\n" not in probe


def _no_records(path: Path, data: bytes) -> FastaFormatError:
    """The error for a file without a single header: empty, or blank lines only."""
    if not data:
        what = "it is empty after gzip decompression" if _is_gzip(path) else "the file is empty"
        return FastaFormatError(f"{path}: no FASTA records: {what}")
    lines = data.count(b"\n") + (not data.endswith(b"\n"))
    return FastaFormatError(f"{path}:{lines}: no FASTA records: the file holds only {lines} blank line(s)")


def _truncated(path: Path, error: BaseException, pending: bytes, lineno: int, records: int,
               last_header: bytes | None) -> FastaFormatError:
    """The error for a damaged gzip stream, saying what was read before the damage (`records` whole records,
    the last of them headed `last_header`)."""
    good = lineno - 1 + pending.count(b"\n")  # whole lines decompressed
    header = last_header
    if pending[:1] == b">" and b"\n" in pending:  # the damaged record's header line is whole
        header = pending[1:].split(b"\n", 1)[0]
    record = parse_header(header.decode("utf-8", "replace"))["id"] if header is not None else None
    if not good:
        return FastaFormatError(f"{path}: truncated or corrupt gzip stream (not one whole line could be "
                                f"decompressed): {error}")
    return FastaFormatError(f"{path}: truncated or corrupt gzip stream after line {good} (last good line {good}, "
                            f"in record {record!r}); the {records} whole records before the damage "
                            f"were read: {error}")


def _unix(data: bytes) -> bytes:
    """Windows line endings as Unix ones (line numbers are unchanged)."""
    return data.replace(b"\r\n", b"\n") if b"\r" in data else data


def iter_fasta(path: str | Path, *, min_length: int = 0, max_length: int = 0, nonstandard: str = "keep",
               val_fraction: float = 0.0, salt: str = "", stats: FastaStats | None = None,
               shard: tuple[int, int] = (0, 1)) -> Iterator[dict[str, Any]]:
    """Records of one FASTA file as dicts in `FASTA_COLUMNS` order (see `iter_fasta_tables`)."""
    for table in iter_fasta_tables(path, min_length=min_length, max_length=max_length, nonstandard=nonstandard,
                                   val_fraction=val_fraction, salt=salt, stats=stats, shard=shard):
        yield from table.to_pylist()
