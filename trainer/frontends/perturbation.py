"""GEARS' Python API on the Trainer: `train_multi_gpu` (the seed's signature), `predict`, `plot_condition`.

`train_multi_gpu(pert_data_path, dataset_name, split_config, args, n_gpus=None, gpu_ids=None)` takes the
seed's arguments (`split_config` as GEARS' `prepare_split`, `args` with `model_config` as GEARS'
`model_initialize`, the per-device `batch_size`, `epochs`, `lr`, `save_path`) and runs the
`perturbation_gears` task on the Trainer: exact resume, checkpoints, the best model by validation
`mse_de`, logging and trackers, each validation/test condition counted once whatever the world size.

Processes: `n_gpus=None` means every visible GPU (`gpu_ids` when given); with several (or with
`gpu_ids`) the core's `trainer.api.train` starts them through `torch.distributed.run --standalone` (a
free port: no fixed MASTER_PORT, no mp.spawn, nothing left to kill by name) on a config file written to
`save_path/launch_config.yaml`, which `trainer train` repeats. On a machine without GPUs `n_gpus=N`
starts N CPU processes (gloo) and `n_gpus=None` trains in this process. When the calling script itself
runs under `torchrun` or `accelerate launch` (`trainer.api.under_launcher()`) nothing is started: every
process trains in place and the launcher's world size wins.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trainer.api import RunResult, train, under_launcher
from trainer.config import Config, ConfigError, load_config
from trainer.errors import CheckpointError, DataError
from trainer.registry import get_family
from trainer.rundir import RunDir

TASK = "perturbation_gears"
"""The task these functions train (its family is found through the registry)."""

logger = logging.getLogger(__name__)

__all__ = ["load_gears_model", "plot_condition", "predict", "read_results", "train_multi_gpu"]

SPLIT_KEYS = {"split": "split", "seed": "split_seed", "train_gene_set_size": "train_gene_set_size",
              "combo_seen2_train_frac": "combo_seen2_train_frac",
              "combo_single_split_test_set_fraction": "test_fraction", "val_fraction": "val_fraction",
              "split_dict_path": "custom_split_path", "custom_split_path": "custom_split_path"}
"""GEARS' `prepare_split` keywords -> task options."""
MODEL_KEYS = {"hidden_size": "hidden_size", "num_go_gnn_layers": "num_go_gnn_layers",
              "num_gene_gnn_layers": "num_gene_gnn_layers", "uncertainty": "uncertainty",
              "uncertainty_reg": "uncertainty_reg", "direction_lambda": "direction_lambda",
              "num_similar_genes_go_graph": "go_top_k", "num_similar_genes_co_express_graph": "coexpression_top_k",
              "coexpress_threshold": "coexpression_threshold", "coexpress_first_cell_only": "coexpress_first_cell_only"}
"""GEARS' `model_initialize` keywords -> task options."""
IGNORED_MODEL_KEYS = {"decoder_hidden_size": "GEARS stores it but its model never uses it"}
UNSUPPORTED_MODEL_KEYS = {"G_go", "G_go_weight", "G_coexpress", "G_coexpress_weight", "no_perturb"}
ARGS_KEYS = ("model_config", "batch_size", "test_batch_size", "epochs", "lr", "weight_decay", "save_path", "seed",
             "num_workers", "gene2go_path", "cache_dir", "preset", "config", "overrides")
"""Keys of `args` (the seed's, plus a few of ours: seed, num_workers, gene2go_path, cache_dir, preset, config, overrides)."""


def _check_keys(given: Mapping[str, Any], known: Sequence[str], where: str) -> None:
    for key in given:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=2)
            hint = f" Did you mean: {', '.join(close)}?" if close else ""
            raise ConfigError(f"{where}: unknown key {key!r}.{hint} Known keys: {', '.join(known)}")


