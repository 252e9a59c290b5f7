"""layernorm on the cpu backend: fixed cases and Hypothesis examples against the float64 reference, and its exact semantics."""

from __future__ import annotations

import numpy as np
import pytest

import opport
from opport.dtypes import FLOATS, np_dtype
from opport.ops.layernorm import layernorm as spec
from tests.ops._check import cpu_kernel, fixed_cases_test, hypothesis_test

test_fixed_cases_match_reference = fixed_cases_test(spec, min_cases=15, signed_zero=False)


test_hypothesis_examples_match_reference = hypothesis_test(spec, signed_zero=False)


@pytest.mark.parametrize("dtype", FLOATS)
def test_constant_rows_are_exactly_zero_then_bias(dtype):
    dt = np_dtype(dtype)
    x = np.array([[0.1] * 1000, [-7.3] * 1000, [1e30 if dtype in ("float32", "float64") else 1e4] * 1000], dt)
    b = np.arange(1000).astype(dt)
    assert np.all(opport.layernorm(x) == 0)
    np.testing.assert_array_equal(opport.layernorm(x, None, b), np.broadcast_to(b, x.shape))


def test_population_variance_and_affine():
    x = np.array([[1.0, 2.0, 3.0, 4.0]])
    w, b = np.array([1.0, 2.0, 3.0, 4.0]), np.array([0.5, 0.0, 0.0, -0.5])
    z = (x - 2.5) / np.sqrt(1.25 + 1e-5)  # var = 1.25 (divides by N, not N - 1)
    np.testing.assert_allclose(opport.layernorm(x, w, b), z * w + b, rtol=1e-15)


def test_huge_rows_stay_finite_like_the_exact_result():
    # float32 squares overflow above 1.8e19; the exact result is finite and scale invariant
    x = np.array([[3e38, -3e38, 1e38, 0.0], [1e20, 3e20, -2e20, 5e19]], np.float32)
    y = opport.layernorm(x).astype(np.float64)
    want = spec.run_reference(x.astype(np.float64))
    assert np.all(np.isfinite(y))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


def test_large_mean_small_spread_is_centred_accurately():
    x = (1000.0 + np.random.default_rng(7).standard_normal((4, 4096))).astype(np.float32)
    got = opport.layernorm(x).astype(np.float64)
    want = spec.run_reference(x.astype(np.float64))
    assert np.max(np.abs(got - want)) < 1e-5  # a one-pass float32 mean is off by ~5e-5 here (torch: 7e-5)


@pytest.mark.parametrize(("dtype", "offset"), [("float32", 1e6), ("float64", 1e15)])
def test_large_common_offset_forward_and_backward(dtype, offset):
    # the mean of offset + N(0, 1) rounds by up to half an ulp of the offset (0.03 at 1e6 in float32, 0.06 at 1e15
    # in float64): every x - mean was off by that before the rows were shifted by their first element
    from opport.dispatch import call
    from opport.ops.layernorm import layernorm_backward

    rng = np.random.default_rng(11)
    x, g = (offset + rng.standard_normal((4, 1000))).astype(dtype), rng.standard_normal((4, 1000)).astype(dtype)
    w = rng.uniform(-2, 2, 1000).astype(dtype)
    want = spec.run_reference(x, w, w)
    assert np.max(np.abs(opport.layernorm(x, w, w) - want)) < 1e-5
    for got, ref in zip(call(layernorm_backward, (g, x, w, w, 1e-5), "cpu"), layernorm_backward.run_reference(g, x, w, w)):
        assert np.max(np.abs(got - ref)) < 1e-5 * max(1.0, np.max(np.abs(ref)))


def test_views_and_public_call():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((10, 16)).astype(np.float32)
    w, b = rng.standard_normal((2, 16)).astype(np.float32)
    kernel = cpu_kernel(spec)
    for view in (x.T.copy().T, x[::2], np.broadcast_to(x[:1], (5, 16))):
        np.testing.assert_array_equal(kernel(view, w[::-1], b, 1e-5), kernel(view.copy(), w[::-1].copy(), b, 1e-5))
    y = opport.layernorm(x.astype(np.float16), w.astype(np.float16), b.astype(np.float16))
    assert y.dtype == np.float16 and y.shape == x.shape
