"""paged_attention: against opport's attention on the gathered dense K/V, windows and softcap, unseen slots,
bad tables, and the cuda and neuron kernels against the cpu one."""

import math

import numpy as np
import pytest

import opport
from opport.dispatch.registry import get_backend
from opport.errors import ArgumentError, DTypeError
from opport.ops.paged_attention import make_inputs
from opport.ops.paged_attention import paged_attention as spec


def dense(k_cache, v_cache, table, lo, hi):
    """One sequence's K and V as attention's [1, Hkv, n, D] (gathered with its own loop over positions)."""
    bs = k_cache.shape[1]
    k = np.stack([k_cache[table[p // bs], p % bs] for p in range(lo, hi)]) if hi > lo else k_cache[:0, 0]
    v = np.stack([v_cache[table[p // bs], p % bs] for p in range(lo, hi)]) if hi > lo else v_cache[:0, 0]
    return k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None]


def via_attention(q, kc, vc, bt, lens, window=None, scale=None):
    """Each sequence as opport.attention of its one query over its (windowed) dense K/V, float64 on cpu."""
    out = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        lo = 0 if window is None else max(0, n - window)
        k, v = dense(kc, vc, bt[b], lo, n)
        out.append(opport.attention(q[b][None, :, None, :], k, v, causal=True, scale=scale, backend="cpu")[0, :, 0])
    return np.stack(out)


def inputs(lens, hq=8, hkv=2, d=32, bs=16, dtype="float64", seed=0, **kw):
    return make_inputs(np.random.default_rng(seed), dtype, lens, hq, hkv, d, bs, **kw)


@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("window", [None, 1, 20])
def test_matches_attention_on_the_gathered_cache(bs, window):
    args = inputs([1, 16, 17, 100, 0], bs=bs)
    out = opport.paged_attention(*args, sliding_window=window, backend="cpu")
    assert np.allclose(out, via_attention(*args, window=window), rtol=1e-12, atol=1e-12)


def test_zero_length_outputs_zero_and_unseen_nan_never_leaks():
    q, kc, vc, bt, lens = inputs([0, 5, 33])
    assert np.isnan(kc).any() and np.isinf(vc).any()  # the slots no sequence sees
    out = opport.paged_attention(q, kc, vc, bt, lens, backend="cpu")
    assert np.isfinite(out).all() and (out[0] == 0).all()


def test_softcap_is_c_tanh_of_the_scaled_scores():
    q, kc, vc, bt, lens = inputs([40], hq=2, hkv=1, qk_scale=3.0)
    k, v = dense(kc, vc, bt[0], 0, 40)
    s = np.einsum("hd,nd->hn", q[0], k[0, 0]) / math.sqrt(32)
    s = 5.0 * np.tanh(s / 5.0)
    w = np.exp(s - s.max(-1, keepdims=True))
    want = (w / w.sum(-1, keepdims=True)) @ v[0, 0]
    assert np.allclose(opport.paged_attention(q, kc, vc, bt, lens, softcap=5.0, backend="cpu")[0], want, rtol=1e-12)


def test_table_entries_past_the_last_block_are_not_read():
    q, kc, vc, bt, lens = inputs([20, 3])
    bt[:, 2:] = -7  # padding the op must not look at (validated only up to each sequence's last block)
    assert np.allclose(opport.paged_attention(q, kc, vc, bt, lens, backend="cpu"), via_attention(q, kc, vc, bt, lens))


@pytest.mark.parametrize("table,lens,constraint", [
    ([[0, 9], [2, 3]], [20, 3], "paged_attention.block_range"),
    ([[0, 1], [-1, 3]], [20, 3], "paged_attention.block_range"),
    ([[0, 1], [2, 3]], [33, 3], "paged_attention.context_range"),
    ([[0, 1], [2, 3]], [20, -1], "paged_attention.context_range"),
])
def test_bad_tables_and_lengths_raise_typed_errors(table, lens, constraint):
    q, kc, vc = np.zeros((2, 4, 16), np.float32), np.zeros((5, 16, 2, 16), np.float32), np.zeros((5, 16, 2, 16), np.float32)
    with pytest.raises(ArgumentError) as e:
        opport.paged_attention(q, kc, vc, np.array(table, np.int32), np.array(lens, np.int32), backend="cpu")
    assert e.value.constraint == constraint and e.value.op == "paged_attention"


def test_int64_tables_are_refused():
    q, kc, vc, bt, lens = inputs([3])
    with pytest.raises(DTypeError) as e:
        opport.paged_attention(q, kc, vc, bt.astype(np.int64), lens)
    assert e.value.constraint == "paged_attention.index_dtype"


@pytest.mark.parametrize("backend", ["cuda", "neuron"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernels_match_the_cpu_kernel(backend, dtype):
    """Long (split over partitions on cuda), windowed and softcapped sequences in one batch."""
    b = get_backend(backend)
    if b.unavailable():
        pytest.skip(b.unavailable())
    args = inputs([600, 1, 0, 47], hq=4, hkv=2, d=64, dtype=dtype, seed=3)
    for kw in ({}, {"sliding_window": 100, "softcap": 10.0}):
        with opport.strict():
            got = opport.paged_attention(*args, **kw, backend=backend).astype(np.float64)
        ref = spec.run_reference(*args, **kw)
        tol = spec.tolerances[dtype]
        assert np.abs(got - ref).max() <= tol.atol + tol.rtol * np.abs(ref).max(), kw


def test_neuron_dma_traffic_is_the_visited_blocks():
    """The emulator's DMA bytes: at least the visible rows, within 1.1x of the visited blocks' K and V bytes."""
    b = get_backend("neuron")
    if b.unavailable():
        pytest.skip(b.unavailable())
    from opport.backends.neuron import nki_compat

    bs, hkv, d = 16, 2, 64
    for lens, window in (([300, 129, 64, 0], None), ([300, 129, 64, 0], 40)):
        args = inputs(lens, hq=8, hkv=hkv, d=d, bs=bs, dtype="bfloat16", seed=1)
        with nki_compat.collect_stats() as st, opport.strict():
            opport.paged_attention(*args, sliding_window=window, backend="neuron")
        spans = [(max(0, n - window) if window else 0, n) for n in lens]
        rows = sum(hi - lo for lo, hi in spans)
        blocks = sum(-(-hi // bs) - lo // bs for lo, hi in spans if hi > lo)
        per_row = hkv * 2 * d * 2  # K and V rows of every KV head, bfloat16
        assert rows * per_row <= st.dma_bytes <= 1.1 * blocks * bs * per_row, (window, st.dma_bytes, blocks)
