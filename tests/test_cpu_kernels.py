"""The numerics pass of `make test` (marker `numerics`, ATEN_CPU_CAPABILITY=avx2 / default) really runs torch's
kernels for that vector unit: otherwise a machine with AVX-512 would hide a result that depends on it."""

import os

import pytest
import torch


@pytest.mark.numerics
def test_the_kernels_asked_for_are_the_ones_torch_runs():
    asked = os.environ.get("ATEN_CPU_CAPABILITY")
    if not asked:
        pytest.skip("ATEN_CPU_CAPABILITY is not set: the machine's own kernels")
    assert torch.backends.cpu.get_cpu_capability().lower() == asked.lower()
