"""Checkpoint cost: what a save writes and how long it takes, and what a resume under another layout adds.

Resume anywhere converts a checkpoint on demand (trainer/core/checkpoint/convert.py) instead of writing a
topology-free copy at every save, so a save writes what it did before. This measures, in one process on
the regression MLP of the given size: the save (bytes, seconds; median of --repeats), the conversion of
that checkpoint into the topology-free form (seconds, bytes) and the load of either into the running
model and optimizer. `--zero CKPT` also converts a ZeRO checkpoint (DeepSpeed's ds_to_universal).
`--before DIR` measures the save of the checkout in DIR as well (a commit before the change). The ZeRO
checkpoint of the figures in BENCHMARKS.md: `accelerate launch --config_file accelerate_configs/zero2.yaml
scripts/train.py configs/regression/tiny.yaml task.hidden=1024 task.depth=4 task.num_train=64
train.max_steps=2 train.ema_decay=0.99 run.output_dir=/tmp/zero2`.

    git worktree add /tmp/before b5c8d27~1
    python benchmarks/checkpoints.py --hidden 1024 --depth 4 --before /tmp/before [--zero RUN/checkpoints/step_N] \
        [--out BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_report import command_line, cpu_model, publish_section, utc_now  # noqa: E402

TOPIC = "Checkpoints: save cost, FSDP, conversion at resume"
"""The `## ` topic of BENCHMARKS.md this benchmark's sections go under (`bench_report.write_section`)."""


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def add_size_args(parser: argparse.ArgumentParser, hidden: int, depth: int, repeats: int) -> None:
    """The model size, the repeats, --out and --smoke (what this and benchmarks/fsdp_checkpoints.py take)."""
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--depth", type=int, default=depth)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--out", type=Path, help="write the section into this markdown file")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one repeat, nothing written")


def smoke_sized(args: argparse.Namespace) -> argparse.Namespace:
    if args.smoke:
        args.hidden, args.depth, args.repeats, args.out = 16, 1, 1, None
    return args


def regression_trainer(hidden: int, depth: int, output_dir: Path, per_device_batch_size: int = 16):
    """The regression MLP of the given size with AdamW and an EMA, 2 steps of 64 samples, saving only when told."""
    import torch

    from trainer.config import load_config
    from trainer.core.trainer import Trainer

    torch.set_num_threads(1)
    overrides = [f"task.hidden={hidden}", f"task.depth={depth}", "task.num_train=64", "task.num_eval=16",
                 "train.max_steps=2", f"train.per_device_batch_size={per_device_batch_size}", "train.ema_decay=0.99",
                 "eval.every_steps=0", "ckpt.every_steps=0", "ckpt.keep_last=2", "log.progress_bar=false",
                 "log.tensorboard=false", "run.resume=none", f"run.output_dir={output_dir}"]
    return Trainer(load_config(str(ROOT / "configs" / "regression" / "tiny.yaml"), overrides))


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_args(parser, hidden=1024, depth=4, repeats=5)
    parser.add_argument("--zero", type=Path, help="a ZeRO checkpoint folder to convert as well")
    parser.add_argument("--before", type=Path, help="a checkout before the change: measure its save too")
    parser.add_argument("--save-only", action="store_true", help=argparse.SUPPRESS)  # what --before runs
    args = smoke_sized(parser.parse_args())

    import torch
    from accelerate.state import AcceleratorState, GradientState, PartialState

    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
    trainer = regression_trainer(args.hidden, args.depth, work / "run")
    trainer.fit()
    params = sum(p.numel() for p in trainer.model.parameters())
    path = trainer.save()
    save_s = timed(trainer.save, args.repeats)
    save_bytes = folder_bytes(path)
    rows = [("save (native files; nothing topology-free is written)", save_s, save_bytes)]
    if args.save_only:
        print(json.dumps([save_s, save_bytes]))
        return
    if args.before is not None:
        proc = subprocess.run([sys.executable, __file__, "--save-only", "--hidden", str(args.hidden), "--depth",
                               str(args.depth), "--repeats", str(args.repeats)], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(args.before)}, check=True)
        before_s, before_bytes = json.loads(proc.stdout.strip().splitlines()[-1])
        commit = subprocess.run(["git", "-C", str(args.before), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or args.before.name
        rows.insert(0, (f"save before the change ({commit})", before_s, before_bytes))
    from trainer.core.checkpoint import convert

    saved = json.loads((path / "trainer_state.json").read_text())
    out = work / "universal"
    backend = trainer.checkpointer.backend
    convert_s = timed(lambda: convert.convert(path, out, saved, backend.param_names), args.repeats)
    native_load = timed(lambda: backend.engine.load_checkpoint(path, saved, backend.param_names), args.repeats)
    rows.append(("resume, same layout: native load", native_load, None))
    rows.append(("resume, other layout: convert DDP/plain -> topology-free", convert_s, folder_bytes(out)))
    rows.append(("resume, other layout: load the topology-free form", timed(
        lambda: backend.engine.load_universal(out, saved, backend.param_names), args.repeats), None))
    if args.zero is not None:
        zsaved = json.loads((args.zero / "trainer_state.json").read_text())
        zout = work / "universal_zero"
        rows.append((f"resume, other layout: convert ZeRO-{zsaved.get('zero_stage', '?')} x "
                     f"{zsaved['world_size']} (ds_to_universal)",
                     timed(lambda: convert.convert(args.zero, zout, zsaved, backend.param_names), args.repeats),
                     folder_bytes(zout)))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
    shutil.rmtree(work, ignore_errors=True)

    lines = [f"## Checkpoint cost benchmark, {utc_now()}", "",
             f"- Machine: {cpu_model()}, torch {torch.__version__}, 1 thread; load average "
             f"{os.getloadavg()[0]:.1f} at the end",
             f"- Model: regression MLP hidden {args.hidden}, depth {args.depth} ({params:,} parameters), AdamW, EMA; "
             f"one process; median of {args.repeats}",
             f"- Command: `{command_line()}`", "",
             "| what | seconds | bytes | vs the native save |", "|---|---|---|---|"]
    for what, seconds, size in rows:
        ratio = f"{seconds / save_s:.2f}x time" + (f", {size / save_bytes:.2f}x bytes" if size else "")
        lines.append(f"| {what} | {seconds:.3f} | {size if size is not None else ''} | {ratio} |")
    lines += ["", "Ratios are against this checkout's save, which writes the files it wrote before plus the optimizer's "
              "parameter names in trainer_state.json (the difference in bytes); the time differs by the machine's noise. "
              "The conversion runs only when a run resumes a checkpoint "
              "of another layout (backend, ZeRO stage or number of DeepSpeed processes), once, on the main process; "
              "its folder is removed after the load."]
    section = "\n".join(lines) + "\n"
    publish_section(section, args.out, args.smoke, topic=TOPIC)


if __name__ == "__main__":
    main()
