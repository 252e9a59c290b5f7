"""matmul's backward beyond the generic checks of test_grad.py: typed errors, the batch sum of a shared b."""

from __future__ import annotations

import numpy as np

from opport.backends.cpu.matmul import matmul_backward as kernel
from opport.dispatch import call
from opport.ops.matmul import matmul as spec

BWD = spec.backward_op


def test_every_gradient_is_judged_normwise():
    for dtype in ("float32", "bfloat16"):
        assert all(BWD.tolerance_for(dtype, i).metric == "normwise" for i in range(3))


def test_shared_b_gradient_sums_the_batch():
    """A [K, N] b shared by a batch of a: db is the sum of the per-entry gradients, as if b were repeated."""
    rng = np.random.default_rng(0)
    a, b, bias = rng.standard_normal((3, 2, 5, 7)), rng.standard_normal((7, 4)), rng.standard_normal(4)
    g = rng.standard_normal((3, 2, 5, 4))
    da, db, dbias = kernel(g, a, b, bias)
    rep = np.ascontiguousarray(np.broadcast_to(b, (3, 2, 7, 4)))
    da_r, db_r, dbias_r = kernel(g, a, rep, bias)
    assert np.array_equal(da, da_r)
    assert np.allclose(db, db_r.sum(axis=(0, 1)), rtol=1e-13, atol=1e-13)
    assert np.allclose(dbias, g.sum(axis=(0, 1, 2)), rtol=1e-13, atol=1e-13) and np.array_equal(dbias, dbias_r)


def test_no_bias_no_bias_gradient():
    a, b, g = np.ones((2, 3), np.float32), np.ones((3, 4), np.float32), np.ones((2, 4), np.float32)
    da, db, dbias = call(BWD, BWD.bind(g, a, b), "cpu")
    assert dbias is None and np.array_equal(da, np.full((2, 3), 4.0, np.float32))
    assert np.array_equal(db, np.full((3, 4), 2.0, np.float32))
