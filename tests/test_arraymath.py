"""The helpers the float64 references and the cpu kernels share, each against hand-computed values
(a bug in them would otherwise pass the cpu conformance run: the oracle would share it)."""

from __future__ import annotations

import numpy as np
import pytest

from opport import arraymath as am
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


def test_fp8_groups_by_hand():
    x = np.arange(8.0).reshape(2, 4)
    assert am.scales_shape((2, 4), "tensor", 2) == (1, 1)
    assert am.scales_shape((2, 4), "token", 2) == (2, 1)
    assert am.scales_shape((2, 4), "block", 2) == (2, 2)
    assert am.grouped(x, "block", 2).tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert am.grouped(x, "token", 2).shape == (2, 1, 4) and am.grouped(x, "tensor", 2).shape == (1, 1, 8)


def test_scale_expansion_by_hand():
    k = 2 * am.BLOCK
    a = am.expand_a(np.array([[1.0, 2.0]]), k)
    assert a.shape == (1, k) and a[0, am.BLOCK - 1] == 1.0 and a[0, am.BLOCK] == 2.0
    b = am.expand_b(np.array([[1.0, 2.0], [3.0, 4.0]]), k, am.BLOCK + 3)  # the last column block cut at N
    assert b.shape == (k, am.BLOCK + 3) and b[0, am.BLOCK] == 2.0 and b[am.BLOCK, 0] == 3.0 and b[-1, -1] == 4.0
    assert am.expand_b(np.float64(5.0), k, 3) == 5.0  # 0-d as it is


def test_sequences_and_visibility_by_hand():
    assert am.cu([2, 0, 3]).tolist() == [0, 2, 2, 5] and am.cu([2, 0, 3]).dtype == np.int32
    assert am.sequences([0, 2, 5], [0, 1, 4]) == [(slice(0, 2), slice(0, 1)), (slice(2, 5), slice(1, 4))]
    assert am.visible(10, None) == (0, 10) and am.visible(10, 4) == (6, 10) and am.visible(3, 4) == (0, 3)
    lo, hi = am.visible_range(3, 5, causal=True)  # bottom-right: query i sees keys < i + 3
    assert lo.tolist() == [0, 0, 0] and hi.tolist() == [3, 4, 5]
    lo, hi = am.visible_range(3, 5, causal=True, window=2)
    assert lo.tolist() == [1, 2, 3] and am.visible_keys(3, 5, True, 2).tolist() == [2, 2, 2]
    assert am.visible_keys(2, 3, False).tolist() == [3, 3]
    assert am.capped(np.array([0.0, np.inf]), 2.0).tolist() == [0.0, 2.0]


def test_gather_by_hand():
    cache = np.arange(2 * 4 * 1 * 1).reshape(2, 4, 1, 1)  # 2 blocks of 4 positions
    rows = am.gather(cache, np.array([1, 0]), 2, 6)  # positions 2..5: block 1 (table[0]) then block 0
    assert rows[:, 0, 0].tolist() == [6, 7, 0, 1]
