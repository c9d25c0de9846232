"""`trainer` console script: train, export, plot, tasks, config-help."""

from __future__ import annotations

import argparse
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

    plot = sub.add_parser("plot", help="PNG curves of loss, lr and eval metrics from metrics.jsonl")
    plot.add_argument("run_dir")
    plot.add_argument("--out", default=None, help="output folder (default RUN_DIR/plots)")
    plot.set_defaults(func=_plot)

    tasks = sub.add_parser("tasks", help="list registered tasks")
    tasks.set_defaults(func=_tasks)

    chelp = sub.add_parser("config-help", help="every config key with its default and meaning")
    chelp.add_argument("--task", default=None)
    chelp.set_defaults(func=_config_help)
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