def _task_options(split_config: Mapping[str, Any], model_config: Mapping[str, Any]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    _check_keys(split_config, list(SPLIT_KEYS), "split_config")
    for key, value in split_config.items():
        options[SPLIT_KEYS[key]] = value
    for key in model_config:
        if key in UNSUPPORTED_MODEL_KEYS:
            raise ConfigError(f"args['model_config'][{key!r}] is not supported: the graphs are built from the data "
                              f"and task.go_*/coexpression_* options (give gene2go_path for another GO mapping)")
    _check_keys(model_config, [*MODEL_KEYS, *IGNORED_MODEL_KEYS], "args['model_config']")
    for key, value in model_config.items():
        if key in IGNORED_MODEL_KEYS:
            logger.warning("args['model_config'][%r] is ignored: %s", key, IGNORED_MODEL_KEYS[key])
            continue
        options[MODEL_KEYS[key]] = value
    return options


def build_gears_config(pert_data_path: str | Path, dataset_name: str | None, split_config: Mapping[str, Any],
                       args: Mapping[str, Any]) -> Config:
    """The Trainer config of a `train_multi_gpu` call (the `paper` preset under the given values)."""
    _check_keys(args, ARGS_KEYS, "args")
    data_path = Path(pert_data_path) / dataset_name if dataset_name else Path(pert_data_path)
    if not data_path.exists():
        raise DataError(f"{data_path}: no such data folder or file (pert_data_path/dataset_name must hold GEARS' "
                        f"perturb_processed.h5ad; GEARS' named sets such as 'norman' are not downloaded here)")
    task = _task_options(split_config, args.get("model_config", {}))
    opts: dict[str, Any] = {"task.name": TASK, "task.preset": args.get("preset", "paper"),
                            "task.data_path": str(data_path.resolve()),
                            "run.output_dir": str(Path(args.get("save_path", "runs/gears")).resolve()),
                            "log.progress_bar": False}
    for key, target in (("batch_size", "train.per_device_batch_size"), ("epochs", "train.epochs"), ("lr", "optim.lr"),
                        ("weight_decay", "optim.weight_decay"), ("seed", "run.seed"), ("num_workers", "data.num_workers"),
                        ("test_batch_size", "task.eval_cells_per_forward"), ("gene2go_path", "task.gene2go_path"),
                        ("cache_dir", "task.cache_dir")):
        if args.get(key) is not None:
            opts[target] = args[key]
    opts.update({f"task.{k}": v for k, v in task.items() if v is not None})
    cli = [f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in opts.items()]
    return load_config(args.get("config"), [*cli, *args.get("overrides", ())])


def plan_processes(n_gpus: int | None, gpu_ids: Sequence[int] | None, visible_gpus: int) -> tuple[int, str | None]:
    """(processes to start, CUDA_VISIBLE_DEVICES for them or None) for the seed's n_gpus / gpu_ids."""
    if gpu_ids is not None:
        gpu_ids = [int(g) for g in gpu_ids]
        if not gpu_ids:
            raise ConfigError("gpu_ids is empty: give the GPU indices to use, or None for every visible GPU")
        if visible_gpus and max(gpu_ids) >= visible_gpus:
            raise ConfigError(f"gpu_ids {gpu_ids}: this machine has {visible_gpus} visible GPUs (0..{visible_gpus - 1})")
        if not visible_gpus:
            raise ConfigError(f"gpu_ids {gpu_ids} given but no GPU is visible (use n_gpus=N for N CPU processes)")
        if n_gpus is not None and n_gpus != len(gpu_ids):
            raise ConfigError(f"n_gpus={n_gpus} but {len(gpu_ids)} gpu_ids {gpu_ids}")
        return len(gpu_ids), ",".join(map(str, gpu_ids))
    if n_gpus is None:
        return max(visible_gpus, 1), None
    if n_gpus < 1:
        raise ConfigError(f"n_gpus must be >= 1 (or None for every visible GPU), got {n_gpus}")
    if visible_gpus and n_gpus > visible_gpus:
        raise ConfigError(f"n_gpus={n_gpus} but only {visible_gpus} GPUs are visible")
    return n_gpus, None


def read_results(run_dir: str | Path) -> dict[str, Any]:
    """Final eval and test metrics, the baselines of the test report and the paths of a finished run."""
    return _results(RunResult.read(run_dir))


def _results(result: RunResult) -> dict[str, Any]:
    run = RunDir(result.run_dir)
    report = run.test / "metrics.json"
    baselines = json.loads(report.read_text()).get("baselines", {}) if report.is_file() else {}
    return {"run_dir": str(run.root), "world_size": result.world_size, "eval": dict(result.eval_metrics),
            "test": dict(result.test_metrics), "test_weights_step": result.test_weights_step,
            "baselines": baselines, "report": str(run.test), "checkpoints": str(run.checkpoints)}


def train_multi_gpu(pert_data_path: str | Path, dataset_name: str | None, split_config: Mapping[str, Any],
                    args: Mapping[str, Any], n_gpus: int | None = None, gpu_ids: Sequence[int] | None = None
                    ) -> dict[str, Any]:
    """Train GEARS on `pert_data_path/dataset_name` (a folder with perturb_processed.h5ad) over several processes.

    split_config: GEARS' prepare_split keywords (split, seed, train_gene_set_size, combo_seen2_train_frac,
        combo_single_split_test_set_fraction, split_dict_path).
    args: model_config (GEARS' model_initialize keywords: hidden_size, num_go_gnn_layers, num_gene_gnn_layers,
        uncertainty, uncertainty_reg, direction_lambda, ...; decoder_hidden_size is ignored with a warning),
        batch_size (per device), epochs, lr, save_path (the run directory); also weight_decay, seed,
        test_batch_size (cells per eval forward), num_workers, gene2go_path, cache_dir, preset ("paper"),
        config (a YAML file under these values) and overrides (["section.key=value", ...]).
    n_gpus / gpu_ids: see the module docstring.

    Returns {"run_dir", "world_size", "eval", "test" (metrics incl. per subgroup, of the best checkpoint by
    validation mse_de), "test_weights_step" (its step), "baselines", "report", "checkpoints"} on the main
    process; {} on the other processes of a launcher.
    """
    cfg = build_gears_config(pert_data_path, dataset_name, split_config, args)
    if under_launcher():
        if n_gpus is not None or gpu_ids is not None:
            logger.warning("running under a launcher (WORLD_SIZE=%s): n_gpus/gpu_ids are ignored, the launcher's "
                           "processes train", os.environ.get("WORLD_SIZE", "1"))
        processes, cuda_visible = 1, None
    else:
        import torch

        processes, cuda_visible = plan_processes(n_gpus, gpu_ids, torch.cuda.device_count())
    devices = [int(g) for g in cuda_visible.split(",")] if cuda_visible is not None else None
    result = train(cfg, processes, gpu_ids=devices)
    return _results(result) if result.main_process else {}


# ---------------------------------------------------------------------------------------------- inference


def load_gears_model(run_or_export_dir: str | Path, checkpoint: str = "best") -> tuple[Any, Any]:
    """(model in eval mode, its task with statistics attached) from a run directory, a checkpoint or an export.

    A run directory uses its `best` checkpoint (GEARS' best model by validation mse_de), else `latest`.
    """
    import yaml

    from trainer.api import consolidated_weights, load_exported, read_task_stats
    from trainer.config import config_from_dict
    from trainer.registry import get_task

    path = Path(run_or_export_dir)
    export = path if path.suffix == ".safetensors" else path / "model.safetensors"
    if export.is_file() and export.with_name(export.stem + ".config.yaml").is_file():
        model, cfg = load_exported(export)
        from safetensors import safe_open

        with safe_open(str(export), framework="pt") as f:
            embedded = (f.metadata() or {}).get("task_stats")
        stats = json.loads(embedded) if embedded else read_task_stats(export.parent)
    else:
        try:
            weights, ckpt_dir = consolidated_weights(path, checkpoint)
        except CheckpointError:
            if checkpoint != "best":
                raise
            weights, ckpt_dir = consolidated_weights(path, "latest")
        config_file = next((p for p in (path / "config.yaml", ckpt_dir.parent.parent / "config.yaml") if p.is_file()), None)
        if config_file is None:
            raise DataError(f"{path}: no config.yaml beside the checkpoints (a run directory or an export is needed)")
        cfg = config_from_dict(yaml.safe_load(config_file.read_text()))
        stats = read_task_stats(ckpt_dir)
        model = None
    if cfg.task.name != TASK:
        raise ConfigError(f"{path} is a {cfg.task.name!r} run, not {TASK}")
    task = get_task(cfg.task.name)(cfg.task, seed=cfg.run.seed)
    task.attach_stats(stats)
    if model is None:
        model = task.build_model(stats)
        model.load_state_dict(weights, strict=True)
    return model.eval(), task


def _perturbation_genes(perturbation: str | Sequence[str]) -> list[str]:
    genes = [g for g in perturbation.split("+")] if isinstance(perturbation, str) else [str(g) for g in perturbation]
    return [g for g in genes if g != "ctrl"]


def _control_inputs(task: Any, num_control_cells: int, seed: int, data_path: str | None) -> tuple[Any, np.ndarray, np.ndarray]:
    """(data, control rows, their expression [n, G]) drawn with a seeded generator from the run's data."""
    import dataclasses

    from trainer.seeding import derive_rng

    cfg = dataclasses.replace(task.cfg, data_path=data_path) if data_path else task.cfg
    data, _ = get_family(TASK).task.load_perturbation_data(cfg)
    if data.gene_names.tolist() != list(task.stats["gene_names"]):
        raise DataError(f"{data.source}: its genes differ from the {len(task.stats['gene_names'])} genes the model was "
                        f"trained on (give the training data as data_path)")
    if num_control_cells < 1:
        raise ConfigError(f"num_control_cells must be >= 1, got {num_control_cells}")
    rows = data.ctrl_rows
    if len(rows) > num_control_cells:
        rows = np.sort(derive_rng("gears/predict-controls", seed).choice(rows, size=num_control_cells, replace=False))
    return data, rows, data.dense_rows(rows)


def _predict_profiles(model: Any, task: Any, perturbations: Sequence[list[str]], controls: np.ndarray, device: str
                      ) -> list[tuple[np.ndarray, np.ndarray | None]]:
    import torch

    family = get_family(TASK).task
    cells_per_forward, check_perturbation, predict_cells = (family.cells_per_forward, family.check_perturbation,
                                                            family.predict_cells)
    index = {g: i for i, g in enumerate(task.stats["pert_genes"])}
    x = torch.from_numpy(controls).to(device)
    model = model.to(device)
    out = []
    with torch.no_grad():
        for genes in perturbations:
            check_perturbation(genes, index)
            if len(genes) > 2:
                raise ConfigError(f"perturbation {genes}: GEARS predicts singles and doubles (at most 2 genes)")
            pert = torch.full((x.size(0), 2), -1, dtype=torch.long, device=device)
            pert[:, : len(genes)] = torch.tensor([index[g] for g in genes], device=device)
            pred, logvar = predict_cells(model, x, pert, cells_per_forward(task.cfg, x.size(-1)))
            out.append((pred.double().cpu().numpy(), None if logvar is None else logvar.double().cpu().numpy()))
    return out


def predict(run_or_export_dir: str | Path, perturbations: Sequence[str | Sequence[str]], per_cell: bool = False,
            num_control_cells: int = 300, seed: int = 0, checkpoint: str = "best", data_path: str | None = None,
            device: str = "cpu") -> Any:
    """Predicted expression after each perturbation, as a pandas DataFrame with the gene names as columns.

    perturbations: [['A'], ['A', 'B'], ...] (or 'A', 'A+B'); each gene must be a perturbable gene of the model.
    The model runs on `num_control_cells` control cells of the run's data (drawn with `seed`; GEARS: 300)
    and, as in GEARS' predict, a perturbation's profile is the mean over them. Rows are named 'A', 'A+B'.
    per_cell=True: one row per (perturbation, control cell row in the data) instead of the mean.
    With the uncertainty head the index gets a last level `stat` with `mean` and `logvar` (the predicted
    per-gene log-variance, averaged over the cells; GEARS' loss weights errors by exp(-logvar)).
    data_path: the data whose control cells are used (default: the run's task.data_path).
    """
    import pandas as pd

    model, task = load_gears_model(run_or_export_dir, checkpoint)
    _, rows, controls = _control_inputs(task, num_control_cells, seed, data_path)
    genes_list = [_perturbation_genes(p) for p in perturbations]
    results = _predict_profiles(model, task, genes_list, controls, device)
    columns = pd.Index(task.stats["gene_names"], name="gene")
    frames, keys = [], []
    for genes, (pred, logvar) in zip(genes_list, results):
        name = "+".join(genes)
        stats = {"mean": pred} if logvar is None else {"mean": pred, "logvar": logvar}
        for stat, values in stats.items():
            if per_cell:
                frame = pd.DataFrame(values, columns=columns, index=pd.Index(rows, name="cell"))
            else:
                frame = pd.DataFrame(values.mean(axis=0, keepdims=True), columns=columns)
            frames.append(frame)
            keys.append((name, stat))
    table = pd.concat(frames, keys=keys, names=["perturbation", "stat"])
    if not per_cell:
        table = table.droplevel(-1)  # the RangeIndex of the one-row frames
    else:
        table = table.reorder_levels(["perturbation", "cell", "stat"])
    if results and results[0][1] is None:
        table = table.droplevel("stat")
    return table


def plot_condition(run_or_export_dir: str | Path, perturbation: str | Sequence[str], out_png: str | Path,
                   num_control_cells: int = 300, seed: int = 0, checkpoint: str = "best", data_path: str | None = None
                   ) -> Path:
    """PNG of the predicted vs true change from control of a condition's top-20 DE genes (with the spread of
    its cells and the additive baseline); the condition must have cells in the data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    family = get_family(TASK)
    as_condition, format_condition = family.conditions.as_condition, family.conditions.format_condition
    fit_training_baselines, plot_de_changes = family.task.fit_training_baselines, family.task.plot_de_changes
    model, task = load_gears_model(run_or_export_dir, checkpoint)
    data, _, controls = _control_inputs(task, num_control_cells, seed, data_path)
    genes = _perturbation_genes(perturbation)
    condition = as_condition(genes)
    if condition not in data.condition_index:
        raise DataError(f"{data.source}: condition {format_condition(condition)!r} has no cells, so there is no true "
                        f"change to plot (use predict() for a prediction alone)")
    de = np.asarray(data.de_idx.get(condition, ()), dtype=np.int64)
    if de.size == 0:
        raise DataError(f"{data.source}: condition {format_condition(condition)!r} has no DE genes")
    (pred, _), = _predict_profiles(model, task, [genes], controls, "cpu")
    ctrl = np.asarray(task.stats["ctrl_mean"], dtype=np.float64)
    cells = data.dense_rows(data.rows_of(condition)).astype(np.float64)
    baselines = fit_training_baselines(data, task.stats["split"]["train"])
    split = task.stats["split"]
    where = next((s for s in ("train", "val", "test") if format_condition(condition) in split[s]), "not in the split")
    fig, ax = plt.subplots(figsize=(7, 3.2))
    plot_de_changes(ax, data.gene_names[de].tolist(), cells.mean(axis=0)[de] - ctrl[de], pred.mean(axis=0)[de] - ctrl[de],
                    f"{'+'.join(genes)} ({where}): top {de.size} DE genes, {len(cells)} cells",
                    extra={"additive": baselines.predict(condition, "additive")[de] - ctrl[de]},
                    cell_deltas=cells[:, de] - ctrl[de])
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
