"""End-to-end CLI run of the tiny config against stored reference numbers, then export and plot."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import BIN, ROOT, TINY, cli_in_process, read_jsonl, run_cmd

from trainer.core.checkpoint.export import load_exported
from trainer.registry import available_tasks

REFERENCE = Path(__file__).parent / "reference" / "regression_tiny.json"


def test_train_export_plot_against_reference(tmp_path, capsys):
    out = tmp_path / "run"
    run_cmd([str(BIN / "trainer"), "train", TINY, f"run.output_dir={out}", "log.progress_bar=false",
             "run.resume=none"])
    records = read_jsonl(out)
    final_eval = [r for r in records if "eval/loss" in r][-1]
    first_loss = next(r["loss"] for r in records if "loss" in r)
    reference = json.loads(REFERENCE.read_text())
    assert final_eval["step"] == reference["step"]
    assert final_eval["eval/loss"] == pytest.approx(reference["eval/loss"], rel=1e-4)
    assert final_eval["eval/mae"] == pytest.approx(reference["eval/mae"], rel=1e-4)
    assert final_eval["eval/loss"] < 0.5 * first_loss  # it learned
    for key in ("step", "loss", "lr", "grad_norm", "samples_per_s", "step_time_s", "peak_memory_mb"):
        assert key in records[1], key
    assert (out / "config.yaml").is_file() and list((out / "tb").rglob("events.out.tfevents*"))

    capsys.readouterr()
    cli_in_process("export", str(out))  # the console script itself is the train step's
    printed = capsys.readouterr()
    assert printed.out == f"{out / 'export' / 'model.safetensors'}\n"  # the path alone, for scripts
    assert f"exported the ema weights of checkpoints/step_{reference['step']:08d}" in printed.err
    model, cfg = load_exported(out / "export" / "model.safetensors")
    assert cfg.train.max_steps == reference["step"]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    cli_in_process("plot", str(out))
    for name in ("train.png", "eval.png"):
        assert (out / "plots" / name).stat().st_size > 10_000


def test_cli_reports_config_errors_clearly(tmp_path):
    proc = run_cmd([str(BIN / "trainer"), "train", TINY, "train.max_stepz=3", f"run.output_dir={tmp_path}"],
                   expect=2)
    assert "unknown config key 'train.max_stepz'" in proc.stderr and "train.max_steps" in proc.stderr
    proc = run_cmd([str(BIN / "python"), "-m", "trainer", "train", TINY, "task.name=protein"], expect=2)
    listed = re.search(r"available tasks: (.*?)\.(?: |$)", proc.stderr, re.M)
    assert listed, f"the unknown task's error lists no tasks: {proc.stderr}"
    listed_names, registered = listed.group(1).split(", "), available_tasks()
    assert listed_names == registered, (f"the error lists {listed_names}; the registry has {registered} (missing: "
                                        f"{sorted(set(registered) - set(listed_names))}, extra: "
                                        f"{sorted(set(listed_names) - set(registered))})")


def test_tasks_and_config_help():
    assert "regression" in run_cmd([str(BIN / "trainer"), "tasks"]).stdout
    help_text = run_cmd([str(BIN / "trainer"), "config-help", "--task", "regression"]).stdout
    assert "`train.grad_accum_steps`" in help_text and "`task.num_train`" in help_text


def test_configuration_page_documents_every_config_key():
    """docs/configuration.md tables every core key and every registered task's `task.*` keys with the
    defaults and docstrings the dataclasses have today: the page is what `make docs-config` makes of it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("update_docs_config", ROOT / "scripts" / "update_docs_config.py")
    docs_config = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(docs_config)
    page = (ROOT / "docs" / "configuration.md").read_text()
    generated = docs_config.render_configuration(page)
    stale = [line.split("|")[1].strip() if "|" in line else line for line in generated.splitlines()
             if line not in page.splitlines()]
    assert not stale, f"docs/configuration.md lacks or has a stale {', '.join(stale[:5])}: run `make docs-config`"
    assert generated == page, "docs/configuration.md is not what `make docs-config` makes of it: run it"
    stale_tasks = docs_config.stale_sections(page)
    assert not stale_tasks, f"docs/configuration.md tables tasks no longer registered: {stale_tasks}"


def test_family_commands_come_from_entry_points_and_parse_their_own_options(capsys):
    """`trainer evaluate-molecules --help`: a family adds a subcommand through the `trainer.commands`
    entry points; the core names no family and hands the whole rest of the line to it."""
    from trainer.cli import family_commands, main

    assert {"evaluate-molecules", "simulate-perturbations"} <= set(family_commands())
    assert main(["evaluate-molecules", "--help"]) == 0
    assert "usage: trainer evaluate-molecules" in capsys.readouterr().out
