"""What the parity scripts (`sedd.py`, `edm.py`, `comformer.py`, `gears.py`) share: the command line, the
reference's commit, tolerance checks, the golden files' writing, reading and staleness check, and the report."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

Golden = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]
"""What a script's golden files hold: (reference weights, inputs, the reference's outputs, meta)."""
GOLDEN_FILES = ("weights.safetensors", "io.safetensors", "meta.json")
TEN_STEP_FILES = ("ten_steps.safetensors", "ten_steps.json")
ROUND_TRIP_FAILURE = "state dict round trip into a fresh reference model (strict) is not exact"


def load_module(path: str | Path, name: str, register: bool = False) -> Any:
    """The module in file `path`, imported under `name` (put in sys.modules first when `register`, for a module
    whose own imports or pickles look itself up there)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def parse_arguments(description: str, env: str, argv: list[str] | None) -> argparse.Namespace:
    """--reference (default $`env`), --write-golden DIR, --check-golden DIR; a missing reference is an error."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--reference", default=os.environ.get(env), help=f"reference checkout (default: ${env})")
    p.add_argument("--write-golden", type=Path, metavar="DIR", help="write the golden files into DIR")
    p.add_argument("--check-golden", type=Path, metavar="DIR",
                   help="also check that the golden files in DIR are what this reference checkout computes")
    args = p.parse_args(argv)
    if not args.reference:
        p.error(f"name the reference checkout with {env}=/path or --reference")
    return args


def start(doc: str, env: str, argv: list[str] | None,
          load_reference: Callable[[str], Any]) -> tuple[argparse.Namespace, Any, str]:
    """(the arguments, `load_reference`'s reference, its commit) of a parity script whose description is the first
    paragraph of `doc`: the shared options plus ``--ten-steps`` (``args.ten_steps``); torch on one thread, for one
    reduction order on every machine the golden files are checked on."""
    argv = sys.argv[1:] if argv is None else list(argv)
    ten_steps = "--ten-steps" in argv  # the scripts' own flag, beside the shared ones
    args = parse_arguments(doc.split("\n\n")[0], env, [a for a in argv if a != "--ten-steps"])
    args.ten_steps = ten_steps
    torch.set_num_threads(1)
    return args, load_reference(args.reference), reference_commit(args.reference)


def main(doc: str, env: str, load_reference: Callable[[str], Any], check: Callable[..., int],
         check_ten_steps: Callable[..., int], argv: list[str] | None = None, log: Callable[[str], None] = print) -> int:
    """A parity script's main (see `start`; the script binds the arguments before `argv`): with --ten-steps
    ``check_ten_steps(args, reference, commit, log)``, else ``check(...)`` alike; returns its exit status."""
    args, ref, commit = start(doc, env, argv, load_reference)
    return (check_ten_steps if args.ten_steps else check)(args, ref, commit, log)


def reference_commit(path: str | os.PathLike[str]) -> str:
    """The checkout's commit: its REFERENCE_COMMIT file (an archive), else ``git rev-parse HEAD``."""
    f = Path(path) / "REFERENCE_COMMIT"
    if f.is_file():
        return f.read_text().strip()
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "--show-toplevel", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    # Only the checkout's own repository: a plain folder inside another repository is not that commit.
    return out[1] if Path(out[0]).resolve() == Path(path).resolve() else "unknown"


def step_params(params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor], kind: str, sgd_lr: float,
                adam_lr: float) -> dict[str, torch.Tensor]:
    """Parameters after one `kind` ("sgd" or "adam") step from `params` with `grads` (copies; `params` unchanged)."""
    copies = {n: p.detach().clone().requires_grad_(True) for n, p in params.items()}
    for n, p in copies.items():
        p.grad = grads[n].clone()
    opt = (torch.optim.SGD(copies.values(), lr=sgd_lr) if kind == "sgd"
           else torch.optim.Adam(copies.values(), lr=adam_lr))
    opt.step()
    return {n: p.detach() for n, p in copies.items()}


