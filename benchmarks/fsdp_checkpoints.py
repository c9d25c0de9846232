"""FSDP checkpoint cost: the sharded save against the whole-tensor save it replaced and accelerate's own.

Launched with 2 processes under FSDP2 (fully_shard over gloo on CPU), on the regression MLP of the given size
with AdamW, after 2 training steps. Each repeat times, in a rotating order (the machine may be loaded), the
model + optimizer + RNG part of a save three ways, from the first rank's start to the last rank's end (barriers):

- before: whole tensors in a plain run's files, gathered onto the main process (`get_state_dict`,
  full_state_dict, then accelerate's `save_accelerator_state`), as `BackendState.save` did up to commit 11fdf1a;
- after: this checkout's `BackendState.save_files` (the FSDP engine's sharded save, each rank writing its shards);
- native: accelerate's `save_state` with SHARDED_STATE_DICT, called directly.

It also times a whole checkpoint of this checkout (`Trainer.save`: EMA, manifest with hashes, rename) and, on
the main process, the on-demand conversion a resume under another backend makes: the shards read whole
(`convert.sharded_fsdp_state`) and written in the topology-free form (`convert.convert`).

    accelerate launch --config_file accelerate_configs/fsdp.yaml benchmarks/fsdp_checkpoints.py \\
        --hidden 2048 --depth 2 --repeats 7 [--out BENCHMARKS.md]

Run without a launcher (`python benchmarks/fsdp_checkpoints.py --smoke`), it launches itself that way.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_report import command_line, cpu_model, publish_section, utc_now  # noqa: E402
from checkpoints import add_size_args, folder_bytes, regression_trainer, smoke_sized  # noqa: E402

TOPIC = "Checkpoints: save cost, FSDP, conversion at resume"
"""The `## ` topic of BENCHMARKS.md this benchmark's sections go under (`bench_report.write_section`)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_args(parser, hidden=2048, depth=2, repeats=7)
    args = smoke_sized(parser.parse_args())

    import torch
    from accelerate.checkpointing import save_accelerator_state
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from trainer.core.checkpoint import convert
    from trainer.core.distributed import unwrap_model
    from trainer.core.engine import FSDPEngine

    # one folder for every rank (the launcher's port tells runs apart)
    work = Path(tempfile.gettempdir()) / f"fsdp-ckpt-bench-{os.environ.get('MASTER_PORT', '0')}"
    trainer = regression_trainer(args.hidden, args.depth, work / "run", per_device_batch_size=8)
    micro = trainer.data.micro_batches(0)  # 2 optimizer steps (not fit(): it ends the process group)
    for _ in range(2):
        trainer.train_step([next(micro) for _ in range(trainer.plan.grad_accum_steps)])
        trainer.state.step += 1
    acc, backend = trainer.checkpointer.acc, trainer.checkpointer.backend
    assert isinstance(backend.engine, FSDPEngine), "launch with accelerate_configs/fsdp.yaml and 2 processes"
    model, optimizer = unwrap_model(acc, trainer.model), backend.engine.torch_optimizer
    params = sum(p.numel() for p in model.parameters())

    def before(folder: Path) -> None:  # commit 11fdf1a's BackendState.save (universal.full_state + accelerate's writer)
        weights, named = get_state_dict(model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        optim_state = {}
        if named:
            index = {name: i for i, name in enumerate(n for names in backend.param_names for n in names)}
            optim_state = {"state": {index[name]: entry for name, entry in named["state"].items()},
                           "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                                            for group in named["param_groups"]]}

        class Saved:
            def state_dict(self):
                return optim_state
        save_accelerator_state(str(folder), [weights], [Saved()], [], acc._dataloaders, acc.process_index, acc.step,
                               acc.scaler, safe_serialization=True)

    def native(folder: Path) -> None:
        acc.state.fsdp_plugin.set_state_dict_type("SHARDED_STATE_DICT")
        acc.save_state(str(folder), safe_serialization=True)

    savers = {"before": before, "after": backend.save_files, "native": native}
    times: dict[str, list[float]] = {name: [] for name in [*savers, "checkpoint"]}
    sizes: dict[str, int] = {}
    names = list(savers)
    for repeat in range(args.repeats + 1):  # the first round warms up and is not counted
        order = names[repeat % 3:] + names[:repeat % 3]
        for name in order:
            folder = work / f"{name}_{repeat}"
            if acc.is_main_process:
                folder.mkdir(parents=True)
            acc.wait_for_everyone()
            start = time.perf_counter()
            savers[name](folder)
            acc.wait_for_everyone()
            if repeat:
                times[name].append(time.perf_counter() - start)
            if acc.is_main_process:
                sizes[name] = folder_bytes(folder)
                if name != "after" or repeat < args.repeats:
                    shutil.rmtree(folder)
        acc.wait_for_everyone()
        start = time.perf_counter()
        path = trainer.save()
        if repeat:
            times["checkpoint"].append(time.perf_counter() - start)
        sizes["checkpoint"] = folder_bytes(path)
    sharded = work / f"after_{args.repeats}"
    rows = []
    if acc.is_main_process:
        saved = {"backend": convert.FSDP, convert.SHARDED: True, "param_names": backend.param_names}
        read_s, convert_s = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            convert.sharded_fsdp_state(sharded, backend.param_names)
            read_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            convert.convert(sharded, work / "universal", saved, backend.param_names)
            convert_s.append(time.perf_counter() - start)
        native_s, native_b = statistics.median(times["native"]), sizes["native"]

        def row(what: str, seconds: list[float], size: int | None) -> str:
            s = statistics.median(seconds)
            ratio = f"{s / native_s:.2f}x time" + (f", {size / native_b:.2f}x bytes" if size else "")
            spread = f"{min(seconds):.3f}-{max(seconds):.3f}"
            return f"| {what} | {s:.3f} ({spread}) | {size if size is not None else ''} | {ratio} |"
        rows = [row("before: whole tensors gathered onto the main process (11fdf1a)", times["before"], sizes["before"]),
                row("after: this checkout's save, each rank writes its shards (DCP)", times["after"], sizes["after"]),
                row("native: accelerate's save_state, SHARDED_STATE_DICT", times["native"], native_b),
                row("after, whole checkpoint (+ EMA gathered, manifest hashes, rename)", times["checkpoint"],
                    sizes["checkpoint"]),
                row("resume elsewhere: read the shards whole (main process)", read_s, None),
                row("resume elsewhere: shards -> topology-free form (main process)", convert_s,
                    folder_bytes(work / "universal"))]
    acc.wait_for_everyone()
    acc.end_training()
    if not acc.is_main_process:
        return
    shutil.rmtree(work, ignore_errors=True)
    lines = [f"## FSDP checkpoint cost benchmark, {utc_now()}", "",
             f"- Machine: {cpu_model()}, torch {torch.__version__}, 1 thread a process; load average "
             f"{os.getloadavg()[0]:.1f} at the end (the machine was shared: the three saves are interleaved in a "
             f"rotating order, each repeat)",
             f"- Model: regression MLP hidden {args.hidden}, depth {args.depth} ({params:,} parameters), AdamW, EMA; "
             f"FSDP2 over gloo, {acc.num_processes} processes; median (min-max) of {args.repeats} after a warm-up",
             f"- Command: `{command_line()}`", "",
             "| what | seconds | bytes | vs accelerate's native sharded save |", "|---|---|---|---|", *rows, "",
             "The save rows time model, optimizer and RNG states from the first rank's start to the last rank's end. "
             "The conversion runs only when a run resumes an FSDP checkpoint under one process, DDP or DeepSpeed "
             "(FSDP at any number of processes loads the shards, DCP resharding them), once, on the main process; "
             "its folder is removed after the load. The whole-checkpoint row adds what every backend's checkpoint "
             "adds: the EMA (still gathered whole onto the main process, `ema.safetensors`), the manifest's sha256 "
             "of every file and the rename. `before` is commit 11fdf1a's save, reproduced in the script with the "
             "same calls so that the three saves interleave in one process pair."]
    publish_section("\n".join(lines) + "\n", args.out, args.smoke, topic=TOPIC)
    print(json.dumps({k: statistics.median(v) for k, v in times.items()}))


def launch_self() -> int:
    """Run this script under `accelerate launch` with the FSDP config and 2 processes, on a free port."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    accelerate = Path(sys.executable).parent / "accelerate"
    return subprocess.call([str(accelerate), "launch", "--config_file", str(ROOT / "accelerate_configs" / "fsdp.yaml"),
                            "--num_processes", "2", "--main_process_port", str(port), __file__, *sys.argv[1:]])


if __name__ == "__main__":
    if "LOCAL_RANK" not in os.environ:
        sys.exit(launch_self())
    main()
