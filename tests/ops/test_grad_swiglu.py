"""swiglu's backward on the cpu backend: dup is the forward itself, deep gates, mixed blocks."""

from __future__ import annotations

import numpy as np
import pytest

import opport.backends.cpu._common as common
from opport.dtypes import FLOATS
from opport.ops.swiglu import swiglu as spec
from opport.public import function
from tests.ops._grad import check_backward_kernel

backward = function(spec.backward_op)


@pytest.mark.parametrize("dtype", FLOATS)
def test_dup_is_swiglu_of_gate_and_grad(dtype):
    """dup = grad * silu(gate) = swiglu(gate, grad), bit for bit, special values included."""
    case = next(c for c in spec.get_cases(dtype) if c.name == "edge-grid")
    gate, up = case.args
    grad = up[::-1].copy()
    _, dup = backward(grad, gate, up, backend="cpu")
    want = function(spec)(gate, grad, backend="cpu")
    np.testing.assert_array_equal(dup.astype(np.float64), want.astype(np.float64))


def test_infinite_up_against_deep_gate():
    gate = np.array([-200.0, -np.inf, -60.0], np.float32)
    dgate, _ = backward(np.ones(3, np.float32), gate, np.array([np.inf, np.inf, 3e38], np.float32), backend="cpu")
    assert dgate[0] == -np.inf, "silu'(-200) < 0 though float32 rounds it to 0"
    assert np.isnan(dgate[1]), "silu'(-inf) = 0 times inf"
    assert np.isfinite(dgate[2]) and dgate[2] < 0


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_fast_and_careful_blocks_mixed_match_reference(monkeypatch, dtype):
    monkeypatch.setattr(common, "BLOCK_ELEMS", 64)
    monkeypatch.setattr(common, "PARALLEL_MIN", 0)
    for case in spec.backward_op.get_cases(dtype):
        check_backward_kernel(spec, case, dtype)
