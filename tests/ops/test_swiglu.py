"""swiglu on the cpu backend: fixed cases and Hypothesis examples against the float64 reference, and its exact semantics."""

from __future__ import annotations

import numpy as np
import pytest

import opport
from opport.dtypes import FLOATS, np_dtype
from opport.ops.swiglu import swiglu as spec
from tests.ops._check import fixed_cases_test, hypothesis_test, views_match_contiguous

test_fixed_cases_match_reference = fixed_cases_test(spec, min_cases=15)


test_hypothesis_examples_match_reference = hypothesis_test(spec)


@pytest.mark.parametrize("dtype", FLOATS)
def test_is_silu_times_up_with_the_inf_rules(dtype):
    dt = np_dtype(dtype)
    gate = np.array([-np.inf, -np.inf, np.inf, np.inf, 1.0, -1.0, np.nan, 2.0], dt)
    up = np.array([2.0, np.inf, 0.0, -3.0, np.nan, 4.0, 1.0, 0.0], dt)
    y = opport.swiglu(gate, up).astype(np.float64)
    assert y[0] == 0 and np.signbit(y[0])  # silu(-inf) * 2 = -0.0
    assert np.isnan(y[1]) and np.isnan(y[2])  # -0.0 * inf, inf * 0
    assert y[3] == -np.inf and np.isnan(y[4]) and np.isnan(y[6])
    assert y[7] == 0
    np.testing.assert_allclose(y[5], opport.silu(gate[5:6]).astype(np.float64)[0] * 4.0, rtol=1e-2)


def test_16bit_product_overflows_to_inf_like_the_rounded_reference():
    g = np.array([60000.0, -60000.0], np.float16)
    y = opport.swiglu(g, np.array([2.0, 2.0], np.float16))
    assert y[0] == np.inf and y[1] == 0 and np.signbit(y[1])


def test_views_and_public_call():
    rng = np.random.default_rng(2)
    g, u = rng.standard_normal((2, 9, 14)).astype(np.float32)
    views_match_contiguous(spec, g, u)
    y = opport.swiglu(g.astype(np.float16), u.astype(np.float16))
    assert y.dtype == np.float16 and y.shape == g.shape
