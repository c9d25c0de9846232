"""Crystal property quality and CPU training throughput: test MAE of `crystal_property` next to the
per-element linear baseline, and atoms/s of training.

Datasets: mlearn Si and Mo (energy per atom, the given training.json / test.json files, fetched once with
their checksums by `${fetch:NAME}`, see `trainer data list`; `--data FOLDER` reads FOLDER/mlearn/{Si,Mo}/
instead) and the bundled jarvis_bandgap_50 (OptB88vdW band gap, 80/10/10 split by id hash). Each runs
`trainer train configs/crystals/comformer_tiny.yaml` in-process with the dataset's overrides, one
process; the test MAE is what the run writes to RUN_DIR/test/metrics.json. Throughput is atoms/s
over the logged training steps (structures/s x mean atoms per training structure).

    python benchmarks/crystal_quality.py [--epochs 150] [--preset tiny] [--out BENCH_DIR] [--data FOLDER]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_report import command_line, cpu_model, utc_now  # noqa: E402

# mlearn: the public files through the fetch cache (resolved when the config loads); JARVIS: the bundled sample
DATASETS = {
    "mlearn Si (energy/atom, eV)": ["task.data_path=${fetch:mlearn_si_training}", "task.test_path=${fetch:mlearn_si_test}"],
    "mlearn Mo (energy/atom, eV)": ["task.data_path=${fetch:mlearn_mo_training}", "task.test_path=${fetch:mlearn_mo_test}"],
    "jarvis_bandgap_50 (band gap, eV)": ["task.data_path=${crystals_sample:jarvis_bandgap_50}", "task.per_atom=false",
                                         "task.test_fraction=0.1", "train.per_device_batch_size=8"],
}


def local_datasets(folder: Path) -> None:
    """--data FOLDER: mlearn from FOLDER/mlearn/{Si,Mo}/{training,test}.json instead of the fetch cache."""
    for el in ("Si", "Mo"):
        DATASETS[f"mlearn {el} (energy/atom, eV)"] = [f"task.data_path={folder / 'mlearn' / el / 'training.json'}",
                                                      f"task.test_path={folder / 'mlearn' / el / 'test.json'}"]


def run_one(name: str, overrides: list[str], args: argparse.Namespace, work: Path) -> dict:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from trainer.config import load_config
    from trainer.core.trainer import Trainer

    out = work / name.split(" (")[0].replace(" ", "_")
    cfg = load_config(str(ROOT / "configs" / "crystals" / "comformer_tiny.yaml"), [
        f"run.output_dir={out}", "run.resume=none", "log.progress_bar=false", "log.tensorboard=false",
        f"task.cache_dir={work / 'cache'}", f"task.model_preset={args.preset}", f"train.epochs={args.epochs}",
        f"eval.every_epochs={max(1, args.epochs // 10)}", *overrides])
    start = time.perf_counter()
    trainer = Trainer(cfg)
    sizes = trainer.task.unit_sizes(trainer.data.dataset)
    trainer.fit()
    wall = time.perf_counter() - start
    test = json.loads((out / "test" / "metrics.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    rates = [r["structures_per_s"] for r in records if "structures_per_s" in r]
    rates = rates[1:] or rates  # the first window includes warm-up
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
    return {"name": name, "train": int(len(sizes)), "test": int(test["num_structures"]), "mae": test["mae"],
            "baseline_mae": test["baseline_mae"], "steps": trainer.plan.max_steps, "wall_s": wall,
            "atoms_per_s": statistics.median(rates) * float(sizes.mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=150)
    parser.add_argument("--preset", default="tiny", choices=["tiny", "paper"])
    parser.add_argument("--out", default=None, help="run directories (default: a temp folder)")
    parser.add_argument("--data", default=None, help="a folder with mlearn/{Si,Mo}/{training,test}.json (default: "
                        "the public files, fetched once into the data cache)")
    parser.add_argument("--smoke", action="store_true", help="one epoch on the bundled mlearn Si sample: checks the "
                        "script runs (its MAE means nothing)")
    args = parser.parse_args()
    if args.data:
        local_datasets(Path(args.data))
    if args.smoke:
        args.epochs, args.preset, args.out = 1, "tiny", None
        samples = ROOT / "trainer" / "families" / "crystals" / "samples"
        DATASETS.clear()
        DATASETS["bundled mlearn Si (smoke)"] = [f"task.data_path={samples / 'mlearn_Si_training.json.gz'}",
                                                 f"task.test_path={samples / 'mlearn_Si_test.json.gz'}"]
    logging.basicConfig(level=logging.WARNING)
    work = Path(args.out or tempfile.mkdtemp(prefix="crystal-bench-"))
    rows = [run_one(name, overrides, args, work) for name, overrides in DATASETS.items()]
    print(f"## Crystal property quality and CPU throughput, {utc_now()}\n")
    print(f"- Machine: {cpu_model()}; one process, CPU")
    print(f"- Command: `{command_line()}`")
    print(f"- Model: iComFormer `{args.preset}` preset, k=12 graph with lattice self-loops, L1 on standardised "
          f"targets, {args.epochs} epochs, cosine schedule, balanced batches of 16 structures (8 for JARVIS)\n")
    print("| dataset | train / test | test MAE | per-element baseline MAE | ratio | steps | wall | train atoms/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['name']} | {r['train']} / {r['test']} | {r['mae']:.4f} | {r['baseline_mae']:.4f} | "
              f"{r['mae'] / r['baseline_mae']:.2f} | {r['steps']} | {r['wall_s']:.0f} s | {r['atoms_per_s']:.0f} |")
    if args.smoke:
        print("smoke run: nothing written")


if __name__ == "__main__":
    main()
