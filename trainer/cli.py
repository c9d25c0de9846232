"""`trainer` console script: train, export, plot, tasks, config-help."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from trainer.config import ConfigError


def _train(args: argparse.Namespace) -> int:
    from trainer.config import load_config
    from trainer.distributed import PREEMPTED_EXIT_CODE
    from trainer.trainer import Trainer

    cfg = load_config(args.config, args.overrides)
    status = Trainer(cfg, deepspeed_config=args.deepspeed).fit()
    return PREEMPTED_EXIT_CODE if status == "preempted" else 0


def _export(args: argparse.Namespace) -> int:
    from trainer.export import export_run

    out = export_run(args.run_dir, out=args.out, checkpoint=args.checkpoint, weights=args.weights)
    print(out)
    return 0


def _sample(args: argparse.Namespace) -> int:
    from trainer.generate import sample_run

    stats = sample_run(args.run_dir, args.num_samples, args.out, checkpoint=args.checkpoint, weights=args.weights,
                       seed=args.seed, batch_size=args.batch_size, steps=args.steps, sampler=args.sampler,
                       length=args.length)
    if stats is not None:
        print(json.dumps({k: v for k, v in stats.items() if k in ("num_samples", "world_size", "lengths",
                                                                   "kl_samples_to_training")}))
    return 0


def _plot(args: argparse.Namespace) -> int:
    from trainer.plot import plot_run

    for path in plot_run(args.run_dir, out_dir=args.out):
        print(path)
    return 0


def _tasks(args: argparse.Namespace) -> int:  # noqa: ARG001
    from trainer.tasks import available_tasks, get_task

    for name in available_tasks():
        cls = get_task(name)
        print(f"{name}\tunit={cls.unit}\tpresets={','.join(sorted(cls.presets))}")
    return 0


def _config_help(args: argparse.Namespace) -> int:
    from trainer.config import describe_config

    print(describe_config(args.task))
    return 0


def _run_experiments(args: argparse.Namespace) -> int:
    from trainer.experiments.cli import main as run_experiments_main

    return run_experiments_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train from a YAML config with dotted key=value overrides")
    train.add_argument("config", help="experiment YAML (configs/*.yaml)")
    train.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.max_steps=100")
    train.add_argument("--deepspeed", default=None, help="DeepSpeed json (ds_configs/*.json); 'auto' values are filled")
    train.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    train.set_defaults(func=_train)

    export = sub.add_parser("export", help="consolidated fp32 (or EMA) safetensors + config from a run")
    export.add_argument("run_dir")
    export.add_argument("--out", default=None, help="output .safetensors (default RUN_DIR/export/model.safetensors)")
    export.add_argument("--checkpoint", default="latest", help="latest, best, or a checkpoint directory")
    export.add_argument("--weights", choices=["auto", "ema", "model"], default="auto",
                        help="auto: EMA weights when the run kept an EMA")
    export.set_defaults(func=_export)

    sample = sub.add_parser("sample", help="draw samples from a run (any number of processes, same samples)")
    sample.add_argument("run_dir")
    sample.add_argument("--num-samples", type=int, required=True)
    sample.add_argument("--out", required=True, help="output file (FASTA for proteins); statistics go to OUT.json")
    sample.add_argument("--steps", type=int, default=None, help="sampler steps (default: the sequence length)")
    sample.add_argument("--sampler", choices=["euler", "analytic"], default="analytic")
    sample.add_argument("--length", type=int, default=None, help="fixed length (default: drawn from the training data)")
    sample.add_argument("--seed", type=int, default=0, help="sample k uses a generator seeded by (seed, k)")
    sample.add_argument("--batch-size", type=int, default=16)
    sample.add_argument("--checkpoint", default="latest", help="latest, best, or a checkpoint directory")
    sample.add_argument("--weights", choices=["auto", "ema", "model"], default="auto")
    sample.set_defaults(func=_sample)

    plot = sub.add_parser("plot", help="PNG curves of loss, lr and eval metrics from metrics.jsonl")
    plot.add_argument("run_dir")
    plot.add_argument("--out", default=None, help="output folder (default RUN_DIR/plots)")
    plot.set_defaults(func=_plot)

    tasks = sub.add_parser("tasks", help="list registered tasks")
    tasks.set_defaults(func=_tasks)

    chelp = sub.add_parser("config-help", help="every config key with its default and meaning")
    chelp.add_argument("--task", default=None)
    chelp.set_defaults(func=_config_help)

    from trainer.experiments.cli import add_arguments as add_run_experiments_arguments

    runexp = sub.add_parser("run-experiments", help="run a grid of experiments over GPU/CPU slots or as a SLURM array")
    add_run_experiments_arguments(runexp)
    runexp.set_defaults(func=_run_experiments)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("accelerate", "deepspeed", "DeepSpeed", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"trainer: config error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
