"""ComFormer-style Python API: `train_from_list` and `train_from_extxyz` on the Trainer.

The keywords are those ComFormer users know (batch_size per device, n_epochs, learning_rate,
num_workers, random_seed, output_dir, cache_graphs, use_lattice, use_angle, distributed). Under
`torchrun` or `accelerate launch` each process runs the same call and the Trainer does the rest
(DDP, exact-once evaluation, rank-0 writing). From plain Python, `num_processes=N` starts N
processes through the core's `trainer.api.train` (`torch.distributed.run --standalone`: a free port,
no fixed MASTER_PORT) on a config file it writes into the run directory, so the run can be repeated
with `trainer train RUN_DIR/launch_config.yaml`.

In-memory structures are written once to `OUTPUT_DIR/data/structures.extxyz` (a real file the
launched processes read and the Arrow cache fingerprints), with the labels in `info["target"]`.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer.api import RunResult, train, under_launcher
from trainer.atomic_io import atomic_write_bytes
from trainer.config import Config, load_config
from trainer.registry import get_family
from trainer.rundir import RunDir

TASK = "crystal_property"
"""The task these functions train (its family is found through the registry)."""

logger = logging.getLogger(__name__)

__all__ = ["train_from_list", "train_from_extxyz", "write_structures_extxyz"]


def write_structures_extxyz(structures: Sequence[Any], labels: Sequence[Any], path: str | Path,
                            ids: Sequence[str] | None = None, on_invalid: str = "error") -> Path:
    """Write structures (ase.Atoms or pymatgen Structures) as extxyz with `info["id"]` and `info["target"]`.

    Every structure and label is validated first by the family's reader, as `build_crystal_dataset`
    would (a None or NaN label, an unknown element, a singular cell, ...): `on_invalid="error"` raises
    the `CrystalDataError` naming the record (index and id), the field and the reason; "skip" leaves
    the record out and logs the counts. The file is written from the validated records (no
    pymatgen -> ASE conversion), replaced atomically and only when its content changes, so the
    processes of one launch (which all call this) agree on the file and its Arrow cache fingerprint.
    """
    import ase
    import ase.io

    if len(structures) != len(labels):
        raise ValueError(f"{len(structures)} structures but {len(labels)} labels")
    if ids is not None and len(ids) != len(structures):
        raise ValueError(f"{len(structures)} structures but {len(ids)} ids")
    readers = get_family(TASK).readers  # the family's reader validates every record
    skipped: Counter = Counter()
    records = list(readers.iter_crystals(list(structures), labels=list(labels), ids=ids, on_invalid=on_invalid,
                                 skipped=skipped, check_overlap=False))  # overlaps: found by the graph build
    readers.log_skips(skipped, len(structures), "train_from_list structures")
    if not records:
        raise readers.CrystalDataError("<in-memory>", None, None, "records", "no_records",
                               f"no valid structures ({dict(skipped)} skipped)")
    frames = []
    for rec in records:
        atoms = ase.Atoms(numbers=rec["atomic_numbers"], positions=rec["positions"], cell=rec["cell"], pbc=rec["pbc"])
        atoms.info = {"id": rec["id"], "target": rec["target"]}
        frames.append(atoms)
    buffer = io.StringIO()
    ase.io.write(buffer, frames, format="extxyz")
    data = buffer.getvalue().encode()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(data).digest():
        return path
    atomic_write_bytes(path, data, durable=False)
    return path


TEMPORARY_CACHE = ".graph_cache_tmp"
"""The graph cache of a `cache_graphs=False` run (under output_dir; removed when the run ends)."""


def _build_config(*, data_path: str, target: str, per_atom: bool, batch_size: int, n_epochs: float,
                  learning_rate: float, num_workers: int, random_seed: int, output_dir: str, cache_graphs: bool,
                  use_lattice: bool, config: str | None, overrides: Sequence[str],
                  task_options: dict[str, Any]) -> Config:
    opts = {"task.name": TASK, "task.preset": task_options.pop("preset", "paper"),
            "task.data_path": data_path, "task.target": target, "task.per_atom": per_atom,
            "task.use_lattice": use_lattice, "train.per_device_batch_size": batch_size, "train.epochs": n_epochs,
            "optim.lr": learning_rate, "data.num_workers": num_workers, "run.seed": random_seed,
            "run.output_dir": output_dir, "log.progress_bar": False}
    # cache_graphs=False: a cache inside the run, the same path on every rank, removed after the run
    opts["task.cache_dir"] = str(Path(output_dir) / ("cache" if cache_graphs else TEMPORARY_CACHE))
    opts.update({f"task.{k}": v for k, v in task_options.items() if v is not None})  # None: the task's default
    cli = [f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in opts.items()]
    return load_config(config, [*cli, *overrides])


def _run(cfg: Config, num_processes: int, distributed: bool, deepspeed: str | None) -> dict[str, Any]:
    if distributed and num_processes == 1 and not under_launcher():
        logger.warning("distributed=True but no launcher started this process: training in one process "
                       "(use torchrun / accelerate launch, or pass num_processes=N)")
    result = train(cfg, num_processes, deepspeed_config=deepspeed)
    return _results(result) if result.main_process else {}


def _run_and_clean(cfg: Config, num_processes: int, distributed: bool, deepspeed: str | None,
                   cache_graphs: bool) -> dict[str, Any]:
    try:
        return _run(cfg, num_processes, distributed, deepspeed)
    finally:
        if not cache_graphs and int(os.environ.get("RANK", "0")) == 0:
            shutil.rmtree(Path(cfg.run.output_dir) / TEMPORARY_CACHE, ignore_errors=True)


def read_results(run_dir: str | Path) -> dict[str, Any]:
    """Last eval metrics, test metrics and paths of a finished run directory."""
    return _results(RunResult.read(run_dir))


def _results(result: RunResult) -> dict[str, Any]:
    test = dict(result.test_metrics)
    if result.test_weights_step is not None:
        test["weights_step"] = result.test_weights_step
    parity = RunDir(result.run_dir).test / "parity.png"
    return {"run_dir": str(result.run_dir), "eval": dict(result.eval_metrics), "test": test,
            "parity_plot": str(parity) if parity.exists() else None,
            "checkpoints": str(RunDir(result.run_dir).checkpoints)}


def train_from_list(strucs: Sequence[Any], labels: Sequence[Any], *, ids: Sequence[str] | None = None,
                    batch_size: int = 32, n_epochs: float = 500, learning_rate: float = 1e-3, num_workers: int = 0,
                    random_seed: int = 123, output_dir: str = "./output", cache_graphs: bool = True,
                    use_lattice: bool = True, use_angle: bool = False, distributed: bool = False,
                    num_processes: int = 1, config: str | None = None, overrides: Sequence[str] = (),
                    deepspeed: str | None = None, test_target: str = "energy", test_per_atom: bool | None = None,
                    **task_options: Any) -> dict[str, Any]:
    """Train `crystal_property` on structures (ase.Atoms or pymatgen Structures) and their labels.

    batch_size is per process; the labels are taken as given (per_atom=False unless passed). The
    structures and labels are validated before anything is written (a None label raises the
    `missing_target` CrystalDataError, an unknown element names the record and the element).
    `test_path=` takes a held-out file in any format the family reads (mlearn JSON, extxyz, an
    id_prop folder): its target is read under `test_target` (default "energy", the mlearn and ASE
    calculator key) and divided by the atom count if `test_per_atom` (default: as `per_atom`).
    Extra keywords are `task.*` options (e.g. variant="ecomformer", preset="tiny", test_fraction=0.1);
    `config` / `overrides` give any other setting (CLI syntax). Returns the final eval and test
    metrics and the run paths (on the main process; {} on the other ranks of a launched run).
    """
    if use_angle:
        logger.warning("use_angle has no effect: ComFormer encodes angles through the edge-lattice cosines "
                       "(use_lattice), not an ALIGNN line graph")
    data = write_structures_extxyz(strucs, labels, Path(output_dir) / "data" / "structures.extxyz", ids=ids,
                                   on_invalid=task_options.get("on_invalid", "error"))
    per_atom = task_options.pop("per_atom", False)
    task_options.setdefault("id_key", "id")  # the ids written above name the records in errors and predictions
    task_options.update(test_target=test_target, test_per_atom=test_per_atom)
    cfg = _build_config(data_path=str(data), target="target", per_atom=per_atom, batch_size=batch_size,
                        n_epochs=n_epochs, learning_rate=learning_rate, num_workers=num_workers,
                        random_seed=random_seed, output_dir=output_dir, cache_graphs=cache_graphs,
                        use_lattice=use_lattice, config=config, overrides=overrides, task_options=task_options)
    return _run_and_clean(cfg, num_processes, distributed, deepspeed, cache_graphs)


def train_from_extxyz(extxyz_file: str | Path, target_property: str, *, batch_size: int = 32,
                      n_epochs: float = 500, learning_rate: float = 1e-3, num_workers: int = 0,
                      random_seed: int = 123, output_dir: str = "./output", cache_graphs: bool = True,
                      use_lattice: bool = True, use_angle: bool = False, distributed: bool = False,
                      num_processes: int = 1, config: str | None = None, overrides: Sequence[str] = (),
                      deepspeed: str | None = None, **task_options: Any) -> dict[str, Any]:
    """Train `crystal_property` on an extxyz file, the target read from `atoms.info[target_property]`
    (or a per-atom array, summed). Same keywords and return value as `train_from_list`."""
    if use_angle:
        logger.warning("use_angle has no effect: ComFormer encodes angles through the edge-lattice cosines")
    per_atom = task_options.pop("per_atom", False)
    cfg = _build_config(data_path=str(Path(extxyz_file).resolve()), target=target_property, per_atom=per_atom,
                        batch_size=batch_size, n_epochs=n_epochs, learning_rate=learning_rate,
                        num_workers=num_workers, random_seed=random_seed, output_dir=output_dir,
                        cache_graphs=cache_graphs, use_lattice=use_lattice, config=config, overrides=overrides,
                        task_options=task_options)
    return _run_and_clean(cfg, num_processes, distributed, deepspeed, cache_graphs)
