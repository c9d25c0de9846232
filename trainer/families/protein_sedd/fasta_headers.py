"""Vectorised FASTA header parsing: `fasta.parse_header`'s columns for a whole block of headers.

UniProt's own headers have a fixed shape: `sp|ACC|NAME desc OS=.. OX=.. GN=.. PE=.. SV=..` (UniProtKB)
or `UniRef50_ID name n=.. Tax=.. TaxID=.. RepID=..` (UniRef), sometimes followed by extra tags
(`Split=0`), or `id free text` for anything else. For headers of that shape every column is a byte
range of the block, found with numpy over the whole block at once: positions of spaces, pipes,
underscores and '=' signs, tag keys packed into integers and compared, values cut between tags.
A header is parsed here only when the result provably equals `parse_header`'s:

* printable ASCII, no leading space, no double space (so ' ' is the only whitespace and every
  `\\s+` of `parse_header` is one space); a tab that ends the id (`>seq1<TAB>text`, as many tools
  write) is read as the space it stands for, since `parse_header` ends the id at any whitespace;
* every '=' ends a valid `KEY` that follows a space after the id (so `parse_header` sees exactly
  these tags), the first tag is a known one, known tags appear once and in UniProt's order, and
  unknown tags only come after them with values free of spaces (they become `extra` verbatim);
* integer tags are 1 to 18 digits.

Every other header is marked for `parse_header` itself (the caller does that), so the output equals
the reference parser's on every input; the tests compare both on random and real headers.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

_TAB, _SP, _PIPE, _UNDERSCORE, _EQ = 9, 32, 124, 95, 61
_MAX_KEY = 8  # longer keys cannot be known tags; they are parsed as unknown ones if valid
_INT_DIGITS = 18


def _pack(key: str) -> int:
    """Key bytes packed little-endian into a uint64 (zero padded), for one comparison per tag."""
    return int.from_bytes(key.encode("ascii").ljust(_MAX_KEY, b"\0"), "little")


# (key, column) per header style, in UniProt's order.
UNIPROT_TAGS = (("OS", "os"), ("OX", "ox"), ("GN", "gn"), ("PE", "pe"), ("SV", "sv"))
UNIREF_TAGS = (("n", "n"), ("Tax", "tax"), ("TaxID", "taxid"), ("RepID", "rep_id"))
_IDENT = np.zeros(256, dtype=bool)
_IDENT[np.frombuffer(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_", dtype=np.uint8)] = True
_LETTER = np.zeros(256, dtype=bool)
_LETTER[np.frombuffer(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz", dtype=np.uint8)] = True
_POW10 = 10 ** np.arange(_INT_DIGITS, dtype=np.int64)


def _first_at_or_after(positions: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per row, the first of the sorted `positions` in [starts, ends), or ends where there is none."""
    k = np.searchsorted(positions, starts)
    found = positions[np.minimum(k, len(positions) - 1)] if len(positions) else ends
    return np.where((k < len(positions)) & (found < ends), found, ends)


