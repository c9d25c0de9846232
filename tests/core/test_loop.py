"""In-process, single-process behaviour of the loop: accumulation, skipping, EMA, schedules, checkpoints."""

import math

import pytest
import torch
from conftest import ROOT, reset_accelerate
from safetensors.torch import load_file

from trainer.config import load_config
from trainer.core.checkpoint import CheckpointError
from trainer.core.distributed import scale_factor
from trainer.core.ema import ema_decay
from trainer.core.trainer import NonFiniteLossError, Trainer

pytestmark = pytest.mark.usefixtures("fresh_accelerate")


def make(tmp_path, *overrides):
    cfg = load_config(None, ["task.preset=tiny", f"run.output_dir={tmp_path}", "log.progress_bar=false",
                             "log.tensorboard=false", "optim.lr=0.05", *overrides])
    return Trainer(cfg)


def batch(lo, hi, trainer):
    return trainer.data.micro_batch(list(range(lo, hi)))


def params(trainer):
    return [p.detach().clone() for p in trainer.accelerator.unwrap_model(trainer.model).parameters()]


def test_accumulation_weights_uneven_micro_batches(tmp_path):
    """Micro-batches of 3 and 5 samples give the same step as one batch of 8."""
    accum = make(tmp_path / "a", "train.grad_accum_steps=2")
    accum.train_step([batch(0, 3, accum), batch(3, 8, accum)])
    reset_accelerate()
    whole = make(tmp_path / "b", "train.grad_accum_steps=1")
    whole.train_step([batch(0, 8, whole)])
    for a, b in zip(params(accum), params(whole)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_nonfinite_step_is_skipped_and_counted(tmp_path):
    trainer = make(tmp_path)
    before = params(trainer)
    good_loss = trainer.task.loss

    def nan_loss(model, b, rng):
        out = good_loss(model, b, rng)
        out.loss = out.loss * float("nan")
        return out

    trainer.task.loss = nan_loss
    trainer.train_step([batch(0, 8, trainer)])
    for a, b in zip(params(trainer), before):
        assert torch.equal(a, b)
    state = trainer.optimizer.optimizer.state
    assert all(float(s["step"]) == 0 for s in state.values())  # Adam's step counter did not advance
    assert trainer.engine.guard.read() == (1, 1)  # (skipped since the last read, longest run)
    trainer.task.loss = good_loss
    trainer.train_step([batch(0, 8, trainer)])
    assert any(not torch.equal(a, b) for a, b in zip(params(trainer), before))
    assert all(float(s["step"]) == 1 for s in state.values())


def test_nonfinite_in_a_row_aborts(tmp_path):
    trainer = make(tmp_path, "train.max_nonfinite_in_row=3", "log.every_steps=1", "train.max_steps=10")
    good_loss = trainer.task.loss

    def nan_loss(model, b, rng):
        out = good_loss(model, b, rng)
        out.loss = out.loss + float("inf")
        return out

    trainer.task.loss = nan_loss
    with pytest.raises(NonFiniteLossError, match="3 optimizer steps in a row"):
        trainer.fit()


def test_ema_warmup_and_use_in_eval(tmp_path):
    assert ema_decay(0.999, 0) == pytest.approx(0.1)
    assert ema_decay(0.999, 10) == pytest.approx(11 / 20)
    assert ema_decay(0.9, 10_000) == 0.9
    trainer = make(tmp_path, "train.ema_decay=0.9", "train.max_steps=5")
    trainer.fit()
    model = trainer.accelerator.unwrap_model(trainer.model)
    live = trainer.evaluate()["loss"]
    with trainer.ema.applied_to(model):
        shadow_params = params(trainer)
    assert any(not torch.equal(a, b) for a, b in zip(shadow_params, params(trainer)))  # EMA differs from live
    assert trainer.ema.num_updates == 5
    assert math.isfinite(live)
    saved = load_file(tmp_path / "checkpoints" / "step_00000005" / "ema.safetensors")
    names = [n for n, _ in model.named_parameters()]
    for name, shadow in zip(names, trainer.ema.shadow):
        assert torch.equal(saved[name], shadow), name  # the checkpoint holds the EMA, not the live weights


def test_schedule_steps_once_per_optimizer_step_and_lr_scaling(tmp_path):
    trainer = make(tmp_path, "train.grad_accum_steps=3", "train.max_steps=4", "optim.scheduler=linear",
                   "optim.warmup_steps=0")
    trainer.fit()
    assert trainer.scheduler.last_epoch == 4
    assert trainer.scheduler.get_last_lr()[0] == pytest.approx(0.0)
    assert scale_factor("linear", 8, 2) == 4 and scale_factor("sqrt", 8, 2) == 2 and scale_factor("none", 8, 1) == 1


def test_scaled_lr_and_warmup(tmp_path):
    trainer = make(tmp_path, "optim.scale_lr=linear", "optim.base_world_size=2", "optim.warmup_steps=10")
    assert trainer.lr == pytest.approx(0.025) and trainer.warmup_steps == 5


def test_no_host_sync_between_logging_steps(tmp_path, monkeypatch):
    trainer = make(tmp_path, "train.max_steps=8", "log.every_steps=8", "eval.every_steps=0",
                   "ckpt.every_steps=0", "train.ema_decay=0.99", "train.grad_accum_steps=2")
    trainer.engine.guard.on_host = False  # the GPU path (on CPU the guard reads host memory: no device to wait on)
    syncs = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def spy(self, *a, _orig=original, _name=name, **k):
            syncs.append((trainer.state.step, _name))
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    original_write = trainer._log_train
    monkeypatch.setattr(trainer, "_log_train", lambda *a: (syncs.append(("log",)), original_write(*a))[1])
    micro = trainer.data.micro_batches(0)
    batches = [[next(micro) for _ in range(2)] for _ in range(7)]
    syncs.clear()
    for b in batches:  # seven non-logging steps: no tensor may be read on the host
        trainer.train_step(b)
        trainer.state.step += 1
    assert syncs == []


def test_corrupt_truncated_and_incomplete_checkpoints(tmp_path):
    trainer = make(tmp_path, "train.max_steps=4", "ckpt.every_steps=2")
    trainer.fit()
    root = tmp_path / "checkpoints"
    latest = root / (root / "latest").read_text().strip()

    def resume(which):
        reset_accelerate()
        return make(tmp_path, "train.max_steps=6", f"run.resume={which}")

    weights = latest / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors has \d+ bytes, expected \d+ \(truncated"):
        resume(latest)
    assert resume("auto").state.step == 2  # auto falls back to the previous good checkpoint
    flipped = bytearray(data)
    flipped[-1] ^= 0xFF
    weights.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="model.safetensors fails its sha256"):
        resume(latest)
    weights.write_bytes(data)
    (latest / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete: no manifest.json"):
        resume(latest)
    (root / "step_00000002" / "trainer_state.json").write_text("{}")  # size changes: caught by the manifest
    with pytest.raises(CheckpointError, match="trainer_state.json has"):
        resume("auto")  # nothing good left to fall back to


def test_interrupted_save_leaves_latest_intact(tmp_path):
    trainer = make(tmp_path, "train.max_steps=4", "ckpt.every_steps=2")
    trainer.fit()
    root = tmp_path / "checkpoints"
    (root / ".tmp-step_00000006").mkdir()  # a save killed half-way
    (root / ".tmp-step_00000006" / "model.safetensors").write_bytes(b"garbage")
    reset_accelerate()
    again = make(tmp_path, "train.max_steps=6")
    assert again.state.step == 4
    again.fit()
    assert (root / "latest").read_text().strip() == "step_00000006"
    assert not (root / ".tmp-step_00000006").exists()


def test_bf16_trains_and_fp16_on_cpu_is_refused(tmp_path):
    from trainer.config import ConfigError

    trainer = make(tmp_path / "bf16", "train.mixed_precision=bf16", "train.max_steps=10", "log.every_steps=5")
    trainer.fit()
    assert trainer.accelerator.mixed_precision == "bf16"
    assert math.isfinite(trainer.last_eval["loss"])
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="fp16 needs a CUDA GPU"):
            make(tmp_path / "fp16", "train.mixed_precision=fp16")


def test_best_checkpoint_is_kept_and_pointed_to(tmp_path):
    import json

    trainer = make(tmp_path, "train.max_steps=12", "eval.every_steps=2", "ckpt.every_steps=4", "ckpt.keep_last=1",
                   "optim.lr=0.2")  # a high lr makes the eval loss go up and down
    trainer.fit()
    evals = {r["step"]: r["eval/loss"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
             if "eval/loss" in r}
    best_step = min(evals, key=evals.get)
    root = tmp_path / "checkpoints"
    assert (root / "best").read_text().strip() == f"step_{best_step:08d}"
    assert (root / f"step_{best_step:08d}").is_dir()
    assert (root / "latest").read_text().strip() == "step_00000012"
    kept = sorted(p.name for p in root.glob("step_*"))
    assert kept == sorted({f"step_{best_step:08d}", "step_00000012"})
    assert trainer.state.best_step == best_step and trainer.state.best_metric == pytest.approx(evals[best_step])


def test_resume_none_moves_old_checkpoints_aside(tmp_path):
    make(tmp_path, "train.max_steps=2").fit()
    reset_accelerate()
    fresh = make(tmp_path, "train.max_steps=2", "run.resume=none")
    assert fresh.state.step == 0
    aside = list(tmp_path.glob("checkpoints.replaced-*"))
    assert len(aside) == 1 and (aside[0] / "step_00000002").is_dir()


def test_deepspeed_json_must_agree_with_trainer_config():
    from trainer.config import ConfigError
    from trainer.core.distributed import fill_deepspeed_config

    cfg = load_config(None, ["train.grad_accum_steps=2", "train.ema_decay=0.99"])
    filled = fill_deepspeed_config({"gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 3}}, cfg)
    assert filled["gradient_accumulation_steps"] == 2 and filled["bf16"]["enabled"] is False
    assert filled["zero_optimization"]["stage3_param_persistence_threshold"] == 0  # EMA needs partitions
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=4"):
        fill_deepspeed_config({"gradient_accumulation_steps": 4}, cfg)
    with pytest.raises(ConfigError, match="enables torch_autocast: remove that section and set train.mixed_precision"):
        fill_deepspeed_config({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, cfg)
    with pytest.raises(ConfigError, match="optimizer.type=Adam contradicts optim.name=adamw"):
        fill_deepspeed_config({"optimizer": {"type": "Adam"}}, cfg)
    with pytest.raises(ConfigError, match="persistence_threshold"):
        fill_deepspeed_config({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1e5}}, cfg)


def test_hf_trainer_deepspeed_configs_are_accepted(caplog):
    """The HF docs' ZeRO-2/3 files: their "auto" optimizer and scheduler sections mean the optim section;
    explicit values must agree with it (one line naming both values otherwise)."""
    import json

    from trainer.config import ConfigError
    from trainer.core.distributed import fill_deepspeed_config

    cfg = load_config(None, ["optim.lr=3e-4", "optim.warmup_steps=10", "train.max_steps=100"])
    for stage in (2, 3):
        hf = json.loads((ROOT / "tests" / "core" / "ds_configs_hf" / f"zero{stage}.json").read_text())
        filled = fill_deepspeed_config(hf, cfg)
        assert "optimizer" not in filled and "scheduler" not in filled  # the trainer builds both
        assert filled["zero_optimization"]["stage"] == stage
        assert "auto" not in json.dumps(filled)  # nothing left for accelerate to guess from a model.config
    assert "WarmupLR means optim.scheduler=constant_with_warmup" not in caplog.text  # the default schedule
    cosine = load_config(None, ["optim.scheduler=cosine"])
    fill_deepspeed_config({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}, cosine)
    assert "WarmupLR means optim.scheduler=constant_with_warmup" in caplog.text  # said, not silently changed
    agreeing = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.999], "weight_decay": 0}},
                "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-4, "warmup_num_steps": 10}}}
    fill_deepspeed_config(agreeing, cfg)
    with pytest.raises(ConfigError, match=r"optimizer.params.lr=0.001 but the trainer config implies 0.0003"):
        fill_deepspeed_config({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, cfg)
    with pytest.raises(ConfigError, match=r"scheduler.params.warmup_num_steps=500 .* implies 10"):
        fill_deepspeed_config({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 500}}}, cfg)
    with pytest.raises(ConfigError, match="scheduler.type=OneCycle has no counterpart"):
        fill_deepspeed_config({"scheduler": {"type": "OneCycle"}}, cfg)


