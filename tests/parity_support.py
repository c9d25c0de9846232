"""What the families' parity and reference-checkpoint tests share: the scripts under scripts/parity/, their golden
files as module fixtures, the live checks against a reference checkout, and the ten-step rule checks."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
PARITY_DIR = ROOT / "scripts" / "parity"
CHECKPOINT_SCRIPT = PARITY_DIR / "reference_checkpoints.py"
"""scripts/parity/reference_checkpoints.py: the reference's own checkpoints written, imported and exported back."""


def parity_script(name: str) -> Path:
    """scripts/parity/<name>.py."""
    return PARITY_DIR / f"{name}.py"


def golden_dir(test_file: str, folder: str = "golden") -> Path:
    """The golden folder beside a test module (`__file__`): `golden` (parity) or `golden_checkpoint`."""
    return Path(test_file).resolve().parent / folder


def parity_fixtures(name: str, test_file: str, variants: list[str] | None = None,
                    ten_step_variant: str | None = None) -> tuple[Any, Any, Any]:
    """The module fixtures `parity` (scripts/parity/<name>.py imported), `golden` (its `load_golden` of the golden
    folder beside `test_file`, one per variant where the script keeps several) and `ten_step_golden` (its
    `load_ten_step_golden`, of `ten_step_variant` where given); assign them to those names in the test module."""
    golden = golden_dir(test_file)

    @pytest.fixture(scope="module", name="parity")
    def parity_fixture() -> Any:
        return load_script(parity_script(name), f"{name}_parity")

    @pytest.fixture(scope="module", name="golden", params=variants)
    def golden_fixture(request: pytest.FixtureRequest, parity: Any) -> Any:
        return parity.load_golden(golden, *([request.param] if variants else []))

    @pytest.fixture(scope="module", name="ten_step_golden")
    def ten_step_fixture(parity: Any) -> Any:
        return parity.load_ten_step_golden(golden, *([ten_step_variant] if ten_step_variant else []))

    return parity_fixture, golden_fixture, ten_step_fixture


def needs_reference(env: str, checkout: str, purpose: str = "comparison") -> pytest.MarkDecorator:
    """Skip unless `env` names a checkout of `checkout` (the reference, for the live `purpose`)."""
    return pytest.mark.skipif(not os.environ.get(env),
                              reason=f"set {env} to a checkout of {checkout} for the live {purpose}")


def run_script(script: Path, *args: str | Path, tail: int | None = None) -> str:
    """Run `script` with `args` in a process of its own (importing a reference changes global state, e.g.
    TorchScript flags) from the repository root; asserts it exits 0 (showing its output, the last `tail`
    characters of each stream where given) and returns its stdout."""
    proc = subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    out, err = (proc.stdout, proc.stderr) if tail is None else (proc.stdout[-tail:], proc.stderr[-tail:])
    assert proc.returncode == 0, out + err
    return proc.stdout


def live_parity_tests(name: str, test_file: str, env: str, checkout: str, parity_passed: str,
                      ten_steps_passed: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """A family's two live parity tests (skipped unless `env` names a checkout of `checkout`): scripts/parity/
    <name>.py --check-golden on the golden folder beside `test_file`, without and with --ten-steps; each exits 0,
    says what passed (`parity_passed`, `ten_steps_passed`) and that the golden files are current. Assign them to
    `test_live_parity_with_reference, test_live_ten_steps_with_reference` in the test module."""
    golden = golden_dir(test_file)

    @needs_reference(env, checkout)
    def test_live_parity_with_reference() -> None:
        out = run_script(parity_script(name), "--check-golden", golden)
        assert parity_passed in out and "golden files in" in out

    @needs_reference(env, checkout)
    def test_live_ten_steps_with_reference() -> None:
        out = run_script(parity_script(name), "--ten-steps", "--check-golden", golden)
        assert ten_steps_passed in out and "golden files in" in out

    return test_live_parity_with_reference, test_live_ten_steps_with_reference


def live_checkpoint_test(family: str, env: str, checkout: str) -> Callable[[], None]:
    """A family's live reference-checkpoint test (skipped unless `env` names a checkout of `checkout`):
    scripts/parity/reference_checkpoints.py `family` --check exits 0, the reference's checkpoint imported,
    exported back and read back by the reference equal. Assign it to
    `test_live_reference_checkpoint_imports_and_exports_back` in the test module."""

    @needs_reference(env, checkout, "check")
    def test_live_reference_checkpoint_imports_and_exports_back() -> None:
        out = run_script(CHECKPOINT_SCRIPT, family, "--check", tail=3000)
        assert "read back by the reference, every tensor equal" in out

    return test_live_reference_checkpoint_imports_and_exports_back


def assert_ten_steps_fail(parity: Any, ten_step_golden: tuple, fails: str, *overrides: str) -> None:
    """Our ten steps under the script's `TEN_OVERRIDES` plus `overrides` fail `compare_ten_steps` against the
    reference's golden ten steps with a message that starts with `fails`."""
    state, inputs, ref, meta = ten_step_golden
    ours = parity.ours_ten_steps(state, inputs, meta["config"], overrides=[*parity.TEN_OVERRIDES, *overrides])
    failures = parity.compare_ten_steps(ours, ref)
    assert any(f.startswith(fails) for f in failures), failures
