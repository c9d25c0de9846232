"""Parity of our SEDD (DDiT + score-entropy loss) with the reference implementation.

From the golden files (tests/families/protein_sedd/golden, written by scripts/parity/sedd.py from the
reference checkout) without the reference; and live against a checkout named by TRAINER_REFERENCE_SEDD.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import load_script

from trainer.families.protein_sedd.reference import (
    ROTARY_KEY,
    from_reference_state_dict,
    reference_state_dict,
    rotary_inv_freq,
)

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "parity" / "sedd.py"
GOLDEN = Path(__file__).resolve().parent / "golden"


@pytest.fixture(scope="module")
def parity():
    return load_script(SCRIPT, "sedd_parity")


@pytest.fixture(scope="module")
def golden(parity):
    return parity.load_golden(GOLDEN)


@pytest.mark.numerics
def test_golden_parity(parity, golden):
    """Our model, loaded from the reference's randomised weights through the key map, gives the reference's
    forward (eval, train), loss, gradients and one-SGD-step parameters within the tolerances."""
    state, inputs, ref, meta = golden
    assert meta["reference"]["license"] == "MIT" and len(meta["reference"]["commit"]) == 40
    assert ROTARY_KEY in state  # the reference's own layout, buffer included
    ours = parity.ours_outputs(state, **inputs, config=meta["config"])
    assert ours["round_trip"]
    assert parity.compare(ours, ref, meta["config"]["length"]) == []


@pytest.mark.numerics
def test_golden_parity_detects_a_changed_model(parity, golden):
    """The comparison is not vacuous: one weight moved by 1e-3, or the loss compared without the x L
    conversion, fails it."""
    state, inputs, ref, meta = golden
    length = meta["config"]["length"]
    moved = dict(state)
    moved["blocks.1.mlp.2.weight"] = state["blocks.1.mlp.2.weight"].clone()
    moved["blocks.1.mlp.2.weight"][0, 0] += 1e-3
    failures = parity.compare(parity.ours_outputs(moved, **inputs, config=meta["config"]), ref, length)
    assert any(f.startswith("forward (eval)") for f in failures)
    assert any(f.startswith("gradient") for f in failures)

    ours = parity.ours_outputs(state, **inputs, config=meta["config"])
    failures = parity.compare({**ours, "loss": ours["loss"] * length}, ref, length)
    assert [f for f in failures if f.startswith("loss")], failures


def test_key_map_round_trip_and_errors(parity, golden):
    state = golden[0]
    ours = from_reference_state_dict(state)
    assert set(ours) == set(state) - {ROTARY_KEY}
    back = reference_state_dict({f"module.{k}": v for k, v in ours.items()}, n_heads=2)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    assert torch.equal(state[ROTARY_KEY], rotary_inv_freq(8))

    bad = dict(state)
    bad[ROTARY_KEY] = state[ROTARY_KEY] * 2
    with pytest.raises(ValueError, match=r"ckpt\.pth: field 'rotary_emb\.inv_freq'"):
        from_reference_state_dict(bad, source="ckpt.pth")
    with pytest.raises(ValueError, match="not divisible by n_heads 3"):
        reference_state_dict(ours, n_heads=3)


@pytest.mark.skipif(not os.environ.get("TRAINER_REFERENCE_SEDD"), reason="set TRAINER_REFERENCE_SEDD to a checkout "
                    "of louaaron/Score-Entropy-Discrete-Diffusion for the live comparison")
def test_live_parity_with_reference():
    # A process of its own: importing the reference changes global TorchScript flags.
    proc = subprocess.run([sys.executable, str(SCRIPT), "--check-golden", str(GOLDEN)], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "parity: state dict round trip exact" in proc.stdout and "golden files in" in proc.stdout
