"""rope's backward beyond the generic checks of test_grad.py: typed errors, the inverse rotation, the tables' forms."""

from __future__ import annotations

import numpy as np
import pytest

from opport.backends.cpu.rope import rope as forward_kernel
from opport.backends.cpu.rope import rope_backward as kernel
from opport.ops.rope import angle_tables
from opport.ops.rope import rope as spec

BWD = spec.backward_op


def test_tables_are_constants():
    assert BWD.wrt == ("x",) and set(BWD.constants) == {"cos", "sin"}
    assert all("not parameters" in why for why in BWD.constants.values())


@pytest.mark.parametrize("interleaved", (False, True))
def test_dx_is_the_inverse_rotation(interleaved):
    """The rotation is orthogonal: rotating dx forward gives grad back; and <dx, x> = <grad, rope(x)>."""
    rng = np.random.default_rng(0)
    g, x = rng.standard_normal((2, 3, 9, 16)), rng.standard_normal((2, 3, 9, 16))
    cos, sin = angle_tables(np.arange(9)[None] + np.array([[0], [70000]]), 16, "float64")
    (dx,) = kernel(g, cos, sin, interleaved)
    assert np.allclose(forward_kernel(dx, cos, sin, interleaved), g, rtol=1e-13, atol=1e-13)
    assert np.isclose(np.sum(dx * x), np.sum(g * forward_kernel(x, cos, sin, interleaved)), rtol=1e-12)


def test_table_forms_agree():
    """[S, D/2], [1, S, D/2] and the same table repeated [B, S, D/2]: bitwise the same dx."""
    rng = np.random.default_rng(1)
    g = rng.standard_normal((3, 2, 5, 8)).astype(np.float32)
    cos, sin = angle_tables(np.arange(5), 8)
    (shared,) = kernel(g, cos, sin, False)
    assert np.array_equal(kernel(g, cos[None], sin[None], False)[0], shared)
    rep = [np.ascontiguousarray(np.broadcast_to(t, (3, 5, 4))) for t in (cos, sin)]
    assert np.array_equal(kernel(g, *rep, False)[0], shared)
