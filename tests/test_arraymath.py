"""The helpers the float64 references and the cpu kernels share, each against hand-computed values
(a bug in them would otherwise pass the cpu conformance run: the oracle would share it)."""

from __future__ import annotations

import numpy as np
import pytest

from opport.arraymath import pair_views, reduce_losses, row_scale


def test_reduce_losses_by_hand():
    loss = np.array([1.0, 0.0, 3.0, 2.0])
    ignored = np.array([False, True, False, False])
    assert reduce_losses(loss, ignored, "none") is loss
    assert float(reduce_losses(loss, ignored, "sum")) == 6.0
    assert float(reduce_losses(loss, ignored, "mean")) == 2.0  # 6 over the 3 kept rows, not 4
    assert np.isnan(reduce_losses(np.zeros(2), np.array([True, True]), "mean"))  # every row ignored: NaN, as torch
    assert reduce_losses(loss.astype(np.float32), ignored, "mean").dtype == np.float32


def test_row_scale_by_hand():
    x = np.array([[3.0, -5.0], [1e300, 2.0], [np.inf, 1.0], [0.0, 0.0]])
    s = row_scale(x, 100.0)
    assert s.shape == (4, 1)
    assert s[0, 0] == 1.0 and s[2, 0] == 1.0 and s[3, 0] == 1.0  # small, non-finite and zero rows stay unscaled
    assert s[1, 0] == 2.0 ** -np.frexp(1e300)[1] and 0.5 <= 1e300 * s[1, 0] < 1.0


@pytest.mark.parametrize("interleaved, first, second", [(False, [0, 1, 2], [3, 4, 5]), (True, [0, 2, 4], [1, 3, 5])])
def test_pair_views_by_hand(interleaved, first, second):
    a = np.arange(12).reshape(2, 6)
    x1, x2 = pair_views(a, interleaved)
    assert x1[0].tolist() == first and x2[0].tolist() == second
    x1[...] = -1  # views, not copies: kernels write through them
    assert (a[0, first] == -1).all()
