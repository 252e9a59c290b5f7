"""silu's backward on the cpu backend: its limits at the infinities, infinite upstream gradients, and blocks
that mix the fast formula with the careful one."""

from __future__ import annotations

import numpy as np
import pytest

import opport.backends.cpu._common as common
from opport.dtypes import FLOATS, np_dtype
from opport.ops.silu import silu as spec
from opport.public import function
from tests.ops._grad import check_backward_kernel

backward = function(spec.backward_op)


@pytest.mark.parametrize("dtype", FLOATS)
def test_limits_and_infinite_grads(dtype):
    x = np.array([-np.inf, np.inf, np.nan, 0.0, -np.inf, -110.0, 110.0], np_dtype(dtype))
    g = np.array([1.0, 1.0, 1.0, 1.0, np.inf, np.inf, -np.inf], np_dtype(dtype))
    (dx,) = backward(g, x, backend="cpu")
    dx = dx.astype(np.float64)
    assert dx[:2].tolist() == [0.0, 1.0] and np.isnan(dx[2]) and dx[3] == 0.5
    assert np.isnan(dx[4]), "inf * silu'(-inf) = inf * 0"
    assert dx[5] == -np.inf, "silu'(-110) < 0 is not 0, though float32 rounds it to 0"
    assert dx[6] == -np.inf


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_fast_and_careful_blocks_mixed_match_reference(monkeypatch, dtype):
    monkeypatch.setattr(common, "BLOCK_ELEMS", 64)
    monkeypatch.setattr(common, "PARALLEL_MIN", 0)
    for case in spec.backward_op.get_cases(dtype):
        check_backward_kernel(spec, case, dtype)
