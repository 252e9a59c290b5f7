"""attention's backward beyond the generic checks of test_grad.py: rows that see no key, GQA sums, torch's
autograd, the training forward's lse, block boundaries, bounded memory and the scale bound."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

import opport.backends.cpu.attention as cpu_attention
from opport.backends.cpu.attention import attention_backward as kernel
from opport.casegen import cast
from opport.dispatch import call
from opport.errors import ArgumentError
from opport.ops.attention import attention as spec
from opport.spec import Case
from tests.ops._grad import check_backward_kernel

BWD = spec.backward_op
TRAIN = spec.train_forward


def qkv(b, hq, hkv, sq, sk, d, dv=None, seed=0, dtype="float64"):
    rng = np.random.default_rng(seed)
    return tuple(cast(rng.standard_normal(s), dtype) for s in ((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, dv or d)))


def saved(q, k, v, causal, scale=None):
    """What the training forward saves, from the float64 reference: (out in q's dtype, lse in the accumulation dtype)."""
    out, lse = TRAIN.run_reference(q, k, v, causal, scale)
    return cast(out, q.dtype.name), lse.astype(np.float64 if q.dtype == np.float64 else np.float32)


def backward(q, k, v, grad, causal, scale=None, fn=kernel):
    out, lse = saved(q, k, v, causal, scale)
    return fn(grad, q, k, v, out, lse, causal, scale)


@pytest.mark.parametrize("scale", (1e300, -1e5, 1e4 * (1 + 1e-15)))
def test_scale_beyond_the_bound_is_refused(scale):
    q, k, v = qkv(1, 2, 2, 3, 3, 4, dtype="float32")
    with pytest.raises(ArgumentError) as info:
        call(spec, spec.bind(q, k, v, False, scale), "cpu")
    assert info.value.constraint == "attention.scale"
    call(spec, spec.bind(q, k, v, False, 1e4), "cpu")  # the bound itself is allowed


@pytest.mark.parametrize("fn", (kernel, BWD.run_reference), ids=("kernel", "reference"))
def test_rows_that_see_no_key_get_zero_gradient_and_poison_nothing(fn):
    """Causal with Sq > Sk: rows 0..5 see no key. NaN in their q and dO changes nothing anywhere."""
    q, k, v = qkv(1, 4, 2, 10, 4, 8, seed=1, dtype="float32")
    g = cast(np.random.default_rng(2).standard_normal((1, 4, 10, 8)), "float32")
    clean = backward(q, k, v, g, True, fn=fn)
    q2, g2 = q.copy(), g.copy()
    q2[:, :, :6], g2[:, :, :6] = np.nan, np.inf
    dirty = backward(q2, k, v, g2, True, fn=fn)
    assert np.array_equal(dirty[0][:, :, :6], np.zeros((1, 4, 6, 8)))
    for a, b in zip(clean, dirty):
        assert np.isfinite(b).all()
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


def test_empty_keys_or_queries():
    for sq, sk in ((5, 0), (0, 7)):
        q, k, v = qkv(1, 2, 1, sq, sk, 8, dtype="float32")
        dq, dk, dv = backward(q, k, v, np.ones((1, 2, sq, 8), np.float32), True)
        assert not dq.any() and not dk.any() and not dv.any()
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


@pytest.mark.parametrize("causal", (False, True))
def test_gqa_gradients_are_the_sums_over_each_group(causal):
    """dk and dv of a KV head shared by g query heads equal the sum of the g gradients of its repeated copies."""
    q, k, v = qkv(2, 6, 2, 9, 13, 8, 5, seed=3)
    g = np.random.default_rng(4).standard_normal((2, 6, 9, 5))
    dq, dk, dv = backward(q, k, v, g, causal)
    kr, vr = np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1)
    dq_r, dk_r, dv_r = backward(q, kr, vr, g, causal)
    np.testing.assert_allclose(dq, dq_r, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dk, dk_r.reshape(2, 2, 3, 13, 8).sum(axis=2), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dv, dv_r.reshape(2, 2, 3, 13, 5).sum(axis=2), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("sq,sk,causal,scale", [(7, 7, True, None), (5, 11, True, 0.3), (11, 5, True, None),
                                                (6, 9, False, 2.0)])
def test_matches_torch_autograd_in_float64(sq, sk, causal, scale):
    torch = pytest.importorskip("torch")
    q, k, v = qkv(1, 4, 2, sq, sk, 8, 6, seed=sq + sk)
    g = np.random.default_rng(5).standard_normal((1, 4, sq, 6))
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    seen = torch.tensor((j <= i + sk - sq) | (not causal))  # bottom-right causal
    s = tq @ tk.repeat_interleave(2, 1).transpose(-1, -2) * (scale if scale else 1 / math.sqrt(8))
    w = torch.softmax(s.masked_fill(~seen, -math.inf), -1).nan_to_num(0.0)  # rows that see nothing: 0
    (w @ tv.repeat_interleave(2, 1)).backward(torch.tensor(g))
    for got, want in zip(backward(q, k, v, g, causal, scale), (tq.grad, tk.grad, tv.grad)):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=1e-6)  # (the saved lse is float32)


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_many_blocks_and_head_chunks(monkeypatch, dtype):
    """Tiny blocks and budget: every block boundary, partly masked blocks, one-head steps and the per-row path."""
    monkeypatch.setattr(cpu_attention, "BLOCK_Q", 4)
    monkeypatch.setattr(cpu_attention, "BLOCK_K", 5)
    monkeypatch.setattr(cpu_attention, "SCORE_BUDGET", 1)
    monkeypatch.setattr(cpu_attention, "BACKWARD_SCORE_BUDGET", 1)
    for case in BWD.get_cases(dtype):
        if case.args[1].size <= 20000:
            check_backward_kernel(spec, case, dtype)


