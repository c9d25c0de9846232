"""`trainer` console script: train, align, export, import, sample, plot, tasks, config-help, new-family, run-experiments
(sweep).

Torch-heavy modules are imported inside the commands that need them, and only once the config is
checked: `trainer --help`, `trainer tasks`, `trainer config-help`, `trainer sample RUN_DIR --help` and a
config error work from the tasks' light specs (`trainer.registry.get_spec`) and import no torch. Errors in
the user's input (config, data, checkpoints) print one line; `--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from trainer.errors import ConfigError, TrainerError

if TYPE_CHECKING:
    from trainer.config import Config
    from trainer.task import TaskSpec


def _train(args: argparse.Namespace) -> int:
    from trainer.config import load_config

    return _fit(load_config(args.config, args.overrides), args)  # a config error stops here, before torch is imported


def _align(args: argparse.Namespace) -> int:
    from trainer.config import align_config

    return _fit(align_config(args.run_dir, args.overrides), args)


def _fit(cfg: Config, args: argparse.Namespace) -> int:
    """Train `cfg` here, on --nproc local processes, or as one rank of a launcher's job; the run's exit status."""
    from trainer.core.watchdog import arm_exit_guard, started_by_launcher

    args.output_dir = cfg.run.output_dir  # where a rank's unexpected error keeps its traceback (main)
    elastic = getattr(args, "nnodes", None)
    if elastic is not None and not started_by_launcher():
        from trainer.core.elastic_launch import ElasticSpec
        from trainer.core.launch import train_elastic

        spec = ElasticSpec.parse(elastic, args.nproc_per_node or args.nproc, args.rdzv, args.max_restarts,
                                 args.rdzv_id, args.rdzv_conf)
        return _STOP_CODES[train_elastic(cfg, spec, args.deepspeed).status]
    if args.nproc is not None and not started_by_launcher():
        from trainer.core.launch import train

        return _STOP_CODES[train(cfg, args.nproc, args.deepspeed).status]
    from trainer.core.command_line import started_by_front_end

    if started_by_launcher():
        from trainer.core.rank_errors import raise_if_run_failed

        raise_if_run_failed(cfg.run.output_dir)  # a restart after an error of the run's own would repeat it
    from trainer.core.trainer import Trainer

    status = Trainer(cfg, deepspeed_config=args.deepspeed).fit()
    code = _STOP_CODES[status]
    if started_by_launcher():
        from trainer.core.launch import write_rank_status

        write_rank_status(code)
        if started_by_front_end():
            code = 0  # the front end reads the run's marker and exits with the stop's status; the launcher stays quiet
        arm_exit_guard(code)
    return code


def _add_elastic_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("elastic training (torch's elastic agent, c10d rendezvous; one call per node)")
    group.add_argument("--nnodes", default=None, metavar="MIN:MAX",
                       help="nodes the run may have: it goes on at any size in MIN..MAX and resumes at the new size")
    group.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", type=int, default=None,
                       help="processes on this node (default: --nproc, else 1)")
    group.add_argument("--rdzv", default=None, metavar="HOST:PORT", help="the rendezvous store, the same on every node")
    group.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int, default=None,
                       help="worker-group restarts after a failure such as a lost node (default 3; a join is free)")
    group.add_argument("--rdzv-id", dest="rdzv_id", default=None,
                       help="rendezvous id (default: derived from run.output_dir, and SLURM_JOB_ID under SLURM)")
    group.add_argument("--rdzv-conf", dest="rdzv_conf", default=None, metavar="K=V,...",
                       help="c10d rendezvous settings over trainer's, which scale with MAX (docs/elastic.md)")


def _rendezvous(args: argparse.Namespace) -> int:
    from trainer.core.rendezvous import serve

    return serve(args.host, args.port)


_STOP_CODES = {"completed": 0, "already_complete": 0, "preempted": 75, "interrupted": 128 + signal.SIGINT}
"""Exit statuses of a training run (core/preemption.py: PREEMPTED_EXIT_CODE, INTERRUPTED_EXIT_CODE)."""


def _export(args: argparse.Namespace) -> int:
    if args.format == "reference":
        from trainer.core.reference_checkpoints import export_reference

        if args.weights != "auto":
            raise ConfigError("--weights is for --format safetensors; the reference layouts hold the model and the "
                              "EMA as the reference keeps them")
        folder, notes = export_reference(args.run_dir, out=args.out, checkpoint=args.checkpoint)
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        print(folder)
        return 0
    from trainer.core.checkpoint.export import export_run

    out = export_run(args.run_dir, out=args.out, checkpoint=args.checkpoint, weights=args.weights)
    from safetensors import safe_open

    with safe_open(str(out), "pt") as exported:
        meta = exported.metadata() or {}
    # What was exported on stderr; stdout stays the path alone, for scripts.
    print(f"exported the {meta.get('weights', '?')} weights of {meta.get('checkpoint', '?')} (step {meta.get('step', '?')})",
          file=sys.stderr)
    print(out)
    return 0


def _import(args: argparse.Namespace) -> int:
    from trainer.reference_formats import get_reference_format

    get_reference_format(args.format)  # an unknown name lists the known ones before torch is imported
    from trainer.core.reference_checkpoints import import_reference

    result = import_reference(args.format, args.source, args.run_dir, args.overrides, config=args.config)
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"imported {args.source} as {result.checkpoint} (step {result.step}): `trainer train "
          f"{result.run_dir}/config.yaml` continues it", file=sys.stderr)
    print(result.run_dir)
    return 0


def _generative_spec(name: str) -> TaskSpec:
    """The light spec of task `name`; a task that cannot generate is a ConfigError."""
    from trainer.registry import get_spec

    spec = get_spec(name)
    if not spec.generates:
        raise ConfigError(f"task '{name}' cannot generate samples")
    return spec


def _sample(args: argparse.Namespace) -> int:
    if args.help:
        if args.run_dir is None:
            print("usage: trainer sample RUN_DIR [key=value ...]\n\nThe options are the task's; "
                  "`trainer sample RUN_DIR --help` or `trainer config-help --sample --task NAME` lists them.")
            return 0
        from trainer.config import describe_fields, load_yaml

        path = os.path.join(args.run_dir, "config.yaml")
        if not os.path.isfile(path):
            raise ConfigError(f"{args.run_dir} is not a run directory: no config.yaml")
        name = (load_yaml(path).get("task") or {}).get("name", "")
        spec = _generative_spec(name)
        print(f"trainer sample {args.run_dir} [key=value ...]  (task {name})\n")
        print(describe_fields({"": spec.sample_config_cls()}))
        return 0
    if args.run_dir is None:
        raise ConfigError("trainer sample needs RUN_DIR")
    from trainer.core.watchdog import started_by_launcher

    if args.nproc is not None and not started_by_launcher():
        from trainer.core.launch import raise_for_ranks, ranks_command, run_ranks

        raise_for_ranks(run_ranks(ranks_command(args.nproc, ["sample", args.run_dir, *args.overrides]), args.nproc),
                        f"sampling on {args.nproc} processes")
        return 0
    from trainer.core.generation import sample_run

    stats = sample_run(args.run_dir, args.overrides)
    if stats is not None:
        print(json.dumps({k: v for k, v in stats.items() if k in ("num_samples", "world_size", "stats_path")}))
    return 0


def _plot(args: argparse.Namespace) -> int:
    from trainer.core.plot import plot_run

    for path in plot_run(args.run_dir, out_dir=args.out):
        print(path)
    return 0


def _tasks(args: argparse.Namespace) -> int:  # noqa: ARG001
    from trainer.registry import available_tasks, get_spec, missing_requirements, unavailable_families

    for name in available_tasks():
        spec = get_spec(name)
        generates = " generates" if spec.generates else ""
        missing = missing_requirements(spec)
        needs = (f"\t(needs {', '.join(missing)}: pip install 'sciml-trainer[{spec.extra or name}]')"
                 if missing else "")
        print(f"{name}\tunit={spec.unit}\tpresets={','.join(sorted(spec.presets))}{generates}{needs}")
    for reason in unavailable_families().values():
        print(f"(unavailable) {reason}")
    return 0


def _config_help(args: argparse.Namespace) -> int:
    from trainer.config import describe_config, describe_fields

    if args.sample:
        if not args.task:
            raise ConfigError("config-help --sample needs --task NAME")
        print(describe_fields({"": _generative_spec(args.task).sample_config_cls()}))
        return 0
    print(describe_config(args.task))
    return 0


def _new_family(args: argparse.Namespace) -> int:
    from trainer.scaffold import new_family

    family = new_family(args.name, args.dir)
    where = "in this repository" if family.in_repository else "as a package of its own"
    print(f"wrote the {args.name} family {where}:")
    for path in family.written:
        print(f"  {path}")
    print("next:")
    for number, step in enumerate(family.next_steps, 1):
        print(f"  {number}. {step}")
    return 0


def _run_experiments(args: argparse.Namespace) -> int:
    from trainer.sweep.cli import main as run_experiments_main

    return run_experiments_main(args)


RUN_EXPERIMENTS = ("run-experiments", "sweep")


def build_parser(sweep_arguments: bool = True) -> argparse.ArgumentParser:
    """The `trainer` parser; `sweep_arguments=False` leaves out run-experiments' own options (it imports the
    sweep runner), for a command line that does not run it."""
    parser = argparse.ArgumentParser(prog="trainer", description=__doc__)
    parser.set_defaults(overrides=None)  # commands that take key=value overrides set a list
    parser.add_argument("--debug", action="store_true", help="show tracebacks of config, data and checkpoint errors")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train from a YAML config with dotted key=value overrides")
    train.add_argument("config", help="experiment YAML (configs/<family>/*.yaml)")
    train.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.max_steps=100 (anywhere on the line)")
    train.add_argument("--deepspeed", default=None, help="DeepSpeed json (ds_configs/*.json); 'auto' values are filled")
    train.add_argument("--nproc", type=int, default=None,
                       help="train on N local processes (torch.distributed.run on a free port); Ctrl-C stops them all "
                            "with a checkpoint. Ignored under a launcher, whose processes train")
    train.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    train.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    _add_elastic_arguments(train)
    train.set_defaults(func=_train)

    rendezvous = sub.add_parser("rendezvous", help="host an elastic run's rendezvous store where a node loss cannot "
                                                   "take it: trainer rendezvous [--host H] [--port P]")
    rendezvous.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all)")
    rendezvous.add_argument("--port", type=int, default=29400, help="port (0: a free one, printed)")
    rendezvous.set_defaults(func=_rendezvous)

    align = sub.add_parser("align", help="post-train a run's model with a force-field reward: "
                                         "trainer align RUN_DIR out=NEW_RUN_DIR key=value ...")
    align.add_argument("run_dir", help="the trained run to align (its latest checkpoint; EMA weights when kept)")
    align.add_argument("overrides", nargs="*",
                       help="out=NEW_RUN_DIR (required) and section.key=value, e.g. task.group_size=16 train.max_steps=200 "
                            "(`trainer config-help --task molecules_edm_align` lists them)")
    align.add_argument("--deepspeed", default=None, help="DeepSpeed json (ds_configs/*.json); 'auto' values are filled")
    align.add_argument("--nproc", type=int, default=None, help="as `trainer train --nproc`")
    align.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    align.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    align.set_defaults(func=_align)

    export = sub.add_parser("export", help="consolidated fp32 (or EMA) safetensors + config from a run")
    export.add_argument("run_dir")
    export.add_argument("--out", default=None, help="output .safetensors (default RUN_DIR/export/model.safetensors)")
    export.add_argument("--checkpoint", default="latest", help="latest, best, or a checkpoint directory")
    export.add_argument("--weights", choices=["auto", "ema", "model"], default="auto",
                        help="auto: EMA weights when the run kept an EMA")
    export.add_argument("--format", choices=["safetensors", "reference"], default="safetensors",
                        help="reference: the task's reference implementation's checkpoint layout, into the folder "
                             "--out (default RUN_DIR/export/reference)")
    export.set_defaults(func=_export)

    imp = sub.add_parser("import", help="a reference implementation's checkpoint as a run folder: "
                                        "trainer import FORMAT SOURCE RUN_DIR [key=value ...]")
    from trainer.reference_formats import reference_format_names

    imp.add_argument("format", help=f"the reference's layout: {', '.join(reference_format_names())}")
    imp.add_argument("source", help="the reference's checkpoint file or folder")
    imp.add_argument("run_dir", help="the new run folder (config.yaml and a checkpoint at the source's step)")
    imp.add_argument("overrides", nargs="*", help="section.key=value over what the source's config gives, e.g. "
                                                  "task.data_path=... train.max_steps=...")
    imp.add_argument("--config", default=None, help="YAML under the source's config (default: the task's defaults)")
    imp.set_defaults(func=_import)

    sample = sub.add_parser("sample", add_help=False,
                            help="draw samples from a run: trainer sample RUN_DIR key=value ... (--help lists the task's keys)")
    sample.add_argument("run_dir", nargs="?")
    sample.add_argument("overrides", nargs="*", help="the task's sample options, e.g. num_samples=64 out=x.fasta")
    sample.add_argument("-h", "--help", action="store_true", help="list the task's sample options")
    sample.add_argument("--nproc", type=int, default=None,
                        help="sample on N local processes (as `trainer train --nproc`); ignored under a launcher")
    sample.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sample.set_defaults(func=_sample)

    plot = sub.add_parser("plot", help="PNG curves of loss, lr and eval metrics from metrics.jsonl")
    plot.add_argument("run_dir")
    plot.add_argument("--out", default=None, help="output folder (default RUN_DIR/plots)")
    plot.set_defaults(func=_plot)

    tasks = sub.add_parser("tasks", help="list registered tasks")
    tasks.set_defaults(func=_tasks)

    chelp = sub.add_parser("config-help", help="every config key with its default and meaning")
    chelp.add_argument("--task", default=None)
    chelp.add_argument("--sample", action="store_true", help="the task's `trainer sample` options instead")
    chelp.set_defaults(func=_config_help)

    newfam = sub.add_parser("new-family", help="write a family's skeleton (task, spec, tiny config, tests, docs page) "
                                               "that trains and passes the task contract as written")
    newfam.add_argument("name", help="the family's (and its task's) name, a lowercase identifier, e.g. char_lm")
    newfam.add_argument("--dir", default=None,
                        help="this repository's root (the default when run there: trainer/families/NAME, configs/NAME, "
                             "...) or, anywhere else, the folder of a new package (default ./NAME)")
    newfam.set_defaults(func=_new_family)

    runexp = sub.add_parser(RUN_EXPERIMENTS[0], aliases=list(RUN_EXPERIMENTS[1:]),
                            help="run a grid of experiments over GPU/CPU slots or as a SLURM array")
    if sweep_arguments:
        from trainer.sweep.cli import add_arguments as add_run_experiments_arguments

        add_run_experiments_arguments(runexp)
    runexp.set_defaults(func=_run_experiments)

    for name, entry in sorted(family_commands().items()):
        command = sub.add_parser(name, add_help=False, help=f"{entry.value.split(':')[0]} (--help for its options)")
        command.add_argument("args", nargs=argparse.REMAINDER)
        command.set_defaults(func=_family_command, entry=entry)
    return parser


COMMANDS_GROUP = "trainer.commands"
"""Entry-point group of family subcommands (`name = package.module:main`, main(argv) -> exit status)."""


def family_commands() -> dict[str, importlib.metadata.EntryPoint]:
    """Subcommands a family adds (e.g. `evaluate-molecules`); imported only when run, so the core names none."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=COMMANDS_GROUP)}


