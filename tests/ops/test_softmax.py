"""softmax on the cpu backend: fixed cases and Hypothesis examples against the float64 reference, and its exact semantics."""

from __future__ import annotations

import numpy as np
import pytest

import opport
from opport.dtypes import FLOATS, np_dtype
from opport.ops.softmax import softmax as spec
from tests.ops._check import fixed_cases_test, hypothesis_test, views_match_contiguous

test_fixed_cases_match_reference = fixed_cases_test(spec, min_cases=15)


test_hypothesis_examples_match_reference = hypothesis_test(spec)


@pytest.mark.parametrize("dtype", FLOATS)
def test_masked_rows(dtype):
    inf = np.inf
    x = np.array([[-inf, -inf, -inf], [-inf, 2.0, -inf], [0.0, -inf, 0.0], [1.0, inf, 0.0], [1.0, np.nan, 0.0]],
                 np_dtype(dtype))
    y = opport.softmax(x).astype(np.float64)
    assert np.isnan(y[0]).all(), "an all -inf row is NaN (torch.softmax)"
    assert y[1].tolist() == [0.0, 1.0, 0.0], "one finite value among -inf is exactly one-hot"
    assert y[2].tolist() == [0.5, 0.0, 0.5] and not np.signbit(y[2, 1])
    assert np.isnan(y[3]).all() and np.isnan(y[4]).all()


def test_shift_invariance_and_large_logits():
    base = np.random.default_rng(3).standard_normal((4, 257)).astype(np.float32)
    want = opport.softmax(base)
    for shift in (1e4, -1e4):  # exact in float32 within a binade, so the outputs must agree closely
        got = opport.softmax((base.astype(np.float64) + shift).astype(np.float32))
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-6)
    y = opport.softmax(np.array([[1e8, 0.0, -1e8]], np.float32))
    assert y.tolist() == [[1.0, 0.0, 0.0]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_long_rows_sum_to_one(dtype):
    x = np.random.default_rng(4).standard_normal((2, 128256)).astype(np_dtype(dtype))
    s = opport.softmax(x).astype(np.float64).sum(-1)
    assert np.all(np.abs(s - 1) <= (1e-5 if dtype == "float32" else 7.8e-3)), s


def test_any_axis_and_0d():
    x = np.random.default_rng(5).standard_normal((3, 4, 5)).astype(np.float32)
    for axis in (0, 1, 2, -1, -2, -3):
        got = opport.softmax(x, axis=axis)
        want = np.moveaxis(opport.softmax(np.moveaxis(x, axis, -1).copy()), -1, axis)
        np.testing.assert_array_equal(got, want)
        assert got.flags.c_contiguous
    assert opport.softmax(np.array(3.0, np.float32)).tolist() == 1.0


def test_invariant_rejects_rows_that_do_not_sum_to_one():
    x = np.ones((2, 4), np.float32)
    assert spec.invariants[0](np.full((2, 4), 0.25), x, -1) is None
    assert "do not sum to 1" in spec.invariants[0](np.full((2, 4), 0.2501), x, -1)
    x[0] = -np.inf  # NaN rows in the reference are not held to the sum
    assert spec.invariants[0](np.array([[np.nan] * 4, [0.25] * 4]), x, -1) is None


def test_views_and_public_call():
    x = np.random.default_rng(6).standard_normal((9, 14)).astype(np.float32)
    views_match_contiguous(spec, x)
    views_match_contiguous(spec, x, axis=0)
    y = opport.softmax(x.astype(np.float16))
    assert y.dtype == np.float16 and y.shape == x.shape


@pytest.mark.parametrize("dtype", ("float32", "float64"))
def test_rows_with_small_or_overflowing_sums_take_the_max_subtracted_form(dtype):
    """exp(x) / sum(exp(x)) is used only where the sum lies in [1, max float]; rows whose exps are all
    subnormal (sum < 1) or overflow must come out as accurate as exp(x - max) / sum(...)."""
    rng = np.random.default_rng(7)
    tiny = {"float32": -95.0, "float64": -740.0}[dtype]  # every exp() below the normal range
    big = {"float32": 85.0, "float64": 705.0}[dtype]  # each exp() finite, the row sum not
    rows = [rng.standard_normal(64) + tiny, rng.standard_normal(64) + big, rng.standard_normal(64) - 3.0,
            rng.standard_normal(64)]
    x = np.stack(rows).astype(dtype)
    got = opport.softmax(x, backend="cpu").astype(np.float64)
    want = spec.run_reference(x, -1)
    np.testing.assert_allclose(got, want, rtol=8 * np.finfo(dtype).eps, atol=0)