def _count_in(positions: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per row, how many of the sorted `positions` lie in [starts, ends)."""
    return np.searchsorted(positions, ends) - np.searchsorted(positions, starts)


def _starts_with(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, prefix: bytes) -> np.ndarray:
    """Per row, whether buf[starts:ends] begins with `prefix`."""
    width = len(prefix)
    head = buf[np.minimum(starts[:, None] + np.arange(width), len(buf) - 1)]
    return (ends - starts >= width) & (head == np.frombuffer(prefix, dtype=np.uint8)).all(axis=1)


def gather_ranges(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(buf[starts[i] : starts[i] + lengths[i]] concatenated, int64 offsets of each range in it)."""
    offsets = np.zeros(len(starts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    index = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1])
    return buf[index], offsets


def strings(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, valid: np.ndarray) -> pa.Array:
    """Arrow strings buf[starts:ends] per row, null where not `valid` (or the range is empty)."""
    valid = valid & (ends > starts)
    lengths = np.where(valid, ends - starts, 0)
    values, offsets = gather_ranges(buf, starts, lengths)
    bitmap = pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.StringArray.from_buffers(len(starts), pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(values),
                                       bitmap, null_count=int(len(valid) - np.count_nonzero(valid)))


def _integers(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray,
              present: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int64 value of the digits buf[starts:ends], -1 where not present; rows not of 1 to 18 digits)."""
    lengths = np.where(present, ends - starts, 0)
    bad = present & ((lengths < 1) | (lengths > _INT_DIGITS))
    lengths = np.where(bad, 0, lengths)
    digits, offsets = gather_ranges(buf, starts, lengths)
    d = digits.astype(np.int64) - 48
    row = np.repeat(np.arange(len(starts)), lengths)
    not_digit = (d < 0) | (d > 9)
    if not_digit.any():
        bad[np.unique(row[not_digit])] = True
    place = (offsets[1:][row] - 1) - np.arange(len(d))
    values = np.zeros(len(starts), dtype=np.int64)
    np.add.at(values, row, np.clip(d, 0, 9) * _POW10[place])
    return np.where(present & ~bad, values, -1), bad


def parse_header_block(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                       string_columns: tuple[str, ...], int_columns: tuple[str, ...]
                       ) -> tuple[dict[str, pa.Array], np.ndarray]:
    """Columns of the headers buf[starts[i]:ends[i]] (without '>' and line end), and the rows to redo.

    Returns ({column: Arrow array}, slow) where `slow` marks rows whose values here are not to be
    used: the caller parses those with `parse_header`.
    """
    n = len(starts)
    # Work on the headers alone (each followed by its newline): every scan below is over these bytes.
    buf, offsets = gather_ranges(buf, starts, ends - starts + 1)
    starts, ends = offsets[:-1], offsets[1:] - 1
    tabs = np.flatnonzero(buf == _TAB)
    if len(tabs):  # a tab before any space ends the id exactly as a space would (other tabs: slow rows)
        first_tab = _first_at_or_after(tabs, starts, ends)
        ends_id = (first_tab < ends) & (first_tab < _first_at_or_after(np.flatnonzero(buf == _SP), starts, ends))
        buf[first_tab[ends_id]] = _SP
    for _ in range(4):  # trailing spaces (UniProt's files often end headers with one)
        trailing = (ends > starts) & (buf[np.maximum(ends - 1, 0)] == _SP)
        if not trailing.any():
            break
        ends -= trailing
    slow = (ends <= starts) | (buf[np.minimum(starts, len(buf) - 1)] == _SP)
    slow |= (ends > starts) & (buf[np.maximum(ends - 1, 0)] == _SP)

    in_header = np.zeros(len(buf) + 1, dtype=np.int8)
    in_header[starts] += 1
    in_header[ends] -= 1
    in_header = np.cumsum(in_header[:-1], dtype=np.int8).astype(bool)

    def rows_of(positions: np.ndarray) -> np.ndarray:
        return np.searchsorted(starts, positions, side="right") - 1

    odd = np.flatnonzero(in_header & ((buf < 32) | (buf > 126)))
    slow[rows_of(odd)] = True
    spaces = np.flatnonzero(buf == _SP)
    doubled = spaces[:-1][np.diff(spaces) == 1]
    slow[rows_of(doubled[in_header[doubled]])] = True

    token_end = _first_at_or_after(spaces, starts, ends)
    rest_start = np.minimum(token_end + 1, ends)
    pipes = np.flatnonzero(buf == _PIPE)
    n_pipes = _count_in(pipes, starts, token_end)
    # the id's style, by parse_header's rules: "UniRef..._..." first, then "sp|ACC|NAME" / "tr|ACC|NAME"
    underscores = np.flatnonzero(buf == _UNDERSCORE)
    first_us = _first_at_or_after(underscores, starts, token_end)
    uniref = _starts_with(buf, starts, token_end, b"UniRef") & (first_us < token_end)
    uniprot = (n_pipes == 2) & (_starts_with(buf, starts, token_end, b"sp|")
                                | _starts_with(buf, starts, token_end, b"tr|"))
    tagged = uniprot | uniref

    cols: dict[str, pa.Array] = {}
    every = np.ones(n, dtype=bool)
    # id, db, accession, entry_name
    pipe1 = _first_at_or_after(pipes, starts, token_end)
    pipe2 = _first_at_or_after(pipes, pipe1 + 1, token_end)
    slow |= uniprot & (pipe2 - pipe1 <= 1)  # empty accession: parse_header reports the missing id
    id_start = np.where(uniprot, pipe1 + 1, starts)
    id_end = np.where(uniprot, pipe2, token_end)
    cols["id"] = strings(buf, id_start, id_end, every)
    cols["db"] = strings(buf, starts, np.where(uniprot, pipe1, first_us), tagged)
    cols["accession"] = strings(buf, pipe1 + 1, pipe2, uniprot)
    cols["entry_name"] = strings(buf, pipe2 + 1, token_end, uniprot)

    # Tags: every '=' in the rest of a tagged header, its key the word before it.
    eqs = np.flatnonzero(buf == _EQ)
    eqs = eqs[in_header[eqs]]
    eq_row = rows_of(eqs)
    keep = tagged[eq_row]
    eqs, eq_row = eqs[keep], eq_row[keep]
    before = np.searchsorted(spaces, eqs) - 1
    key_start = np.where(before >= 0, spaces[np.maximum(before, 0)] + 1, 0)
    # a key must follow a space after the id (else '=' is inside the id or a word of the text)
    bad_eq = (before < 0) | (key_start < rest_start[eq_row]) | (key_start >= eqs)
    key_len = eqs - key_start
    # keys: identifier characters, a letter first; packed for comparison when short enough
    key_bytes, key_off = gather_ranges(buf, key_start, np.maximum(key_len, 0) * ~bad_eq)
    not_ident = ~_IDENT[key_bytes]
    if not_ident.any():
        bad_eq[np.unique(np.repeat(np.arange(len(eqs)), np.diff(key_off))[not_ident])] = True
    bad_eq |= ~_LETTER[buf[np.minimum(key_start, len(buf) - 1)]]
    short = key_len <= _MAX_KEY
    packed = np.zeros(len(eqs), dtype=np.uint64)
    for j in range(_MAX_KEY):
        byte = buf[np.minimum(key_start + j, len(buf) - 1)].astype(np.uint64)
        packed |= np.where(short & (j < key_len), byte, 0).astype(np.uint64) << np.uint64(8 * j)
    slow[eq_row[bad_eq]] = True

    # canonical order of each tag (0.. for known ones, big for unknown), per style
    order = np.full(len(eqs), 99, dtype=np.int64)
    for style, tags in ((uniprot, UNIPROT_TAGS), (uniref, UNIREF_TAGS)):
        in_style = style[eq_row]
        for k, (key, _) in enumerate(tags):
            order[in_style & (packed == np.uint64(_pack(key)))] = k
    # rules on the sequence of tags of a row
    same_row_next = np.zeros(len(eqs), dtype=bool)
    same_row_next[:-1] = eq_row[1:] == eq_row[:-1]
    first_of_row = np.ones(len(eqs), dtype=bool)
    first_of_row[1:] = eq_row[1:] != eq_row[:-1]
    slow[eq_row[first_of_row & (order == 99)]] = True  # description would hold the unknown tag
    nxt = np.minimum(np.arange(len(eqs)) + 1, max(len(eqs) - 1, 0))
    slow[eq_row[same_row_next & (order >= order[nxt]) & ~((order == 99) & (order[nxt] == 99))]] = True
    # value of each tag: from after '=' to the space before the next tag (or the end)
    value_start = eqs + 1
    value_end = np.where(same_row_next, key_start[nxt] - 1, ends[eq_row])
    unknown = order == 99
    spaced = _count_in(spaces, value_start, value_end) > 0
    slow[eq_row[unknown & spaced]] = True  # `extra` keeps unknown tags verbatim: only single words
    value_start = np.where((value_start < value_end) & (buf[np.minimum(value_start, len(buf) - 1)] == _SP),
                           value_start + 1, value_start)
    value_start = np.minimum(value_start, value_end)

    first_tag = np.full(n, -1, dtype=np.int64)
    first_tag[eq_row[first_of_row]] = np.flatnonzero(first_of_row)
    has_tag = first_tag >= 0
    padded_key_start = np.append(key_start, 0)  # index -1 (no such tag) reads the pad
    desc_end = np.where(has_tag, padded_key_start[first_tag] - 1, ends)
    cols["description"] = strings(buf, rest_start, desc_end, every)
    first_unknown = np.full(n, -1, dtype=np.int64)
    unk_idx = np.flatnonzero(unknown)
    if len(unk_idx):
        rows_unk = eq_row[unk_idx]
        firsts = np.ones(len(unk_idx), dtype=bool)
        firsts[1:] = rows_unk[1:] != rows_unk[:-1]
        first_unknown[rows_unk[firsts]] = unk_idx[firsts]
    has_extra = first_unknown >= 0
    cols["extra"] = strings(buf, padded_key_start[first_unknown], ends, has_extra)

    for style, tags in ((uniprot, UNIPROT_TAGS), (uniref, UNIREF_TAGS)):
        for k, (_, column) in enumerate(tags):
            hit = np.flatnonzero((order == k) & style[eq_row])
            present = np.zeros(n, dtype=bool)
            present[eq_row[hit]] = True
            vs = np.zeros(n, dtype=np.int64)
            ve = np.zeros(n, dtype=np.int64)
            vs[eq_row[hit]], ve[eq_row[hit]] = value_start[hit], value_end[hit]
            if column in int_columns:
                values, bad = _integers(buf, vs, ve, present)
                slow |= bad
                cols[column] = pa.array(values, pa.int64())
            else:
                cols[column] = strings(buf, vs, ve, present)
    for column in string_columns:
        cols.setdefault(column, pa.nulls(n, pa.string()))
    for column in int_columns:
        cols.setdefault(column, pa.array(np.full(n, -1, dtype=np.int64)))
    return cols, slow