def _family_command(args: argparse.Namespace) -> int:
    try:
        main = args.entry.load()
    except ModuleNotFoundError as err:
        parts = args.entry.value.split(":")[0].split(".")
        extra = parts[2] if len(parts) > 2 and parts[:2] == ["trainer", "families"] else ""  # our families' extras
        hint = f"; install its extra: pip install 'sciml-trainer[{extra}]'" if extra else ""
        raise ConfigError(f"`trainer {args.command}` needs a package that is not installed ({err}){hint}") from err
    return int(main(args.args) or 0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line; `key=value` overrides may sit anywhere, also after launcher-added flags
    such as `--deepspeed ds.json` (argparse alone stops at the first optional)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    first = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    parser = build_parser(sweep_arguments=first is not None and argv[first] in RUN_EXPERIMENTS)
    commands = family_commands()
    if first is not None and argv[first] in commands:  # a family command parses its own options (--help too)
        return argparse.Namespace(command=argv[first], entry=commands[argv[first]], args=argv[first + 1:],
                                  func=_family_command, overrides=None, debug="--debug" in argv[:first])
    args, extra = parser.parse_known_args(argv)
    if args.overrides is not None:
        overrides = [a for a in extra if "=" in a and not a.startswith("-")]
        args.overrides = [*args.overrides, *overrides]
        extra = [a for a in extra if a not in overrides]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    from trainer.core.threads import set_openmp_wait_policy

    set_openmp_wait_policy()  # before anything imports torch, whose OpenMP runtime reads it once
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("accelerate", "deepspeed", "DeepSpeed", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    from trainer.core.command_line import RANK_STATUS_ENV, started_by_front_end

    if started_by_front_end() and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the front end ignores Ctrl-C for its launcher only
    main_rank = int(os.environ.get("RANK", "0") or 0) == 0
    args = None
    try:
        if os.environ.get(RANK_STATUS_ENV):
            from trainer.core.launch import register_rank

            register_rank()
        args = parse_args(argv)
        return args.func(args)
    except BrokenPipeError:  # `trainer config-help | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        # Ctrl-C outside training's step boundaries (set-up, export, sampling, plots): outputs are written whole
        # or not at all, so stopping here leaves nothing that looks complete.
        if debug:
            raise
        if main_rank:
            print("trainer: interrupted by Ctrl-C before its work was complete: nothing more written (a run's last "
                  "complete checkpoint is intact)", file=sys.stderr)
        return _rank_status(128 + signal.SIGINT)
    except TrainerError as err:
        if debug:
            raise
        if getattr(err, "reported", False):  # the ranks have said it
            return err.exit_code
        kind = "config error" if isinstance(err, ConfigError) else "error"
        # A config error is the same on every rank of a launch, as is an error the ranks agreed on: the main one
        # says it. Other errors may be a rank's own (its data, its disk), so every rank prints those.
        if not ((isinstance(err, ConfigError) or err.everywhere) and not main_rank):
            print(f"trainer: {kind}: {err}", file=sys.stderr)
        return _rank_status(getattr(err, "exit_code", 2))
    except Exception as err:
        # A rank's unexpected error: its traceback kept in the run folder, a lost peer said in one line, an error
        # of an elastic run's own recorded so that no restart repeats it (core/rank_errors.py).
        from trainer.core.rank_errors import report_rank_failure

        code = report_rank_failure(err, getattr(args, "output_dir", None))
        if code is None or debug:
            raise
        return code


def _rank_status(code: int) -> int:
    """Record a front-end rank's status (core/launch.py reads it) and return it."""
    from trainer.core.command_line import RANK_STATUS_ENV

    if os.environ.get(RANK_STATUS_ENV):
        from trainer.core.launch import write_rank_status

        write_rank_status(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