@pytest.mark.usefixtures("fresh_accelerate")
def test_epochs_resolve_to_steps_and_are_saved(tmp_path):
    """Epochs become the plan's steps (plan.json); the config, and config.yaml, stay as loaded."""
    import copy
    import json

    import yaml

    from trainer.config import config_to_dict

    cfg = load_config(None, ["task.preset=tiny", f"run.output_dir={tmp_path}", "train.epochs=2.5",
                             "eval.every_epochs=1", "ckpt.every_epochs=2", "train.per_device_batch_size=16",
                             "log.progress_bar=false"])
    as_loaded = copy.deepcopy(cfg)
    trainer = Trainer(cfg)
    per_epoch, plan = trainer.data.batches_per_epoch, trainer.plan
    assert plan.max_steps == math.ceil(2.5 * per_epoch)
    assert (plan.eval_every_steps, plan.ckpt_every_steps) == (per_epoch, 2 * per_epoch)
    assert cfg == as_loaded  # the steps are the plan's, the config stays as loaded
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved == config_to_dict(as_loaded)
    assert json.loads((tmp_path / "plan.json").read_text())["max_steps"] == plan.max_steps


def test_summary_at_the_end_of_a_run(tmp_path, caplog):
    import logging

    trainer = make(tmp_path, "train.max_steps=4", "eval.every_steps=2", "optim.lr=0.2")
    with caplog.at_level(logging.INFO, logger="trainer"):
        assert trainer.fit() == "completed"
    summary = caplog.records[-1].getMessage()
    best = trainer.state.best_step
    assert summary.startswith("run completed at step 4 of 4")
    assert "final eval (step 4): loss " in summary  # the selection metric (eval.metric) first
    assert f"best eval  (step {best}, loss min): " + ("the final eval" if best == 4 else "loss ") in summary
    assert f"run directory: {tmp_path}" in summary
    assert f"best {tmp_path / 'checkpoints' / f'step_{best:08d}'}" in summary
    assert f"trainer export {tmp_path}" in summary and f"trainer plot {tmp_path}" in summary


