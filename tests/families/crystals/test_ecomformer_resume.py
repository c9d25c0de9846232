"""An eComFormer run resumes: its empty e3nn tensor-product weights, which accelerate's safetensors save drops as
shared tensors, are not read as a different model."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import cli_in_process

ROOT = Path(__file__).resolve().parents[3]


def test_an_ecomformer_run_resumes_from_its_checkpoint(tmp_path):
    common = [str(ROOT / "configs" / "crystals" / "comformer_tiny.yaml"), "task.variant=ecomformer",
              f"run.output_dir={tmp_path / 'run'}", f"task.cache_dir={tmp_path / 'cache'}", "ckpt.every_steps=2",
              "eval.every_epochs=0", "log.progress_bar=false", "log.tensorboard=false"]
    cli_in_process("train", *common, "train.max_steps=2")
    cli_in_process("train", *common, "train.max_steps=3")
    steps = [json.loads(line).get("step") for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(s for s in steps if s is not None) == 3
