"""Command-line parsing: overrides anywhere, sample options from the task, one-line errors."""

import pytest

from trainer.cli import main, parse_args


def test_overrides_after_launcher_flags():
    """`deepspeed ... scripts/train.py CONFIG --deepspeed ds.json train.max_steps=12` (and --local_rank)."""
    args = parse_args(["train", "c.yaml", "--local_rank=0", "optim.lr=1", "--deepspeed", "ds.json",
                       "train.max_steps=12"])
    assert args.config == "c.yaml" and args.deepspeed == "ds.json"
    assert args.overrides == ["optim.lr=1", "train.max_steps=12"]
    with pytest.raises(SystemExit):
        parse_args(["train", "c.yaml", "--no-such-flag"])


def test_sample_options_are_overrides():
    args = parse_args(["sample", "run", "steps=4", "num_samples=7", "out=x.fasta", "seed=3"])
    assert args.run_dir == "run"
    assert sorted(args.overrides) == ["num_samples=7", "out=x.fasta", "seed=3", "steps=4"]


def test_sample_help_lists_the_tasks_options(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("task:\n  name: protein_sedd\n")
    assert main(["sample", str(tmp_path), "--help"]) == 0
    out = capsys.readouterr().out
    for key in ("num_samples", "out", "seed", "steps", "sampler", "length"):
        assert f"| `{key}` |" in out
    assert main(["config-help", "--sample", "--task", "protein_sedd"]) == 0
    assert "`sampler`" in capsys.readouterr().out


def test_unknown_sample_option_gets_did_you_mean(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("task:\n  name: protein_sedd\n")
    assert main(["sample", str(tmp_path), "num_sample=3"]) == 2
    assert "Did you mean: num_samples" in capsys.readouterr().err


def test_errors_print_one_line_and_debug_shows_traceback(tmp_path, capsys):
    bad = tmp_path / "c.yaml"
    bad.write_text("task: regression\n")
    assert main(["train", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trainer: config error: section 'task'") and "Traceback" not in err
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError):
        main(["--debug", "train", str(bad)])


@pytest.mark.parametrize("option", ["sampler=ddpm", "steps=-1", "num_samples=0", "batch_size=0", "weights=foo",
                                    "length=-5", "length=100000"])
def test_bad_sample_values_are_one_line_errors_before_loading(tmp_path, capsys, option):
    (tmp_path / "config.yaml").write_text("task:\n  name: protein_sedd\n")  # no checkpoint: must fail before
    assert main(["sample", str(tmp_path), option]) == 2
    assert capsys.readouterr().err.startswith("trainer: config error: trainer sample:")


def test_plot_without_metrics_is_one_line(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
