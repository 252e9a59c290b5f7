"""gelu on the cpu backend: fixed cases and Hypothesis examples against the float64 reference, and its exact semantics."""

from __future__ import annotations

import numpy as np
import pytest

import opport
from opport.dtypes import FLOATS, np_dtype
from opport.ops.gelu import gelu as spec
from tests.ops._check import fixed_cases_test, hypothesis_test, views_match_contiguous

test_fixed_cases_match_reference = fixed_cases_test(spec, min_cases=15)


@pytest.mark.parametrize("dtype", FLOATS)
def test_cases_cover_both_forms(dtype):
    assert {c.kwargs["approximate"] for c in spec.get_cases(dtype)} == {"none", "tanh"}


test_hypothesis_examples_match_reference = hypothesis_test(spec)


# gelu(-3) to 12 digits, from math.erfc / math.tanh in float64. docs/numerics.md quotes TF's docs
# (-0.00404951, -0.00363752), which are TF's float32 outputs and off by ~1.8e-7 / 1.3e-7.
GELU_MINUS_3 = {"none": -0.004049694094890, "tanh": -0.003637392081773}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_minus_three_tells_the_forms_apart(dtype):
    x = np.array([-3.0], dtype)
    tight = 2e-9 if dtype == "float32" else 1e-14  # 8 float32 ULPs at 0.004 (the declared bound)
    for approximate, want in GELU_MINUS_3.items():
        assert abs(opport.gelu(x, approximate=approximate)[0] - want) < tight, approximate
        assert abs(spec.run_reference(x, approximate)[0] - want) < 1e-14, approximate
    assert abs(opport.gelu(x)[0] - -0.00404951) < 2e-7  # the quoted figures, to their own accuracy
    assert abs(opport.gelu(x, approximate="tanh")[0] - -0.00363752) < 2e-7
    assert abs(GELU_MINUS_3["none"] - GELU_MINUS_3["tanh"]) > 4e-4


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_infinities_zeros_and_nan(dtype, approximate):
    x = np.array([-np.inf, np.inf, np.nan, -0.0, 0.0, -1e4], np_dtype(dtype))
    y = opport.gelu(x, approximate=approximate).astype(np.float64)
    assert y[0] == 0 and np.signbit(y[0]), "gelu(-inf) must be -0.0"
    assert y[1] == np.inf and np.isnan(y[2])
    assert y[3] == 0 and np.signbit(y[3]) and y[4] == 0 and not np.signbit(y[4])
    assert y[5] == 0 and np.signbit(y[5])


def test_no_cancellation_in_the_negative_tail():
    # Phi(-5.5) is ~1.9e-8: 1 + erf(x/sqrt 2) in float32 would be 0 or off by 100%. What is left is the
    # float32 rounding of the exp argument (about |arg| * 6e-8 relative; arg ~ -63 at -9 in the tanh form).
    for approximate, x in (("none", [-5.5, -8.0, -12.0]), ("tanh", [-5.5, -8.0, -9.0])):
        x = np.array(x, np.float32)
        want = spec.run_reference(x.astype(np.float64), approximate)
        np.testing.assert_allclose(opport.gelu(x, approximate=approximate).astype(np.float64), want, rtol=5e-6)


def test_views_and_public_call():
    x = np.random.default_rng(1).standard_normal((9, 14)).astype(np.float32)
    views_match_contiguous(spec, x)
    views_match_contiguous(spec, x, approximate="tanh")
    y = opport.gelu(x.astype(np.float16), approximate="tanh")
    assert y.dtype == np.float16 and y.shape == x.shape
