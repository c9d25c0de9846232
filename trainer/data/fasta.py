"""FASTA reader for protein sequences (`.fasta/.fa/.faa`, optionally `.gz`), as released by UniProt.

`iter_fasta` yields one dict per record with a fixed column schema (`FASTA_COLUMNS`; missing string
fields are None, missing integer fields -1) so that Arrow types are stable across files and header
styles. Header styles:

* UniRef (`>UniRef50_A0A5A9P0L4 Peptidylprolyl isomerase n=1 Tax=Triplophysa tibetana
  TaxID=1572043 RepID=A0A5A9P0L4_9TELE`): id = `UniRef50_A0A5A9P0L4`, db = `UniRef50`,
  description = cluster name, n, tax, taxid, rep_id.
* UniProtKB (`>sp|P12345|NAME_HUMAN Desc OS=Homo sapiens OX=9606 GN=ABC PE=1 SV=2`): db = sp/tr,
  accession (also the id), entry_name, description, os, ox, gn, pe, sv.
* anything else: id = first word, description = the rest.

`KEY=value` tags the style does not know (e.g. `Split=0`) are kept verbatim in `extra`.

Residue policy (every change or skip is counted in `FastaStats`, nothing is dropped silently):

* trailing whitespace and `\\r` (Windows line endings) are stripped from every line; blank lines
  are ignored;
* lowercase residues are upper-cased (`stats.lowercase` records);
* one terminal `*` (stop) is removed (`stats.terminal_stop`); an internal `*` is an error;
* gap characters `-` and `.` are removed (`stats.gaps` records);
* any other character that is not a letter A-Z is an error;
* the non-standard residues B, Z, J, U, O, X (`stats.nonstandard` records contain one) follow
  `nonstandard`: "keep" keeps them, except J which becomes X because the tokenizer has no J
  (`stats.j_to_x`); "map" maps B/Z/J/U/O to X (`stats.nonstandard_mapped`); "drop" skips the record
  (`stats.dropped_nonstandard`);
* `min_length` / `max_length` (0 = no limit) apply to the cleaned sequence and skip records
  (`stats.dropped_short`, `stats.dropped_long`).

Errors (`FastaFormatError`, naming the file, line and record): a sequence line before the first
header, a record with an empty sequence, an illegal character, a truncated or corrupt gzip stream.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator

NONSTANDARD_POLICIES = ("keep", "map", "drop")
CANONICAL = b"ACDEFGHIKLMNPQRSTVWY"
NONSTANDARD = b"BZJUOX"
_LETTERS = bytes(range(ord("A"), ord("Z") + 1))
_LOWER = bytes(range(ord("a"), ord("z") + 1))
_GAPS = b"-."
_J_TO_X = bytes.maketrans(b"J", b"X")
_MAP_TO_X = bytes.maketrans(b"BZJUO", b"XXXXX")
_READ_SIZE = 1 << 20

STRING_COLUMNS = ("id", "description", "db", "accession", "entry_name", "tax", "rep_id", "os", "gn",
                  "extra")
INT_COLUMNS = ("n", "taxid", "ox", "pe", "sv")
FASTA_COLUMNS = ("id", "sequence", "length", "split") + STRING_COLUMNS[1:] + INT_COLUMNS
"""Column order of every record; `split` is "train" or "validation" (see `split_of`)."""

PARSE_CALLS = 0
"""Number of times a FASTA file was opened for parsing (tests use it to prove cache hits)."""


class FastaFormatError(ValueError):
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

    def __iadd__(self, other: FastaStats) -> FastaStats:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, int]) -> FastaStats:
        return cls(**{k: int(v) for k, v in d.items() if k in {f.name for f in dataclasses.fields(cls)}})

    def summary(self) -> str:
        """One line listing the non-zero counters, for logs."""
        return ", ".join(f"{k}={v}" for k, v in self.to_dict().items() if v)


def split_of(record_id: str, val_fraction: float, salt: str = "") -> str:
    """"train" or "validation" from a keyed hash of the id alone.

    blake2b (not `hash`, which is salted per process) makes the split the same in every run,
    process, rank and file order.
    """
    if val_fraction <= 0.0:
        return "train"
    digest = hashlib.blake2b(record_id.encode("utf-8"), digest_size=8, key=salt.encode("utf-8")[:64]).digest()
    return "validation" if int.from_bytes(digest, "big") < val_fraction * 2.0**64 else "train"


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
    first, _, rest = header.strip().partition(" ")
    rest = rest.strip()
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
                fields[column] = int(value)
            except ValueError:
                extra.append(f"{key}={value}")
        else:
            fields[column] = value or None
    fields["extra"] = " ".join(extra) or None
    return fields


def open_fasta(path: str | Path) -> BinaryIO:
    """Binary handle on a FASTA file, decompressing `.gz` (detected by magic bytes, not name)."""
    path = Path(path)
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def _iter_lines(f: BinaryIO) -> Iterator[bytes]:
    """Lines without their terminator, from large reads (faster than readline on gzip)."""
    rest = b""
    while True:
        block = f.read(_READ_SIZE)
        if not block:
            break
        lines = (rest + block).split(b"\n")
        rest = lines.pop()
        yield from lines
    if rest:
        yield rest


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


def iter_fasta(path: str | Path, *, min_length: int = 0, max_length: int = 0, nonstandard: str = "keep",
               val_fraction: float = 0.0, salt: str = "", stats: FastaStats | None = None,
               shard: tuple[int, int] = (0, 1)) -> Iterator[dict[str, Any]]:
    """Records of one FASTA file in `FASTA_COLUMNS` order; policy skips are counted into `stats`.

    `shard=(index, count)` keeps only records whose ordinal (counting every header, kept or not)
    is `index` modulo `count`; records of other shards are neither decoded nor validated, and are
    not counted in `stats`.
    """
    global PARSE_CALLS
    if nonstandard not in NONSTANDARD_POLICIES:
        raise ValueError(f"nonstandard must be one of {NONSTANDARD_POLICIES}, got {nonstandard!r}")
    shard_index, shard_count = shard
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"bad shard {shard}")
    path = Path(path)
    stats = stats if stats is not None else FastaStats()
    PARSE_CALLS += 1
    stats.files += 1

    header: bytes | None = None
    header_line = 0
    lines: list[bytes] = []
    ordinal = -1
    lineno = 0

    def finish() -> dict[str, Any] | None:
        if ordinal % shard_count != shard_index:
            return None
        assert header is not None
        fields = parse_header(header.decode("utf-8", errors="replace"))
        record_id = fields["id"]
        if not record_id:
            raise FastaFormatError(f"{path}:{header_line}: header without an id")
        stats.records += 1
        seq = b"".join(lines)
        if not seq:
            raise FastaFormatError(f"{path}:{header_line}: record {record_id!r}: empty sequence")
        seq = _clean(seq, path, lines, header_line + 1, record_id, nonstandard, stats)
        if seq is None:
            return None
        if min_length and len(seq) < min_length:
            stats.dropped_short += 1
            return None
        if max_length and len(seq) > max_length:
            stats.dropped_long += 1
            return None
        split = split_of(record_id, val_fraction, salt)
        stats.kept += 1
        stats.residues += len(seq)
        if split == "validation":
            stats.validation += 1
        else:
            stats.train += 1
        record = {"id": record_id, "sequence": seq.decode("ascii"), "length": len(seq), "split": split}
        for k in FASTA_COLUMNS[4:]:
            record[k] = fields[k]
        return record

    try:
        with open_fasta(path) as f:
            for line in _iter_lines(f):
                lineno += 1
                line = line.rstrip()
                if not line:
                    continue
                if line[:1] == b">":
                    if header is not None:
                        rec = finish()
                        if rec is not None:
                            yield rec
                    header, header_line, lines = line[1:], lineno, []
                    ordinal += 1
                elif header is None:
                    raise FastaFormatError(f"{path}:{lineno}: sequence line before the first header '>'")
                elif ordinal % shard_count == shard_index:
                    lines.append(line)
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        last = header.decode("utf-8", "replace").split(" ", 1)[0] if header is not None else None
        raise FastaFormatError(f"{path}: truncated or corrupt gzip stream after line {lineno} "
                               f"(last good line {lineno}, in record {last!r}): {e}") from e
    if header is not None:
        rec = finish()
        if rec is not None:
            yield rec
