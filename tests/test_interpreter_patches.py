"""conftest's shortcut through Triton's interpreter (helpers inside a launch skip patches the launch already made):
kernels still compute what they compute without it, and every launch leaves triton.language as it found it."""

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from conftest import INTERPRET

pytestmark = pytest.mark.skipif(not INTERPRET, reason="the shortcut is for Triton's interpreter")


@triton.jit
def _scaled(x, factor):
    return x * factor


@triton.jit
def _row_sums_and_maxima(x_ptr, sums_ptr, maxima_ptr, N: tl.constexpr):
    row = tl.program_id(0)
    x = _scaled(tl.load(x_ptr + row * N + tl.arange(0, N)), 2.0)
    tl.store(sums_ptr + row, tl.sum(x, axis=0))  # tl.sum and tl.max: triton.language's own @jit helpers
    tl.store(maxima_ptr + row, tl.max(_scaled(x, 0.5), axis=0))


def test_launches_compute_as_before_and_restore_the_language():
    assert interpreter._patch_lang.__name__ == "patch_once"  # conftest installed it (else this tests triton alone)
    x = torch.randn(5, 16)
    for _ in range(2):  # a second launch patches again what the first one's end restored
        sums, maxima = torch.empty(5), torch.empty(5)
        _row_sums_and_maxima[(5,)](x, sums, maxima, N=16)
        torch.testing.assert_close(sums, (2 * x).sum(dim=1))
        torch.testing.assert_close(maxima, x.max(dim=1).values)
        assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.arange)  # restored
