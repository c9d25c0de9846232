"""ComFormer-style Python API: `train_from_list` and `train_from_extxyz` on the Trainer.

The keywords are those ComFormer users know (batch_size per device, n_epochs, learning_rate,
num_workers, random_seed, output_dir, cache_graphs, use_lattice, use_angle, distributed). Under
`torchrun` or `accelerate launch` each process runs the same call and the Trainer does the rest
(DDP, exact-once evaluation, rank-0 writing). From plain Python, `num_processes=N` starts N
processes itself through `torch.distributed.run --standalone` (a free port, no fixed
MASTER_PORT) on a config file it writes into the run directory, so the run can be repeated with
`trainer train RUN_DIR/launch_config.yaml`.

In-memory structures are written once to `OUTPUT_DIR/data/structures.extxyz` (a real file the
launched processes read and the Arrow cache fingerprints), with the labels in `info["target"]`.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from trainer.config import Config, load_config, save_config

logger = logging.getLogger(__name__)

__all__ = ["train_from_list", "train_from_extxyz", "write_structures_extxyz"]


def _as_atoms(structure: Any):
    import ase

    if isinstance(structure, ase.Atoms):
        return structure.copy()
    try:
        from pymatgen.io.ase import AseAtomsAdaptor
    except ImportError as err:  # pragma: no cover - pymatgen is optional
        raise TypeError(f"expected ase.Atoms or a pymatgen Structure, got {type(structure).__name__}") from err
    return AseAtomsAdaptor.get_atoms(structure)


def write_structures_extxyz(structures: Sequence[Any], labels: Sequence[Any], path: str | Path,
                            ids: Sequence[str] | None = None) -> Path:
    """Write structures (ase.Atoms or pymatgen Structures) with `info["target"]` = label as extxyz.

    The file is replaced atomically and only when its content changes, so the processes of one
    launch (which all call this) agree on the file and its Arrow cache fingerprint.
    """
    import ase.io

    if len(structures) != len(labels):
        raise ValueError(f"{len(structures)} structures but {len(labels)} labels")
    if ids is not None and len(ids) != len(structures):
        raise ValueError(f"{len(structures)} structures but {len(ids)} ids")
    frames = []
    for k, (structure, label) in enumerate(zip(structures, labels)):
        atoms = _as_atoms(structure)
        atoms.calc = None
        atoms.info = {"id": str(ids[k]) if ids is not None else f"structure_{k}", "target": label}
        frames.append(atoms)
    buffer = io.StringIO()
    ase.io.write(buffer, frames, format="extxyz")
    data = buffer.getvalue().encode()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(data).digest():
        return path
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return path


def _under_launcher() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def _build_config(*, data_path: str, target: str, per_atom: bool, batch_size: int, n_epochs: float,
                  learning_rate: float, num_workers: int, random_seed: int, output_dir: str, cache_graphs: bool,
                  use_lattice: bool, config: str | None, overrides: Sequence[str], task_options: dict[str, Any]) -> Config:
    opts = {"task.name": "crystal_property", "task.preset": task_options.pop("preset", "paper"),
            "task.data_path": data_path, "task.target": target, "task.per_atom": per_atom,
            "task.use_lattice": use_lattice, "train.per_device_batch_size": batch_size, "train.epochs": n_epochs,
            "optim.lr": learning_rate, "data.num_workers": num_workers, "run.seed": random_seed,
            "run.output_dir": output_dir, "log.progress_bar": False}
    opts["task.cache_dir"] = str(Path(output_dir) / "cache") if cache_graphs else tempfile.mkdtemp(prefix="graphs-")
    opts.update({f"task.{k}": v for k, v in task_options.items()})
    cli = [f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in opts.items()]
    return load_config(config, [*cli, *overrides])


def _run(cfg: Config, num_processes: int, distributed: bool, deepspeed: str | None) -> dict[str, Any]:
    out = Path(cfg.run.output_dir)
    if num_processes > 1 and not _under_launcher():
        out.mkdir(parents=True, exist_ok=True)
        launch_config = out / "launch_config.yaml"
        save_config(cfg, launch_config)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={num_processes}",
               "-m", "trainer", "train", str(launch_config)]
        if deepspeed:
            cmd += ["--deepspeed", deepspeed]
        logger.info("launching %d processes: %s", num_processes, " ".join(cmd))
        proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        if proc.returncode != 0:
            raise RuntimeError(f"the {num_processes}-process run exited with status {proc.returncode}; "
                               f"see the output above and {out / 'metrics.jsonl'}")
    else:
        if distributed and not _under_launcher():
            logger.warning("distributed=True but no launcher started this process: training in one process "
                           "(use torchrun / accelerate launch, or pass num_processes=N)")
        from trainer.core.trainer import Trainer

        trainer = Trainer(cfg, deepspeed_config=deepspeed)
        trainer.fit()
        if not trainer.accelerator.is_main_process:
            return {}
    return read_results(out)


def read_results(run_dir: str | Path) -> dict[str, Any]:
    """Last eval metrics, test metrics and paths of a finished run directory."""
    run_dir = Path(run_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    last_eval = next((r for r in reversed(records) if any(k.startswith("eval/") for k in r)), {})
    last_test = next((r for r in reversed(records) if any(k.startswith("test/") for k in r)), {})
    return {"run_dir": str(run_dir),
            "eval": {k[5:]: v for k, v in last_eval.items() if k.startswith("eval/")},
            "test": {k[5:]: v for k, v in last_test.items() if k.startswith("test/")},
            "parity_plot": str(run_dir / "test" / "parity.png") if (run_dir / "test" / "parity.png").exists() else None,
            "checkpoints": str(run_dir / "checkpoints")}


def train_from_list(strucs: Sequence[Any], labels: Sequence[Any], *, ids: Sequence[str] | None = None,
                    batch_size: int = 32, n_epochs: float = 500, learning_rate: float = 1e-3, num_workers: int = 0,
                    random_seed: int = 123, output_dir: str = "./output", cache_graphs: bool = True,
                    use_lattice: bool = True, use_angle: bool = False, distributed: bool = False,
                    num_processes: int = 1, config: str | None = None, overrides: Sequence[str] = (),
                    deepspeed: str | None = None, **task_options: Any) -> dict[str, Any]:
    """Train `crystal_property` on structures (ase.Atoms or pymatgen Structures) and their labels.

    batch_size is per process; the labels are taken as given (per_atom=False unless passed).
    Extra keywords are `task.*` options (e.g. variant="ecomformer", preset="tiny", test_fraction=0.1);
    `config` / `overrides` give any other setting (CLI syntax). Returns the final eval and test
    metrics and the run paths (on the main process; {} on the other ranks of a launched run).
    """
    if use_angle:
        logger.warning("use_angle has no effect: ComFormer encodes angles through the edge-lattice cosines "
                       "(use_lattice), not an ALIGNN line graph")
    data = write_structures_extxyz(strucs, labels, Path(output_dir) / "data" / "structures.extxyz", ids=ids)
    per_atom = task_options.pop("per_atom", False)
    cfg = _build_config(data_path=str(data), target="target", per_atom=per_atom, batch_size=batch_size,
                        n_epochs=n_epochs, learning_rate=learning_rate, num_workers=num_workers,
                        random_seed=random_seed, output_dir=output_dir, cache_graphs=cache_graphs,
                        use_lattice=use_lattice, config=config, overrides=overrides, task_options=task_options)
    return _run(cfg, num_processes, distributed, deepspeed)


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
    return _run(cfg, num_processes, distributed, deepspeed)
