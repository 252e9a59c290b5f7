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


def test_float32_dgate_near_the_root_of_silu_prime_with_huge_up():
    """silu' crosses 0 at gate = -1.2785, and float32's silu' errs by up to 9 x 2^-24 over [-16, -0.9] and without
    bound near the root: with |up| up to 1e30 that was 60 ulps of dgate. Every float32 within 1e-3 of the root,
    and a sweep of [-64, 4], must be within an ulp of the float64 reference."""
    root = np.float32(-1.2784645)
    near = np.arange(np.float32(root - 1e-3).view(np.uint32), np.float32(root + 1e-3).view(np.uint32), -1,
                     dtype=np.int64).astype(np.uint32).view(np.float32)
    rng = np.random.default_rng(7)
    gate = np.concatenate([near, rng.uniform(-64, 4, 1 << 16).astype(np.float32)])
    up = (rng.choice([-1.0, 1.0], gate.size) * np.exp(rng.uniform(0, 69, gate.size))).astype(np.float32)
    grad = rng.standard_normal(gate.size).astype(np.float32)
    want = spec.backward_op.run_reference(*(a.astype(np.float64) for a in (grad, gate, up)))[0]
    got = backward(grad, gate, up, backend="cpu")[0].astype(np.float64)
    ulps = np.abs(got - want) / np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    assert ulps.max() <= 1, f"{ulps.max():.1f} ulps at gate = {gate[ulps.argmax()]}"