def test_test_pass_with_the_best_weights(tmp_path):
    import json

    # eval.mode=max on a falling loss makes an early checkpoint the "best" one, so the test is not vacuous
    trainer = make(tmp_path, "train.max_steps=12", "eval.every_steps=2", "eval.mode=max", "eval.test_weights=best",
                   "train.ema_decay=0.5", "task.num_test=40")
    trainer.fit()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    best = trainer.state.best_step
    assert best not in (None, 12)
    tests = [r for r in records if "test/loss" in r]
    assert len(tests) == 1 and tests[0]["test/weights_step"] == best and tests[0]["step"] == 12
    saved = load_file(tmp_path / "checkpoints" / f"step_{best:08d}" / "model.safetensors")
    model = trainer.accelerator.unwrap_model(trainer.model)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0)
    ema = load_file(tmp_path / "checkpoints" / f"step_{best:08d}" / "ema.safetensors")
    for name, shadow in zip(trainer.ema.names, trainer.ema.shadow):  # the test pass used the best step's EMA
        torch.testing.assert_close(shadow, ema[name], rtol=0, atol=0)
    assert trainer.evaluate("test")["loss"] == pytest.approx(tests[0]["test/loss"], rel=1e-6)


def test_compile_needs_model_regions(tmp_path):
    """train.compile asks the model for its compile regions; a model without them is refused by name."""
    from trainer.config import ConfigError

    with pytest.raises(ConfigError, match="model Sequential declares no compile_regions"):
        make(tmp_path, "train.compile=true")


