"""Gene -> GO terms mappings: GEARS' `gene2go` pickle, a plain TSV, or a GAF 2.x annotation file.

GEARS downloads `gene2go_all.pkl` from Harvard Dataverse, which may refuse it (snap-stanford/GEARS#101);
here the user gives the file. Formats (`read_gene2go(path, fmt="auto")`):

- `pickle` (`.pkl`, `.pickle`): GEARS' own file, a dict gene -> set/list of GO ids. Pickle can run
  code when loaded: only pass your own, trusted file (GEARS' format is pickle by definition).
- `tsv` (`.tsv`, `.txt`, also gzipped): `gene<TAB>GO:0000001` one pair a line, or
  `gene<TAB>GO:1;GO:2`; blank lines and `#` comments are skipped.
- `gaf` (`.gaf`, also gzipped, or a file starting with `!gaf-version`): GO annotation format 2.x;
  column 3 is the gene symbol, column 5 the GO id, `!` lines are comments; annotations whose
  qualifier (column 4) contains `NOT` are skipped and counted.
"""

from __future__ import annotations

import gzip
import logging
import pickle
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np

from trainer.errors import DataError

logger = logging.getLogger(__name__)

GeneToGo = dict[str, frozenset[str]]


def _open_text(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _detect_format(path: Path) -> str:
    name = path.name.lower().removesuffix(".gz")
    if name.endswith((".pkl", ".pickle")):
        return "pickle"
    if name.endswith(".gaf"):
        return "gaf"
    try:
        with _open_text(path) as f:
            first = f.readline()
    except UnicodeDecodeError:
        return "pickle"
    return "gaf" if first.startswith("!gaf-version") else "tsv"


def read_gene2go(path: str | Path, fmt: str = "auto") -> GeneToGo:
    """A gene -> frozenset of GO ids mapping read from `path` (`fmt`: auto, pickle, tsv or gaf).

    Errors name the file and line. Pickle only for your own trusted file (see the module docstring).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: gene2go file not found")
    fmt = _detect_format(path) if fmt == "auto" else fmt
    if fmt == "pickle":
        return _read_pickle(path)
    if fmt == "tsv":
        return _read_tsv(path)
    if fmt == "gaf":
        return _read_gaf(path)
    raise DataError(f"{path}: unknown gene2go format {fmt!r} (auto, pickle, tsv or gaf)")


def gene2go_from_mapping(mapping: Mapping[str, Iterable[str]], where: str = "gene2go") -> GeneToGo:
    """Validate an in-memory gene -> GO ids mapping (GEARS' pickle holds one) and freeze it."""
    if not isinstance(mapping, Mapping):
        raise DataError(f"{where}: expected a dict gene -> set of GO ids, got {type(mapping).__name__}")
    out: GeneToGo = {}
    for gene, terms in mapping.items():
        if not isinstance(gene, str) or not gene:
            raise DataError(f"{where}: gene key {gene!r} is not a non-empty string")
        if isinstance(terms, (str, bytes)) or not isinstance(terms, Iterable):
            raise DataError(f"{where}: gene {gene!r}: expected a set/list of GO ids, got {type(terms).__name__}")
        terms = frozenset(terms)
        bad = [t for t in terms if not isinstance(t, str) or not t]
        if bad:
            raise DataError(f"{where}: gene {gene!r}: GO id {bad[0]!r} is not a non-empty string")
        out[gene] = terms
    return out


def _read_pickle(path: Path) -> GeneToGo:
    with open(path, "rb") as f:
        try:
            obj = pickle.load(f)  # the user's own file in GEARS' pickle format (see module docstring)
        except Exception as e:  # a truncated or foreign pickle raises many different types
            raise DataError(f"{path}: not a readable gene2go pickle ({type(e).__name__}: {e})") from e
    return gene2go_from_mapping(obj, where=str(path))


def _tab_rows(path: Path, comment: str):
    """(line number, tab-separated columns) of each line of a text table, skipping blanks and comments."""
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if line.strip() and not line.startswith(comment):
                yield lineno, line.split("\t")


def _read_tsv(path: Path) -> GeneToGo:
    sets: dict[str, set[str]] = {}
    for lineno, cols in _tab_rows(path, "#"):
        if len(cols) != 2:
            raise DataError(f"{path}, line {lineno}: expected 'gene<TAB>GO id(s)', got {len(cols)} column(s)")
        gene, terms = cols[0].strip(), [t.strip() for t in cols[1].split(";")]
        if not gene:
            raise DataError(f"{path}, line {lineno}: empty gene name")
        if not all(terms):
            raise DataError(f"{path}, line {lineno}: empty GO id for gene {gene!r}")
        sets.setdefault(gene, set()).update(terms)
    if not sets:
        raise DataError(f"{path}: no gene/GO pairs found")
    return {g: frozenset(t) for g, t in sets.items()}


def _read_gaf(path: Path) -> GeneToGo:
    sets: dict[str, set[str]] = {}
    negated = 0
    for lineno, cols in _tab_rows(path, "!"):
        if len(cols) < 5:
            raise DataError(f"{path}, line {lineno}: a GAF line has at least 5 tab-separated columns, got {len(cols)}")
        symbol, qualifier, go_id = cols[2].strip(), cols[3], cols[4].strip()
        if not symbol:
            raise DataError(f"{path}, line {lineno}: empty gene symbol (column 3)")
        if not go_id:
            raise DataError(f"{path}, line {lineno}: empty GO id (column 5)")
        if "NOT" in qualifier.split("|"):
            negated += 1
            continue
        sets.setdefault(symbol, set()).add(go_id)
    if negated:
        logger.info("%s: skipped %d 'NOT' annotations", path, negated)
    if not sets:
        raise DataError(f"{path}: no GO annotations found")
    return {g: frozenset(t) for g, t in sets.items()}


class PackedGeneToGo(Mapping):
    """A read-only gene -> frozenset of GO ids kept as arrays: the genes, the distinct GO ids, and per gene its ids'
    codes (int32, one array plus offsets).

    A dict of frozensets is a set, a hash table and a pointer per (gene, term) in every rank for the whole run (the
    GO graph reads it once); here it is 4 bytes per (gene, term) plus one str per distinct name. A lookup builds the
    gene's frozenset. `digests` holds `gene_graphs`' digest of this mapping over a gene list, computed where the
    mapping was built, so the rank that keys its graph cache makes no per-gene strings to hash.
    """

    def __init__(self, genes: list[str], terms: list[str], codes: np.ndarray, offsets: np.ndarray,
                 digests: dict[tuple[str, ...], str] | None = None):
        self.genes = genes
        self._row = {g: i for i, g in enumerate(genes)}
        self.terms = terms
        self.codes = codes
        self.offsets = offsets
        self.digests = dict(digests or {})

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Iterable[str]], genes: Iterable[str] | None = None) -> PackedGeneToGo:
        """Pack `mapping`, restricted to `genes` (those of them it has; None: every gene), terms sorted per gene."""
        kept = [g for g in (mapping if genes is None else genes) if g in mapping]
        term_code: dict[str, int] = {}
        per_gene = [[term_code.setdefault(t, len(term_code)) for t in sorted(mapping[g])] for g in kept]
        offsets = np.zeros(len(kept) + 1, dtype=np.int64)
        np.cumsum([len(c) for c in per_gene], out=offsets[1:])
        codes = np.fromiter((c for row in per_gene for c in row), dtype=np.int32, count=int(offsets[-1]))
        return cls(kept, list(term_code), codes, offsets)

    def __getitem__(self, gene: str) -> frozenset[str]:
        i = self._row[gene]
        return frozenset(self.terms[c] for c in self.codes[self.offsets[i]:self.offsets[i + 1]].tolist())

    def __contains__(self, gene: object) -> bool:
        return gene in self._row

    def __iter__(self) -> Iterator[str]:
        return iter(self.genes)

    def __len__(self) -> int:
        return len(self.genes)