def round_trip_exact(state: Mapping[str, torch.Tensor], ours: torch.nn.Module, fresh_reference: torch.nn.Module,
                     from_reference: Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]],
                     to_reference: Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]) -> bool:
    """The reference's `state` -> `ours` -> a fresh reference model, each loaded with strict=True: the same tensors?"""
    ours.load_state_dict(from_reference(state), strict=True)
    fresh_reference.load_state_dict(to_reference(ours.state_dict()), strict=True)
    return all(torch.equal(fresh_reference.state_dict()[k], v) for k, v in state.items())


def close(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float, failures: list[str]) -> None:
    """Append to `failures` what `torch.testing.assert_close` says of `got` against `want`, in one line."""
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    except AssertionError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        failures.append(f"{name}: " + "; ".join([lines[0]] + [ln for ln in lines[1:] if ln.startswith("Greatest")]))


def close_each(label: str, got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], rtol: float,
               atol: float, failures: list[str]) -> None:
    """`close` for each of `want`'s tensors against `got`'s of the same name (as ``<label> <name>``); names that
    differ are one failure instead."""
    if set(got) != set(want):
        failures.append(f"{label} names differ: {sorted(set(got) ^ set(want))}")
        return
    for name, w in want.items():
        close(f"{label} {name}", got[name], w, rtol, atol, failures)


def read_golden_files(golden_dir: Path, script: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor],
                                                               dict[str, Any], dict[str, torch.Tensor]]:
    """(reference weights, the saved tensors, meta, the inputs) of the golden files in `golden_dir`; a missing file
    names the `script` that writes it."""
    from safetensors.torch import load_file

    for name in GOLDEN_FILES:
        if not (golden_dir / name).is_file():
            raise FileNotFoundError(f"{golden_dir / name}: golden file missing (scripts/parity/{script} "
                                    f"--write-golden {golden_dir} writes it)")
    state = load_file(str(golden_dir / "weights.safetensors"))
    saved = load_file(str(golden_dir / "io.safetensors"))
    meta = json.loads((golden_dir / "meta.json").read_text())
    inputs = {k.removeprefix("input."): v for k, v in saved.items() if k.startswith("input.")}
    return state, saved, meta, inputs


def stale_golden(golden_dir: Path, golden_state: Mapping[str, torch.Tensor], golden_inputs: Mapping[str, torch.Tensor],
                 state: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor]) -> list[str]:
    """What differs between the committed golden files and what this checkout and script make (weights, inputs)."""
    failures = []
    if set(golden_state) != set(state) or not all(torch.equal(golden_state[k], state[k]) for k in state):
        failures.append(f"{golden_dir}/weights.safetensors: not the weights this script randomises")
    if not all(torch.equal(golden_inputs[k], v) for k, v in inputs.items()):
        failures.append(f"{golden_dir}/io.safetensors: inputs differ from this script's")
    return failures


def report(failures: list[str], passed: str, args: argparse.Namespace, write: Callable[[Path], None],
           log: Callable[[str], None]) -> int:
    """Log the failures (exit status 1), or what passed and, with --write-golden, write the golden files (0)."""
    for f in failures:
        log(f"FAIL {f}")
    if failures:
        return 1
    log(passed + (f"; golden files in {args.check_golden} current" if args.check_golden else ""))
    if args.write_golden:
        write(args.write_golden)
        log(f"golden files written to {args.write_golden}")
    return 0


def reference_meta(repo: str, commit: str, license: str, **extra: str) -> dict[str, str]:
    """The golden files' ``reference`` entry: the repository's address, `extra` (e.g. a subfolder), commit and
    licence."""
    return {"repository": f"https://github.com/{repo}", **extra, "commit": commit, "license": license}


