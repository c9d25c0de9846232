"""Read the perturbation data and its gene -> GO mapping in a short-lived child interpreter (`read_apart`).

Reading makes many short-lived small Python objects: anndata's per-cell obs index and columns, the gene -> GO
mapping's sets and strings, the DE cache's per-condition arrays. Freed in a training rank, they leave its
allocators' arenas and heap grown for the whole run, pinned by the few objects that outlive the read. Read in a
child, the rank receives only the result: `PerturbationData` (packed arrays, X as the folder of its memory-mapped
cache, mapped again here) and the mapping packed and restricted to the perturbable genes (`PackedGeneToGo`),
unpickled in one go.

The child is a fresh `python -c` that imports this module (no torch, no accelerate), not a multiprocessing spawn,
which would first run the launching script again as `__mp_main__`. It gets the request (the caller's `sys.path` and
the arguments) on stdin and writes its pickled answer to a file the caller names: its data, or the error it raised
(raised again here, same type and message), and the log records of the read, re-emitted here under their loggers.
"""

from __future__ import annotations

import logging
import pickle
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer.errors import DataError
from trainer.families.perturbation_gears.anndata_reader import PerturbationData, mapped_folder, read_perturbation_data
from trainer.families.perturbation_gears.gene_ontology import PackedGeneToGo, read_gene2go

logger = logging.getLogger(__name__)

_CHILD = ("import pickle, sys\n"
          "request = pickle.load(sys.stdin.buffer)\n"
          "sys.path[:] = request['sys_path']\n"
          "from trainer.families.perturbation_gears.read_process import serve\n"
          "serve(request)\n")


def read_apart(data_path: str | Path, gene2go_path: str | Path, *, x_cache_dir: str | Path, **options: Any
               ) -> tuple[PerturbationData, PackedGeneToGo]:
    """`read_perturbation_data(data_path, read_gene2go(gene2go_path), x_cache_dir=..., **options)` run in a child
    interpreter, and the mapping packed over the data's perturbable genes: the same data and graphs as reading here.

    X must be cached (`x_cache_dir`): the child writes (or finds) the memory-mapped copy and this process maps it.
    The child's DataError / ConfigError is raised here as it was raised there; a child that dies without an answer
    (killed, out of memory) is a DataError naming the file and the child's last output.
    """
    with tempfile.TemporaryDirectory(prefix="gears_read_") as tmp:
        answer = Path(tmp) / "answer.pkl"
        request = {"sys_path": list(sys.path), "data_path": str(data_path), "gene2go_path": str(gene2go_path),
                   "x_cache_dir": str(x_cache_dir), "options": dict(options), "answer": str(answer),
                   "log_level": logging.getLogger("trainer").getEffectiveLevel()}
        proc = subprocess.run([sys.executable, "-c", _CHILD], input=pickle.dumps(request), capture_output=True)
        if proc.stderr:  # the libraries' warnings, shown as if read here
            sys.stderr.write(proc.stderr.decode(errors="replace"))
        if not answer.is_file():
            tail = (proc.stderr or proc.stdout or b"").decode(errors="replace")[-2000:]
            raise DataError(f"{data_path}: the reading process exited with status {proc.returncode} without an "
                            f"answer: {tail}")
        with open(answer, "rb") as f:
            result = pickle.load(f)  # our own child's answer, in a folder only this call made
    for name, level, message in result["records"]:
        logging.getLogger(name).log(level, "%s", message)
    if result["error"] is not None:
        logger.debug("the reading process failed:\n%s", result["traceback"])
        raise result["error"]
    return result["data"], result["gene2go"]


class _Records(logging.Handler):
    """Keeps (logger name, level, message) of every record, for the parent to log again."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.name, record.levelno, record.getMessage()))


def packed_gene2go(gene2go: Mapping[str, Any], pert_genes: list[str]) -> PackedGeneToGo:
    """`gene2go` restricted to `pert_genes` (all the GO graph and its cache key read), packed, with its digest."""
    from trainer.families.perturbation_gears.gene_graphs import gene2go_digest

    packed = PackedGeneToGo.from_mapping(gene2go, pert_genes)
    packed.digests[tuple(pert_genes)] = gene2go_digest(pert_genes, gene2go)
    return packed


def serve(request: Mapping[str, Any]) -> None:
    """The child's side of `read_apart`: read, pack, write the answer (data or error, and the log records)."""
    records = _Records()
    root = logging.getLogger("trainer")
    root.addHandler(records)
    root.setLevel(request["log_level"])
    root.propagate = False
    result: dict[str, Any] = {"data": None, "gene2go": None, "error": None, "traceback": ""}
    try:
        gene2go = read_gene2go(request["gene2go_path"])
        data = read_perturbation_data(request["data_path"], gene2go, x_cache_dir=request["x_cache_dir"],
                                      **request["options"])
        if data.X.nnz and mapped_folder(data.X) is None:
            raise DataError(f"{request['data_path']}: X is not memory-mapped from {request['x_cache_dir']}")
        result["gene2go"] = packed_gene2go(gene2go, list(data.pert_genes))
        result["data"] = data
    except Exception as e:  # handed to the parent, which raises it
        result["error"], result["traceback"] = e, traceback.format_exc()
    result["records"] = records.records
    try:
        payload = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # an error that does not pickle: its type and message
        result.update(data=None, gene2go=None, error=DataError(f"{type(result['error']).__name__}: {result['error']}"
                                                               if result["error"] is not None else str(e)))
        payload = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    Path(request["answer"]).write_bytes(payload)
