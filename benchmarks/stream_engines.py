"""Streaming engines on a UniRef50-shaped FASTA: HF datasets, MosaicML streaming, LitData and ours, compared.

Writes a UniRef50-shaped FASTA of `--records` records (`uniref_fasta.write_uniref_fasta`), converts it once per engine,
then reads it back with each engine in separate reader processes, one per simulated rank:

  hf        the Arrow cache of `build_fasta_dataset` as `Dataset.to_iterable_dataset(num_shards=S)`,
            `.shuffle(seed, buffer_size)`, `split_dataset_by_node(rank, world)`, `state_dict()` resume
  mosaic    MosaicML streaming: `MDSWriter` shards, `StreamingDataset` (py1e shuffle), ranks by its env vars
            (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) plus a gloo group, resume by `state_dict()`
  litdata   LitData: `optimize()` chunks, `StreamingDataset(shuffle=True)` + `StreamingDataLoader`, ranks by a
            gloo group (as under torchrun), resume by the loader's `state_dict()`
  ours      the same Arrow cache read map-style: rank r reads positions r, r+W, ... of the keyed permutation
            (`trainer.core.samplers.ShuffledOrder`), rows taken in batches; resume is a position

Measured per engine: conversion seconds (and workers), disk size, per-reader peak RSS (ru_maxrss, and the largest
anonymous RSS seen: memory-mapped pages of a shared file count in ru_maxrss but are page cache), the read rate of
one reader and of W readers together (W = 1, 2, 4 processes at once), whether the global order (rank lists
interleaved one sample at a time, as a DistributedSampler deals them) is the same at W = 1, 2, 4, the time from
restore to the first sample of a resume at 90 % of an epoch, whether that resume (at W = 1 and at another W) gives
exactly the samples an uninterrupted epoch would, and the CPU seconds a reader spends per sample it yields (equal at
every W when each reader reads only its share). Engines that are not importable are skipped with a line saying
why. MosaicML streaming pins numpy < 2.2, transformers < 5 and xxhash < 4, and both it and LitData pull torchvision,
so they run from their own environment: `make bench-engines` builds `.venv-engines` and passes `--engines-python`
(`torchvision_or_stub` says why streaming runs beside a torchvision stub there). Readers use no DataLoader workers;
the rank processes share this machine's cores, so rates at W > 1 say how the engines divide the work, not how they
scale. Prints a table; writes nothing to BENCHMARKS.md; deletes `--workdir` after unless `--keep`. Usage:
  python benchmarks/stream_engines.py --records 1000000 --workdir /tmp/stream-engines \
      --engines-python .venv-engines/bin/python
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ENGINES = ("hf", "mosaic", "litdata", "ours")
IMPORTS = {"hf": "datasets", "mosaic": "streaming", "litdata": "litdata", "ours": "trainer"}
PRELOAD = {"hf": ["torch", "datasets", "datasets.distributed"], "mosaic": ["torch", "streaming"],
           "litdata": ["torch", "litdata"], "ours": ["torch", "datasets", "trainer.core.samplers"]}
SEED = 17
RESUME_AT = 0.9
PIN_PACKAGES = ("torch", "numpy", "pyarrow", "datasets", "mosaicml-streaming", "litdata", "xxhash", "transformers")


# ---------------------------------------------------------------------------------------------------------------
# The FASTA, parsed without the package: the MDS and LitData conversions run in an environment without `trainer`.

def record_id(name: str) -> int:
    """A record's id (`UniRef50_A0A...`, unique in the file) as an int64 key: every engine's reader computes it the
    same way, so the orders compare; 64 bits leave no collision among millions of ids in practice."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little", signed=True)