def add_prefix(prefix: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with `prefix` before every key (one part of a golden .safetensors file)."""
    return {f"{prefix}{k}": v for k, v in tensors.items()}


def strip_prefix(tensors: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The part of `tensors` whose keys start with `prefix`, without it (undoes `add_prefix`)."""
    return {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}


def save_tensors(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """`tensors` (made contiguous) as the safetensors file `path`."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


def save_json(path: Path, meta: Mapping[str, Any]) -> None:
    """`meta` as the indented JSON file `path`."""
    path.write_text(json.dumps(meta, indent=1) + "\n")


def write_ten_step_files(out_dir: Path, state: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor],
                         ref_out: Mapping[str, Any], layout: tuple[Sequence[str], Sequence[str]],
                         meta: Mapping[str, Any]) -> None:
    """ten_steps.safetensors and ten_steps.json (`meta`) in `out_dir`. The tensors: the initial weights as
    ``init.*``, the inputs as ``input.*``, then of the reference's `ref_out` per `layout` (tensor names, names of
    tensor dicts): each named tensor, and each named dict's tensors as ``<name>.*``."""
    tensors, parts = layout
    saved = {**add_prefix("init.", state), **add_prefix("input.", inputs), **{k: ref_out[k] for k in tensors}}
    for part in parts:
        saved.update(add_prefix(f"{part}.", ref_out[part]))
    out_dir.mkdir(parents=True, exist_ok=True)
    save_tensors(out_dir / TEN_STEP_FILES[0], saved)
    save_json(out_dir / TEN_STEP_FILES[1], meta)


def read_ten_step_files(golden_dir: Path, script: str, layout: tuple[Sequence[str], Sequence[str]],
                        write_dir: Path | None = None, from_meta: Mapping[str, str] | None = None) -> Golden:
    """(initial weights, inputs, the reference's ten steps as `layout` names them plus the entries of meta that
    `from_meta` names (key: meta's key), meta) of the files `write_ten_step_files` wrote into `golden_dir`; a
    missing file names the `script` that writes it (``--ten-steps --write-golden`` into `write_dir`, default
    `golden_dir`)."""
    from safetensors.torch import load_file

    for name in TEN_STEP_FILES:
        if not (golden_dir / name).is_file():
            raise FileNotFoundError(f"{golden_dir / name}: golden file missing (scripts/parity/{script} --ten-steps "
                                    f"--write-golden {write_dir or golden_dir} writes it)")
    saved = load_file(str(golden_dir / TEN_STEP_FILES[0]))
    tensors, parts = layout
    ref = {**{k: saved[k] for k in tensors}, **{part: strip_prefix(saved, f"{part}.") for part in parts}}
    meta = json.loads((golden_dir / TEN_STEP_FILES[1]).read_text())
    ref.update({k: meta[m] for k, m in (from_meta or {}).items()})
    return strip_prefix(saved, "init."), strip_prefix(saved, "input."), ref, meta


def golden_failures(golden_dir: Path, golden: tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor], Any, Any],
                    state: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor], ref_out: Any,
                    compare: Callable[[Any, Any], list[str]]) -> list[str]:
    """What is wrong with the committed golden files in `golden_dir` (`golden`: their (weights, inputs, reference
    outputs, meta)): weights or inputs not this checkout's and script's (stale), and what ``compare(ref_out, saved
    reference outputs)`` says, each prefixed ``golden``."""
    g_state, g_inputs, g_ref, _ = golden
    return stale_golden(golden_dir, g_state, g_inputs, state, inputs) + [f"golden {f}" for f in compare(ref_out, g_ref)]


def log_losses(log: Callable[[str], None], ref: torch.Tensor, ours: torch.Tensor, prefix: str = "") -> None:
    """Log the reference's and our loss per step, one line each."""
    log(f"{prefix}losses: reference " + " ".join(f"{v:.6g}" for v in ref.tolist()))
    log(f"{prefix}losses: ours      " + " ".join(f"{v:.6g}" for v in ours.tolist()))


def max_abs_diff(ours: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor]) -> float:
    """The largest absolute difference between `ours` and `ref`, over `ref`'s tensors."""
    return max((ours[n] - w).abs().max().item() for n, w in ref.items())