def test_weight_decay_exempts_1d_parameters_unless_decay_all(tmp_path):
    from trainer.core.optim import build_optimizer

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    for decay_all, expected in ((False, [(0.1, 1), (0.0, 3)]), (True, [(0.1, 4)])):
        cfg = load_config(None, ["optim.weight_decay=0.1", f"optim.decay_all_parameters={str(decay_all).lower()}"])
        groups = build_optimizer(cfg, model, 1e-3).param_groups
        assert [(g["weight_decay"], len(g["params"])) for g in groups] == expected


def test_sample_metrics_skipped_under_sharded_weights_are_announced_once_at_start(caplog):
    """Under FSDP / ZeRO-3 (no rank holds whole weights) evaluation draws no samples: one start note says so, and
    the evaluations skip quietly (each rank used to warn at every evaluation)."""
    from types import SimpleNamespace

    class Sampler:  # a generative task (GenerativeTask is a runtime-checkable protocol)
        def generate(self, model, generators, options, indices): ...
        def write_samples(self, samples, options, out): ...
        def score_samples(self, samples, options): ...

    cfg = load_config(str(ROOT / "configs" / "regression" / "tiny.yaml"),
                      ["eval.sample_every=1", "eval.every_steps=2", "train.max_steps=4"])
    trainer = SimpleNamespace(cfg=cfg, task=Sampler(), engine=SimpleNamespace(may_sample_in_eval=False), accelerator=None,
                              data=SimpleNamespace(sampler=None), resumed_from=None,
                              plan=SimpleNamespace(batch=SimpleNamespace(changes=()), eval_every_steps=2, max_steps=4),
                              state=SimpleNamespace(step=2))
    notes = Trainer._start_notes(trainer)
    assert [n for n in notes if n.startswith("eval.sample_every: no sample metrics")] == notes and len(notes) == 1
    with caplog.at_level("INFO", logger="trainer"):
        assert Trainer._sample_scores(trainer) == {}
    assert not caplog.records
    trainer.engine.may_sample_in_eval = True
    assert Trainer._start_notes(trainer) == []


def test_summary_lines_lead_with_the_selection_metric_and_count_subgroup_metrics():
    from trainer.core.run_logger import _format_metrics

    record = {"step": 9, "test/frac_correct": 0.5, "test/mse_de": 1.179, "test/combo_seen0/mse_de": 1.3,
              "test/combo_seen1/mse_de": 1.2, "test/n_conditions": 32}
    assert _format_metrics(record, "test/", "mse_de") == \
        "mse_de 1.179, frac_correct 0.5, n_conditions 32 (+2 subgroup metrics in metrics.jsonl)"
    assert _format_metrics(record, "test/", "combo_seen0/mse_de").startswith("combo_seen0/mse_de 1.3, frac_correct 0.5")