@pytest.mark.parametrize("causal,window,softcap", ((True, None, None), (False, None, None), (True, 5, 30.0)))
def test_heads_per_step_do_not_change_the_bits(monkeypatch, causal, window, softcap):
    """BACKWARD_SCORE_BUDGET only groups KV heads into steps: one head a step, some, or all give the same bits."""
    q, k, v = qkv(2, 6, 3, 37, 37, 16, seed=8, dtype="float32")
    g = cast(np.random.default_rng(9).standard_normal((2, 6, 37, 16)), "float32")
    out, lse = cpu_attention.attention_forward(q, k, v, causal, None, softcap, window)
    runs = []
    for budget in (1, 2 * 37 * 37 * 4 * 2, 1 << 30):  # one head a step, two, all six (batches merged)
        monkeypatch.setattr(cpu_attention, "BACKWARD_SCORE_BUDGET", budget)
        runs.append(kernel(g, q, k, v, out, lse, causal, None, softcap, window))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a, b)


def test_merged_batches_and_strided_inputs_agree_bitwise(monkeypatch):
    q, k, v = qkv(3, 4, 2, 6, 9, 8, seed=6, dtype="float32")
    g = cast(np.random.default_rng(7).standard_normal((3, 4, 6, 8)), "float32")
    merged = backward(q, k, v, g, True)
    kt = np.ascontiguousarray(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # a [B, S, H, D] cache: merged as a copy
    assert cpu_attention._views_merged(k) and not cpu_attention._views_merged(kt)
    for a, b in zip(merged, backward(q, kt, v, g, True)):
        np.testing.assert_array_equal(a, b)
    monkeypatch.setattr(cpu_attention, "MERGE_COPY_MAX", 0)  # no copies: batch by batch
    assert cpu_attention._batch_heads_merge(q, kt, v, g, g) is None
    for a, b in zip(merged, backward(q, kt, v, g, True)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(merged, backward(q, k, v, g, True)):
        np.testing.assert_array_equal(a, b)  # deterministic


def test_memory_stays_bounded_at_long_sequences():
    s, d = 4096, 32  # inputs, outputs and accumulators O(S·D), score blocks O(BLOCK_Q·BLOCK_K): no O(S^2)
    q, k, v = qkv(1, 1, 1, s, s, d, seed=8, dtype="float32")
    g = np.ones((1, 1, s, d), np.float32)
    out, lse = np.zeros((1, 1, s, d), np.float32), np.zeros((1, 1, s), np.float32)  # (only shapes matter here)
    tracemalloc.start()
    try:
        grads = kernel(g, q, k, v, out, lse, True, None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < s * s * 4 / 8, f"peak {peak} bytes: an S x S temporary ({s * s * 4} bytes) is being built"
    assert all(np.isfinite(a).all() for a in grads)


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_window_and_softcap_gradients_across_small_blocks(monkeypatch, dtype):
    """The cpu backward with tiny blocks against the float64 VJP: windows starting inside key blocks, skipped
    blocks, the soft cap's slope, and NaN in a key that late rows' windows exclude."""
    monkeypatch.setattr(cpu_attention, "BLOCK_Q", 4)
    monkeypatch.setattr(cpu_attention, "BLOCK_K", 5)
    monkeypatch.setattr(cpu_attention, "SCORE_BUDGET", 1)
    for sq, sk, w in ((23, 31, 6), (19, 13, 2)):
        q, k, v = qkv(1, 4, 2, sq, sk, 8, seed=sq, dtype=dtype)
        k[:, :, 0, 0] = cast(np.nan, dtype)
        case = BWD.from_forward(Case(f"w{w}", (q, k, v), {"causal": True, "softcap": 4.0, "sliding_window": w}), dtype)
        dq = check_backward_kernel(spec, case, dtype)[0]  # judged against the float64 VJP
        assert np.isfinite(dq[:, :, -1]).all()  # the last row's window excludes key 0
