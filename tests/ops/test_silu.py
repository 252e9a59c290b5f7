"""silu on the cpu backend: fixed cases and Hypothesis examples against the float64 reference, and its exact semantics."""

from __future__ import annotations

import numpy as np
import pytest

import opport
from opport.dtypes import FLOATS, np_dtype
from opport.ops.silu import silu as spec
from tests.ops._check import fixed_cases_test, hypothesis_test, views_match_contiguous

# --------------------------------------------------------------------------- silu


test_fixed_cases_match_reference = fixed_cases_test(spec, min_cases=15)


test_hypothesis_examples_match_reference = hypothesis_test(spec)


@pytest.mark.parametrize("dtype", FLOATS)
def test_infinities_and_nan(dtype):
    x = np.array([-np.inf, np.inf, np.nan, -0.0, 0.0], np_dtype(dtype))
    y = opport.silu(x).astype(np.float64)
    assert y[0] == 0 and np.signbit(y[0]), "silu(-inf) must be -0.0"
    assert y[1] == np.inf and np.isnan(y[2])
    assert y[3] == 0 and np.signbit(y[3]) and y[4] == 0 and not np.signbit(y[4])


def test_known_values_and_stable_tails():
    x = np.array([-1.0, 1.0, -88.72, 100.0, -100.0], np.float32)
    x64 = x.astype(np.float64)
    y = opport.silu(x)
    np.testing.assert_allclose(y[:4], x64[:4] / (1 + np.exp(-x64[:4])), rtol=4e-7)  # no inf/NaN from exp(88.72)
    assert y[4] < 0 and abs(y[4] - (-100 * np.exp(-100.0))) < 1e-43  # a subnormal result, not 0 or NaN


def test_views_and_public_call():
    x = np.random.default_rng(0).standard_normal((9, 14)).astype(np.float32)
    views_match_contiguous(spec, x)
    y = opport.silu(x.astype(np_dtype("bfloat16")))
    assert y.dtype == np_dtype("bfloat16") and y.shape == x.shape
