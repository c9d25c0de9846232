"""The CLI answers at once: help, task lists, config help and config errors import none of the heavy
libraries (torch, datasets, accelerate, deepspeed, transformers, ...). Asserted on `sys.modules`, not on
time, so it holds on a loaded machine."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT, TINY

HEAVY = ("torch", "datasets", "accelerate", "deepspeed", "transformers", "scipy", "e3nn", "rdkit", "pandas",
         "anndata", "scanpy", "matplotlib", "safetensors", "optuna")

CALLS = [
    ["--help"],
    ["tasks"],
    ["config-help"],
    ["config-help", "--task", "protein_sedd"],
    ["config-help", "--task", "crystal_property"],
    ["config-help", "--sample", "--task", "molecules_edm"],
    ["train", TINY, "train.max_step=3"],  # a typo in a key
    ["train", TINY, "task.name=regresion"],  # an unknown task
    ["train", TINY, "task.name=perturbation_gears", "eval.metric=mse_de", "task.split=simulaton"],  # the task's check
    ["train", TINY, "task.name=protein_sedd", "optim.scheduler=cosin"],
    ["evaluate-molecules", "--help"],
]
SAYS = {6: "Did you mean: train.max_steps?", 7: "Did you mean 'regression'?", 8: "task.split must be one of",
        9: "Did you mean 'cosine'?", 10: "| `forcefield` |"}
"""What some of the calls print (by index in CALLS)."""


def test_cli_answers_without_heavy_imports(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("task:\n  name: molecules_edm\n")
    calls = [*CALLS, ["sample", str(run), "--help"]]
    code = f"""
import contextlib, io, json, sys
from trainer.cli import main
codes = []
for argv in {calls!r}:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            codes.append(main(argv))
        except SystemExit as exit:
            codes.append(exit.code)
    codes.append(out.getvalue() + err.getvalue())
print(json.dumps({{"codes": codes, "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["heavy"] == [], f"imported by the light commands: {result['heavy']}"
    statuses, said = result["codes"][::2], result["codes"][1::2]
    for k, call in enumerate(calls):
        assert statuses[k] == (2 if call[0] == "train" else 0) and said[k], (call, statuses[k], said[k][-500:])
        assert SAYS.get(k, "") in said[k], (call, said[k][-500:])
    assert "| `num_samples` |" in said[-1] and "| `guidance.scales` |" in said[-1]  # sample --help: every key
