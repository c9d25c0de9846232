"""What the parity scripts (`sedd.py`, `edm.py`) share: the command line, the reference's commit, tolerance checks,
the golden files' reading and staleness check, and the report."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

GOLDEN_FILES = ("weights.safetensors", "io.safetensors", "meta.json")


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
