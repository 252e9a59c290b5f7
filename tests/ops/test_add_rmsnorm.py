"""add_rmsnorm on the cpu backend: its two outputs against the float64 reference, the sum's rounding (the op's
definition), and the backward's shape as training sees it (one upstream gradient per output)."""

from __future__ import annotations

import numpy as np
import pytest

import opport
from opport import casegen as cg
from opport.accuracy import compare
from opport.dtypes import FLOATS, np_dtype
from opport.ops.add_rmsnorm import add_rmsnorm as spec
from opport.ops.rmsnorm import rmsnorm


@pytest.mark.parametrize("dtype", FLOATS)
def test_fixed_cases_match_reference_output_by_output(dtype):
    cases = list(spec.get_cases(dtype))
    assert len(cases) >= 20
    for case in cases:
        outs = opport.add_rmsnorm(*case.args, backend="cpu", **case.kwargs)
        refs = spec.run_reference(*case.args, **case.kwargs)
        assert isinstance(outs, tuple) and len(outs) == 2
        for i, (o, r) in enumerate(zip(outs, refs)):
            assert o.dtype == np_dtype(dtype) and o.shape == case.args[0].shape
            verdict = compare(o, np.asarray(r), spec.tolerance_for(dtype, i, case), dtype)
            assert verdict.ok, f"{case.name} {spec.output_names[i]}: {verdict.message}"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_reference_normalises_the_sum_rounded_to_the_dtype(dtype):
    """normed is rmsnorm of the rounded sum, not of the exact one: a small update on a large residual stream
    changes the norm's input only as far as the dtype keeps it."""
    rng = np.random.default_rng(0)
    x = cg.array((4, 64), dtype, rng, "normal", 1e-3)
    r = cg.array((4, 64), dtype, rng, "normal", 100.0)
    normed, total = spec.run_reference(x, r, None, 1e-6)
    rounded = cg.cast(x.astype(np.float64) + r.astype(np.float64), dtype)
    np.testing.assert_array_equal(total, rounded.astype(np.float64))
    np.testing.assert_array_equal(normed, rmsnorm.run_reference(rounded, None, 1e-6))
    exact = x.astype(np.float64) + r.astype(np.float64)
    assert not np.array_equal(total, exact)  # the case does round


def test_sum_is_exact_and_signed_zeros_kept():
    x = np.array([[-0.0, 0.0, 1.0, 65504.0]], np.float16)
    r = np.array([[-0.0, -0.0, 2.0**-11, 65504.0]], np.float16)
    _, total = opport.add_rmsnorm(x, r, backend="cpu")
    assert np.signbit(total[0, 0]) and not np.signbit(total[0, 1])
    assert total[0, 2] == np.float16(1.0) and np.isinf(total[0, 3])  # ties to even; overflow to inf
    assert spec.tolerance_for("bfloat16", 1).rtol == 0 and spec.tolerance_for("bfloat16", 0) == spec.tolerances["bfloat16"]


def test_vjp_takes_one_upstream_gradient_per_output():
    rng = np.random.default_rng(1)
    x, r, w = rng.standard_normal((3, 8)), rng.standard_normal((3, 8)), rng.random(8)
    (normed, total), pullback = opport.vjp("add_rmsnorm", x, r, w)
    gn, gs = rng.standard_normal((3, 8)), rng.standard_normal((3, 8))
    dx, dr, dw = pullback((gn, gs))
    dn, dw_norm = opport.vjp("rmsnorm", total, w)[1](gn)
    np.testing.assert_allclose(dx, dn + gs, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(dx, dr)
    np.testing.assert_allclose(dw, dw_norm, rtol=1e-12)
    with pytest.raises(opport.ArgumentError) as info:
        pullback(gn)
    assert info.value.constraint == "add_rmsnorm_backward.grad_shape"
    with pytest.raises(opport.ShapeError) as info:
        pullback((gn, gs[:, :7]))
    assert info.value.arg == "grad_sum"


def test_bad_inputs_name_their_constraint():
    x = np.ones((2, 8), np.float32)
    with pytest.raises(opport.ShapeError) as info:
        opport.add_rmsnorm(x, np.ones((2, 7), np.float32))
    assert info.value.constraint == "add_rmsnorm.residual_shape" and info.value.arg == "residual"
    with pytest.raises(opport.DTypeError) as info:
        opport.add_rmsnorm(x, x.astype(np.float16))
    assert info.value.constraint == "add_rmsnorm.dtype_mismatch"


def test_cost_counts_two_reads_and_two_writes():
    from opport.spec import Meta

    x, w = Meta("numpy", "float16", (16, 4096), None, "cpu"), Meta("numpy", "float16", (4096,), None, "cpu")
    assert spec.get_cost(x, x, w).bytes == 4 * 16 * 4096 * 2 + 4096 * 2