def fasta_ranges(path: Path, parts: int) -> list[tuple[int, int]]:
    """`parts` byte ranges of the file, each starting at a record ('>') so each can be parsed on its own."""
    size = path.stat().st_size
    cuts = [0]
    with open(path, "rb") as f:
        for k in range(1, parts):
            f.seek(size * k // parts)
            f.readline()
            while True:
                pos = f.tell()
                line = f.readline()
                if not line or line.startswith(b">"):
                    break
            if pos > cuts[-1]:
                cuts.append(pos)
    cuts.append(size)
    return list(zip(cuts[:-1], cuts[1:]))


def fasta_records(path: str, start: int, end: int):
    """(name, sequence) of each record whose header lies in bytes [start, end)."""
    with open(path, "rb") as f:
        f.seek(start)
        rid, seq = None, []
        while f.tell() < end:
            line = f.readline()
            if line.startswith(b">"):
                if rid is not None:
                    yield rid, "".join(seq)
                rid, seq = line[1:].split(None, 1)[0].decode(), []
            else:
                seq.append(line.strip().decode())
        if rid is not None:
            yield rid, "".join(seq)


def litdata_records(part: tuple[str, int, int]):
    """LitData's `optimize` fn: the records of one byte range of the FASTA, as dicts."""
    path, start, end = part
    for rid, seq in fasta_records(path, start, end):
        yield {"id": rid, "sequence": seq}


def torchvision_or_stub() -> str | None:
    """Import torchvision, or put a stub in its place and say why.

    `import streaming` imports `streaming.vision`, which imports torchvision at module level; the registry's
    torchvision wheels are built against the CUDA build of torch and fail to load beside the CPU build that
    .venv-engines shares with .venv (`operator torchvision::nms does not exist`). MDS writing and reading never
    call torchvision, so a stub with the three names `streaming.vision` imports lets the engine itself run."""
    try:
        import torchvision  # noqa: F401
        return None
    except (ImportError, RuntimeError, OSError) as e:
        import importlib.machinery
        import types

        why = f"{type(e).__name__}: {e}"
        for name in list(sys.modules):
            if name == "torchvision" or name.startswith("torchvision."):
                del sys.modules[name]
        mods = {n: types.ModuleType(n) for n in ("torchvision", "torchvision.datasets", "torchvision.transforms",
                                                   "torchvision.transforms.functional")}
        for name, mod in mods.items():  # a spec, so that find_spec("torchvision") (transformers asks) works
            mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            mod.__path__ = []
        mods["torchvision.datasets"].VisionDataset = type("VisionDataset", (), {})
        mods["torchvision.datasets"].CIFAR10 = type("CIFAR10", (), {})
        mods["torchvision.transforms.functional"].to_tensor = lambda x: x
        sys.modules.update(mods)
        return why


def preload(engine: str) -> str | None:
    """Import what a reader of `engine` needs (outside the timed part); a note when torchvision was stubbed."""
    import importlib

    sys.path.insert(0, str(HERE.parent))
    note = torchvision_or_stub() if engine == "mosaic" else None
    for module in PRELOAD[engine]:
        importlib.import_module(module)
    return note


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------------------------------
# Conversions (each run in a child process of the engine's environment; prints one JSON line).

def convert(engine: str, fasta: Path, out: Path, workers: int) -> dict:
    t0 = time.perf_counter()
    if engine in ("hf", "ours"):
        sys.path.insert(0, str(HERE.parent))
        import datasets

        datasets.disable_progress_bars()
        from trainer.families.protein_sedd.dataset import build_fasta_dataset

        ds, _ = build_fasta_dataset(str(fasta), cache_dir=str(out), val_fraction=0.0, num_proc=workers)
        files = [f["filename"] for f in ds.cache_files]
        (out / "files.json").write_text(json.dumps(files))
        size = sum(Path(f).stat().st_size for f in files)
        info = {"rows": len(ds), "files": len(files), "columns": ds.column_names}
    elif engine == "mosaic":
        torchvision_or_stub()
        from streaming import MDSWriter

        workers = 1  # MDSWriter writes one stream; parallel writing means several outputs plus merge_index
        with MDSWriter(out=str(out / "mds"), columns={"id": "str", "sequence": "str"}, compression=None,
                       size_limit=1 << 26, progress_bar=False) as w:
            for rid, seq in fasta_records(str(fasta), 0, fasta.stat().st_size):
                w.write({"id": rid, "sequence": seq})
        size = dir_bytes(out / "mds")
        info = {"files": len(list((out / "mds").glob("*.mds")))}
    elif engine == "litdata":
        from litdata import optimize

        parts = [(str(fasta), a, b) for a, b in fasta_ranges(fasta, max(8, workers * 4))]
        optimize(fn=litdata_records, inputs=parts, output_dir=str(out / "litdata"), chunk_bytes="64MB",
                 num_workers=workers, mode="overwrite")
        size = dir_bytes(out / "litdata")
        info = {"files": len(list((out / "litdata").glob("*.bin")))}
    else:
        raise ValueError(engine)
    return {"engine": engine, "convert_s": time.perf_counter() - t0, "workers": workers, "bytes": size, **info}


# ---------------------------------------------------------------------------------------------------------------
# Readers: each yields (record id) in this rank's order, from the start of the epoch or from a saved state.

class Reader:
    """One rank's stream of record ids for one engine; `state(consumed)` after `consumed` of this rank's samples."""

    def __init__(self, engine: str, work: Path, rank: int, world: int, opts: dict, state: dict | None):
        self.engine, self.work, self.rank, self.world, self.opts = engine, work, rank, world, opts
        getattr(self, f"_open_{engine}")(state)

    # HF datasets ----------------------------------------------------------------------------------------------
    def _open_hf(self, state):
        import datasets
        from datasets.distributed import split_dataset_by_node

        datasets.disable_progress_bars()
        files = json.loads((self.work / "arrow" / "files.json").read_text())
        ds = datasets.concatenate_datasets([datasets.Dataset.from_file(f) for f in files])
        ds = ds.select_columns(["id", "sequence"])
        it = ds.to_iterable_dataset(num_shards=self.opts["shards"]).shuffle(seed=SEED, buffer_size=self.opts["buffer"])
        self.ds = split_dataset_by_node(it, rank=self.rank, world_size=self.world)
        self.detail = {"n_shards": getattr(self.ds, "num_shards", getattr(self.ds, "n_shards", None)),
                       "split": self.ds._distributed.strategy if self.ds._distributed else None}
        if self.detail["split"] == "auto":
            self.detail["split"] = "shards" if self.opts["shards"] % self.world == 0 else "examples"
        if state is not None:
            self.ds.load_state_dict(state["hf"])

    def _iter_hf(self):
        for ex in self.ds:
            yield record_id(ex["id"]), len(ex["sequence"])

    def _state_hf(self, consumed):
        return {"hf": self.ds.state_dict()}

    # MosaicML streaming ---------------------------------------------------------------------------------------
    def _open_mosaic(self, state):
        from streaming import StreamingDataset

        self.ds = StreamingDataset(local=str(self.work / "mosaic" / "mds"), shuffle=True, shuffle_algo="py1e",
                                   shuffle_seed=SEED, batch_size=1, num_canonical_nodes=1, predownload=8192)
        self.detail = {"shuffle": "py1e", "num_canonical_nodes": 1}
        if state is not None:
            self.ds.load_state_dict(state["mosaic"])

    def _iter_mosaic(self):
        for ex in self.ds:
            yield record_id(ex["id"]), len(ex["sequence"])

    def _state_mosaic(self, consumed):
        # Its state is the global count of samples seen this epoch: every rank has consumed as many.
        return {"mosaic": self.ds.state_dict(consumed * self.world, from_beginning=True)}

    # LitData --------------------------------------------------------------------------------------------------
    def _open_litdata(self, state):
        from litdata import StreamingDataLoader, StreamingDataset

        # drop_last as under DDP (every rank the same number of samples), stated so that W = 1 states match too.
        self.ds = StreamingDataset(input_dir=str(self.work / "litdata" / "litdata"), shuffle=True, seed=SEED,
                                   drop_last=True)
        self.loader = StreamingDataLoader(self.ds, batch_size=self.opts["batch"], num_workers=0,
                                          collate_fn=lambda batch: batch)
        self.detail = {"batch": self.opts["batch"]}
        if state is not None:
            self.loader.load_state_dict(state["litdata"])

    def _iter_litdata(self):
        for batch in self.loader:
            for ex in batch:
                yield record_id(ex["id"]), len(ex["sequence"])

    def _state_litdata(self, consumed):
        return {"litdata": self.loader.state_dict()}

    # ours: keyed permutation over the memory-mapped Arrow rows ------------------------------------------------
    def _open_ours(self, state):
        import datasets

        from trainer.core.samplers import ShuffledOrder

        files = json.loads((self.work / "arrow" / "files.json").read_text())
        ds = datasets.concatenate_datasets([datasets.Dataset.from_file(f) for f in files])
        self.table = ds.select_columns(["id", "sequence"])
        self.n = len(self.table)
        self.order = ShuffledOrder(self.n, SEED, 0)
        self.start = 0 if state is None else state["ours"]["position"]
        self.detail = {"rows": self.n, "batch": self.opts["batch"]}

    def _iter_ours(self):
        # Global positions g = k W + rank (a DistributedSampler's deal); k from this rank's share of the resume point.
        per_rank = -(-(self.n - self.rank) // self.world)
        k0 = -(-(self.start - self.rank) // self.world)
        batch = self.opts["batch"]
        for k in range(max(0, k0), per_rank, batch):
            pos = np.arange(k, min(k + batch, per_rank), dtype=np.int64) * self.world + self.rank
            rows = self.table[self.order(pos).tolist()]  # datasets' batched gather: memory-mapped rows, no copy
            for rid, seq in zip(rows["id"], rows["sequence"]):
                yield record_id(rid), len(seq)

    def _state_ours(self, consumed):
        return {"ours": {"position": self.start + consumed * self.world}}

    def __iter__(self):
        return getattr(self, f"_iter_{self.engine}")()

    def state(self, consumed: int) -> dict:
        return getattr(self, f"_state_{self.engine}")(consumed)


def rss_anon_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def read(a: argparse.Namespace) -> dict:
    """One reader process: open (from a state if given), read to the end of the epoch, write the ids."""
    os.environ.update({"RANK": str(a.rank), "WORLD_SIZE": str(a.world), "LOCAL_RANK": str(a.rank),
                       "LOCAL_WORLD_SIZE": str(a.world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(a.port)})
    if a.engine in ("mosaic", "litdata") and a.world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=a.rank, world_size=a.world)
    opts = json.loads(a.opts)
    state = json.loads(Path(a.state_in).read_text()) if a.state_in else None
    preload(a.engine)  # imported before the clock starts: the restore time is the engine's own
    t_open = time.perf_counter()
    reader = Reader(a.engine, Path(a.workdir), a.rank, a.world, opts, state)
    ids, first_s, peak_anon, saved = array("q"), None, rss_anon_mib(), None
    stop_at = a.save_at if a.save_at >= 0 else None
    t0, cpu0 = time.perf_counter(), time.process_time()
    for rid, _length in reader:
        if first_s is None:
            first_s = time.perf_counter() - t_open
        ids.append(rid)
        if len(ids) % 20_000 == 0:
            peak_anon = max(peak_anon, rss_anon_mib())
        if stop_at is not None and len(ids) == stop_at:
            saved = reader.state(len(ids))
            Path(a.state_out).write_text(json.dumps(saved))
        if a.limit and len(ids) >= a.limit:
            break
    read_s = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    peak_anon = max(peak_anon, rss_anon_mib())
    np.save(a.ids_out, np.frombuffer(ids, dtype=np.int64))
    if a.engine in ("mosaic", "litdata") and a.world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return {"engine": a.engine, "rank": a.rank, "world": a.world, "samples": len(ids), "read_s": read_s,
            "first_sample_s": first_s, "cpu_s": cpu, "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            / 1024, "peak_anon_mib": peak_anon, "saved": saved is not None, **reader.detail}


# ---------------------------------------------------------------------------------------------------------------
# The parent: conversions, reader processes, checks, table.

def resume_cut(n: int) -> int:
    """The resume point: 90 % of the epoch, rounded down to whole batches of 64 (LitData's state counts batches)."""
    return int(RESUME_AT * n) // 64 * 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child(python: str, args: list[str], timeout: float) -> dict:
    proc = subprocess.run([python, str(Path(__file__).resolve()), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=str(HERE.parent))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
        raise RuntimeError(f"{' '.join(args[:4])}: exit {proc.returncode}: " + " | ".join(tail))
    return json.loads(lines[-1])


def run_readers(python: str, engine: str, work: Path, world: int, opts: dict, tag: str, timeout: float,
                state_in: Path | None = None, save_at: int = -1, state_out: Path | None = None) -> list[dict]:
    """`world` reader processes at once; each result gets its ids (from its .npy) under "ids"."""
    port = free_port()
    procs = []
    for rank in range(world):
        out = work / f"ids-{engine}-{tag}-r{rank}.npy"
        args = ["--child", "read", "--engine", engine, "--workdir", str(work), "--rank", str(rank), "--world",
                str(world), "--port", str(port), "--opts", json.dumps(opts), "--ids-out", str(out)]
        if state_in is not None:
            args += ["--state-in", str(state_in)]
        if save_at >= 0 and rank == 0:
            args += ["--save-at", str(save_at), "--state-out", str(state_out)]
        procs.append((out, subprocess.Popen([python, str(Path(__file__).resolve()), *args], stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, text=True, cwd=str(HERE.parent))))
    results = []
    for out, p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for _, q in procs:
                q.kill()
            raise RuntimeError(f"{engine} W={world}: readers still running after {timeout:.0f} s") from None
        lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
        if p.returncode != 0 or not lines:
            tail = stderr.strip().splitlines()[-4:]
            raise RuntimeError(f"{engine} W={world} ({tag}): exit {p.returncode}: " + " | ".join(tail))
        r = json.loads(lines[-1])
        r["ids"] = np.load(out)
        out.unlink()
        results.append(r)
    return results


def interleave(per_rank: list[np.ndarray]) -> np.ndarray:
    """The global order of rank lists dealt one sample at a time (rank r has global positions r, r+W, ...)."""
    world, n = len(per_rank), sum(len(x) for x in per_rank)
    out = np.full(n, -1, dtype=np.int64)
    for r, ids in enumerate(per_rank):
        out[r::world][: len(ids)] = ids[: len(out[r::world])]
    return out


def pins(python: str) -> dict:
    code = ("import importlib.metadata as m, json; d={}\n"
            f"for p in {PIN_PACKAGES!r}:\n"
            "    try: d[p]=m.version(p)\n    except m.PackageNotFoundError: pass\n"
            "req={}\n"
            "for p in ('mosaicml-streaming','litdata','datasets'):\n"
            "    try: req[p]=[r for r in (m.requires(p) or []) if 'extra' not in r and any(r.lower().startswith(q)\n"
            "                 for q in ('numpy','torch','pyarrow','xxhash','transformers'))]\n"
            "    except m.PackageNotFoundError: pass\n"
            "print(json.dumps({'versions': d, 'requires': req}))")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout) if out.returncode == 0 else {"error": out.stderr.strip()[-300:]}


def importable(python: str, engine: str) -> tuple[str | None, str | None]:
    """(None, note) when `engine`'s modules import under `python`, else (the last line of the error, None)."""
    if os.path.abspath(python) == os.path.abspath(sys.executable):
        import importlib.util

        if importlib.util.find_spec(IMPORTS[engine]) is None:
            return f"ModuleNotFoundError: no module named {IMPORTS[engine]!r} (--engines-python names another)", None
        if engine in ("hf", "ours"):
            return None, None
    if not Path(python).exists():
        return f"{python} does not exist (`make bench-engines` builds .venv-engines)", None
    proc = subprocess.run([python, str(Path(__file__).resolve()), "--child", "probe", "--engine", engine],
                          capture_output=True, text=True, timeout=300, cwd=str(HERE.parent))
    if proc.returncode == 0:
        return None, json.loads(proc.stdout.strip().splitlines()[-1])["note"]
    return (proc.stderr.strip().splitlines() or ["?"])[-1], None


def measure(a: argparse.Namespace) -> None:
    sys.path.insert(0, str(HERE))
    from uniref_fasta import uniref_fasta_in

    work = Path(a.workdir)
    fasta = uniref_fasta_in(work, a.records, say=log)
    pythons = {"hf": sys.executable, "ours": sys.executable, "mosaic": a.engines_python or sys.executable,
               "litdata": a.engines_python or sys.executable}
    engines = [e for e in a.engines.split(",") if e]
    rows, notes = {}, []
    for py in sorted(set(pythons[e] for e in engines)):
        p = pins(py)
        log(f"pins under {py}: {json.dumps(p)}")
        notes.append(f"environment {py}: {json.dumps(p)}")
    opts = {"hf": {"shards": a.hf_shards, "buffer": a.hf_buffer}, "mosaic": {}, "litdata": {"batch": 64},
            "ours": {"batch": 1024}}
    n_total = a.records
    for engine in engines:
        why, note = importable(pythons[engine], engine)
        if note:
            line = f"{engine}: torchvision fails to import under {pythons[engine]} ({note}); run with a stub"
            log(line)
            notes.append(line)
        if why is not None:
            line = f"{engine}: skipped, `import {IMPORTS[engine]}` fails under {pythons[engine]}: {why}"
            log(line)
            notes.append(line)
            continue
        try:
            rows[engine] = measure_engine(engine, pythons[engine], work, fasta, opts[engine], a, n_total)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            line = f"{engine}: failed: {e}"
            log(line)
            notes.append(line)
    print_table(rows, notes, a)


def measure_engine(engine: str, python: str, work: Path, fasta: Path, opts: dict, a, n_total: int) -> dict:
    row: dict = {}
    src = "arrow" if engine in ("hf", "ours") else engine
    out = work / src
    done = work / f"converted-{src}.json"  # hf and ours share one Arrow cache: converted once
    if done.exists():
        c = json.loads(done.read_text())
    else:
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        c = child(python, ["--child", "convert", "--engine", engine, "--workdir", str(work), "--fasta", str(fasta),
                           "--workers", str(a.workers)], a.timeout)
        done.write_text(json.dumps(c))
        log(f"{engine}: converted in {c['convert_s']:.1f} s ({c['workers']} workers), {c['bytes'] / 2**20:.0f} MiB; "
            f"{json.dumps(c)}")
    row["convert"] = f"{c['convert_s']:.1f} s, {c['workers']} w"
    row["disk_mib"] = c["bytes"] / 2**20
    orders, details = {}, {}
    for world in a.worlds:
        save = world == 1
        res = run_readers(python, engine, work, world, opts, f"w{world}", a.timeout,
                          save_at=resume_cut(n_total) if save else -1, state_out=work / f"state-{engine}.json")
        ids = [r["ids"] for r in res]
        orders[world] = interleave(ids)
        wall = max(r["read_s"] for r in res)
        total = sum(r["samples"] for r in res)
        row[f"rate_w{world}"] = total / wall
        row[f"rss_w{world}"] = max(r["maxrss_mib"] for r in res)
        row[f"anon_w{world}"] = max(r["peak_anon_mib"] for r in res)
        row[f"cpu_per_k_w{world}"] = max(r["cpu_s"] / max(1, r["samples"]) for r in res) * 1e6
        row[f"samples_w{world}"] = [r["samples"] for r in res]
        row[f"cpu_s_w{world}"] = [round(r["cpu_s"], 2) for r in res]
        details[world] = {k: v for k, v in res[0].items() if k not in ("ids",)}
        log(f"{engine} W={world}: {total:,} samples {[r['samples'] for r in res]}, {total / wall:,.0f}/s together, "
            f"max RSS {row[f'rss_w{world}']:.0f} MiB (anon {row[f'anon_w{world}']:.0f}), "
            f"{row[f'cpu_per_k_w{world}']:.2f} CPU-us per sample (CPU s per rank {row[f'cpu_s_w{world}']}); "
            f"{json.dumps(details[world])}")
    base = orders[min(orders)]
    row["complete"] = bool(len(base) == n_total and len(np.unique(base)) == n_total)
    row["same_order"] = {w: bool(len(o) == len(base) and np.array_equal(o, base)) for w, o in orders.items()}
    # Resume at 90 % of the W = 1 epoch, at W = 1 and at another W: the rest must be the uninterrupted tail.
    state = work / f"state-{engine}.json"
    cut = resume_cut(n_total)
    tail = base[cut:]
    row["resume"] = {}
    for world in a.resume_worlds:
        try:
            res = run_readers(python, engine, work, world, opts, f"resume-w{world}", a.timeout, state_in=state)
        except RuntimeError as e:
            row["resume"][world] = {"error": str(e)[-300:]}
            log(f"{engine}: resume at W={world}: {e}")
            continue
        got = interleave([r["ids"] for r in res])
        first = max(r["first_sample_s"] or float("nan") for r in res)
        exact = bool(len(got) == len(tail) and np.array_equal(got, tail))
        same_set = bool(len(got) == len(tail) and np.array_equal(np.sort(got), np.sort(tail)))
        missing = int(len(np.setdiff1d(tail, got)))
        extra = int(len(got) - len(np.unique(got))) + int(len(np.setdiff1d(got, tail)))
        row["resume"][world] = {"first_s": first, "exact": exact, "same_set": same_set, "missing": missing,
                                "extra": extra, "got": len(got), "want": len(tail)}
        log(f"{engine}: resume at 90% at W={world}: first sample {first:.2f} s after restore; "
            f"{len(got):,} samples (want {len(tail):,}); order exact {exact}, same set {same_set}, "
            f"{missing} missing, {extra} extra or repeated")
    row["details"] = details
    return row


def print_table(rows: dict, notes: list[str], a) -> None:
    worlds = a.worlds
    head = (["engine", "convert", "disk MiB"] + [f"samples/s W={w}" for w in worlds]
            + [f"peak RSS MiB (anon) W={w}" for w in worlds] + ["CPU-us/sample " + "/".join(f"W={w}" for w in worlds)]
            + ["same order " + "/".join(str(w) for w in worlds), "resume first s W=" + "/".join(map(str, a.resume_worlds)),
               "resume exact W=" + "/".join(map(str, a.resume_worlds))])
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for engine, r in rows.items():
        res = r["resume"]

        def rfmt(w, key, fmt, res=res):
            v = res.get(w, {})
            if "error" in v:
                return "error"
            return fmt(v[key]) if key in v and v[key] is not None else "-"

        def exact(w, res=res):
            v = res.get(w, {})
            if "error" in v:
                return "error"
            if not v:
                return "-"
            if v["exact"]:
                return "yes"
            return "same set" if v["same_set"] else f"no ({v['missing']} missing, {v['extra']} extra)"

        cells = ([engine, r["convert"], f"{r['disk_mib']:.0f}"] + [f"{r[f'rate_w{w}']:,.0f}" for w in worlds]
                 + [f"{r[f'rss_w{w}']:.0f} ({r[f'anon_w{w}']:.0f})" for w in worlds]
                 + ["/".join(f"{r[f'cpu_per_k_w{w}']:.1f}" for w in worlds)]
                 + ["/".join("yes" if r["same_order"][w] else "no" for w in worlds)
                    + ("" if r["complete"] else " (W=1 incomplete)"),
                    " / ".join(rfmt(w, "first_s", lambda x: f"{x:.2f}") for w in a.resume_worlds),
                    " / ".join(exact(w) for w in a.resume_worlds)])
        print("| " + " | ".join(cells) + " |")
    print()
    print(f"{a.records:,} records; readers at W > 1 run at once on this machine's {os.cpu_count()} cores (shared), "
          "so W readers together cannot beat 2 cores' worth; samples/s at W: all readers' samples / slowest reader's "
          "read time; CPU-us/sample: the busiest reader's CPU time per sample it yields (equal at every W when "
          "each reader reads only its share).")
    for e, r in rows.items():
        for w, d in r["details"].items():
            print(f"- {e} W={w}: per-rank samples {r[f'samples_w{w}']}, CPU s {r[f'cpu_s_w{w}']}; {json.dumps(d)}")
        for w, v in r["resume"].items():
            print(f"- {e} resume at W={w}: {json.dumps(v)}")
    for line in notes:
        print(f"- {line}")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=100_000)
    p.add_argument("--workdir", default="/tmp/stream-engines")
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated, of " + ", ".join(ENGINES))
    p.add_argument("--engines-python", default=None,
                   help="the interpreter for mosaic and litdata (default: this one), e.g. .venv-engines/bin/python")
    p.add_argument("--worlds", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    p.add_argument("--resume-worlds", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4],
                   help="resume the W = 1 state at 90 %% at each of these world sizes")
    p.add_argument("--workers", type=int, default=2, help="conversion processes (where the engine has them)")
    p.add_argument("--hf-shards", type=int, default=64, help="to_iterable_dataset(num_shards=...)")
    p.add_argument("--hf-buffer", type=int, default=1000, help="IterableDataset.shuffle(buffer_size=...)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--keep", action="store_true", help="keep --workdir (the FASTA and every engine's shards)")
    p.add_argument("--smoke", action="store_true", help="2,000 records in a temp folder: checks the script runs")
    # The reader and converter child processes.
    p.add_argument("--child", choices=["read", "convert", "probe"], help=argparse.SUPPRESS)
    p.add_argument("--engine", help=argparse.SUPPRESS)
    p.add_argument("--fasta", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=29500, help=argparse.SUPPRESS)
    p.add_argument("--opts", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--ids-out", help=argparse.SUPPRESS)
    p.add_argument("--state-in", help=argparse.SUPPRESS)
    p.add_argument("--state-out", help=argparse.SUPPRESS)
    p.add_argument("--save-at", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--limit", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child == "convert":
        print(json.dumps(convert(a.engine, Path(a.fasta), Path(a.workdir) / ("arrow" if a.engine in ("hf", "ours")
                                                                              else a.engine), a.workers)))
        return
    if a.child == "probe":
        print(json.dumps({"note": preload(a.engine)}))
        return
    if a.child == "read":
        print(json.dumps(read(a)))
        return
    if a.smoke:
        with tempfile.TemporaryDirectory(prefix="stream-engines-") as tmp:
            a.records, a.workdir, a.worlds, a.resume_worlds = 2000, tmp, [1, 2], [2]
            a.hf_shards, a.hf_buffer, a.timeout = 4, 100, 300
            measure(a)
        print("smoke run: nothing written")
        return
    try:
        measure(a)
    finally:
        if not a.keep:
            shutil.rmtree(a.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