def max_relative_diff(ours: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor], floor: float = 0.0,
                      keep: Callable[[str, torch.Tensor], bool] = lambda name, tensor: True) -> float:
    """The largest `|ours - ref|` over `ref`'s tensors, each relative to that tensor's largest magnitude (at least
    `floor`, so an all-zero tensor does not divide by zero); `keep(name, tensor)` picks the tensors compared."""
    return max(((ours[n] - w).abs().max() / w.abs().max().clamp_min(floor)).item()
               for n, w in ref.items() if keep(n, w))


def stand_in_loop(cfg: Any, task: Any, model: torch.nn.Module, plan: Any = None) -> SimpleNamespace:
    """What `Trainer.train_step` reads of a Trainer, built from `cfg` as a one-process CPU run builds it: an
    Accelerator, `model` prepared with the optimizer (at the plan's lr) and its scheduler, the engine, and the EMA
    where ``cfg.train.ema_decay`` > 0; ``loop.optimizer`` and ``loop.plan`` ride along. `plan` defaults to cfg's
    steps and warm-up, no step decay, at ``cfg.optim.lr``. Needs a fresh accelerate state."""
    from accelerate import Accelerator

    from trainer.core.ema import EMA
    from trainer.core.engine import build_engine
    from trainer.core.optim import build_optimizer, build_scheduler

    plan = plan or SimpleNamespace(max_steps=cfg.train.max_steps, warmup_steps=cfg.optim.warmup_steps,
                                   decay_every_steps=0, lr=cfg.optim.lr)
    acc = Accelerator(cpu=True)
    optimizer = build_optimizer(cfg, model, plan.lr)
    scheduler = build_scheduler(cfg, optimizer, plan)
    model, optimizer = acc.prepare(model, optimizer)
    engine = build_engine(acc, model, optimizer, cfg, 1)
    ema = EMA(model, cfg.train.ema_decay, engine, cfg.train.ema_warmup) if cfg.train.ema_decay > 0 else None
    return SimpleNamespace(accelerator=acc, stateful_task=None, task=task, model=model.train(), engine=engine,
                           scheduler=scheduler, ema=ema, state=SimpleNamespace(step=0), optimizer=optimizer, plan=plan)


def run_both(inputs: Mapping[str, torch.Tensor], reference: Callable[[Mapping[str, torch.Tensor]], tuple[Any, Any]],
             ours: Callable[[Any, Mapping[str, torch.Tensor]], Any], compare: Callable[[Any, Any], list[str]],
             round_trip: Callable[[Any], bool] | None = None) -> tuple[Any, Any, Any, list[str]]:
    """(the reference's randomised state, its outputs, our outputs, failures): ``reference(inputs)`` gives the
    first two, ``ours(state, inputs)`` ours from that state; the failures are what ``compare(ours, reference's)``
    says and, where `round_trip` is given and ``round_trip(state)`` is false, `ROUND_TRIP_FAILURE`."""
    state, ref_out = reference(inputs)
    ours_out = ours(state, inputs)
    failures = compare(ours_out, ref_out)
    if round_trip is not None and not round_trip(state):
        failures.append(ROUND_TRIP_FAILURE)
    return state, ref_out, ours_out, failures


def check_golden(args: argparse.Namespace, load: Callable[..., tuple], state: Mapping[str, torch.Tensor],
                 inputs: Mapping[str, torch.Tensor], ref_out: Any, compare: Callable[[Any, Any], list[str]],
                 variant: str | None = None) -> list[str]:
    """With --check-golden DIR: `golden_failures` of the golden files ``load(DIR)`` reads (``load(DIR, variant)``
    from ``DIR/variant`` where the script keeps one folder per variant); without it, none."""
    if not args.check_golden:
        return []
    if variant is None:
        return golden_failures(args.check_golden, load(args.check_golden), state, inputs, ref_out, compare)
    return golden_failures(args.check_golden / variant, load(args.check_golden, variant), state, inputs, ref_out,
                           compare)
