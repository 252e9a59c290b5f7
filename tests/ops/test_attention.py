"""attention: the cpu kernel against the float64 reference, torch SDPA, a brute-force mask, and its memory bound."""

import math
import tracemalloc
from functools import partial

import numpy as np
import pytest

import opport
import opport.backends.cpu.attention as cpu_attention
from opport.backends.cpu.attention import attention as kernel
from opport.casegen import cast
from opport.dispatch.adapters import NumpyAdapter
from opport.ops.attention import attention as spec
from tests.ops import _check

DTYPES = ("float32", "float16", "bfloat16", "float64")


assert_matches = partial(_check.assert_matches, spec)


def run(case):
    return kernel(*spec.bind(*case.args, **case.kwargs))


def qkv(b, hq, hkv, sq, sk, d, dv=None, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(s).astype(dtype) for s in ((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, dv or d)))


def brute_force(q, k, v, causal, scale=None):
    """Dense float64 attention with an explicit boolean mask, independent of the reference's prefix loop."""
    g = q.shape[1] // k.shape[1]
    sq, sk = q.shape[2], k.shape[2]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = q @ k.swapaxes(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    seen = np.array([[(j <= i + sk - sq) or not causal for j in range(sk)] for i in range(sq)], bool).reshape(sq, sk)
    w = np.where(seen, np.exp(s - np.where(seen, s, -np.inf).max(-1, keepdims=True, initial=-np.inf)), 0.0)
    den = w.sum(-1, keepdims=True)
    return np.where(den > 0, (w / np.where(den > 0, den, 1)) @ v, 0.0)


test_fixed_cases = _check.fixed_cases_test(spec, signed_zero=False)
test_hypothesis_cases = _check.hypothesis_test(spec, signed_zero=False)


@pytest.mark.parametrize("sq,sk", [(1, 9), (7, 7), (9, 5), (5, 9), (3, 0)])
@pytest.mark.parametrize("causal", [False, True])
def test_bottom_right_mask_matches_brute_force(sq, sk, causal):
    q, k, v = qkv(2, 4, 2, sq, sk, 8, 5, seed=sq * 10 + sk)
    out = kernel(q, k, v, causal, None)
    assert np.allclose(out, brute_force(q, k, v, causal), rtol=1e-12, atol=1e-12)


def test_rows_that_see_no_key_are_exactly_zero_even_with_nan_queries():
    q, k, v = qkv(1, 2, 1, 10, 4, 8)
    q[:, :, :6] = np.nan  # rows 0..5 see no key (i + Sk - Sq < 0)
    out = kernel(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), True, None)
    assert np.array_equal(out[:, :, :6], np.zeros((1, 2, 6, 8), np.float32))
    assert np.isfinite(out[:, :, 6:]).all() and np.abs(out[:, :, 6:]).max() > 0


def test_nan_under_the_mask_does_not_leak():
    q, k, v = qkv(1, 2, 2, 6, 6, 8)
    clean = kernel(q, k, v, True, None)
    k2, v2 = k.copy(), v.copy()
    k2[:, :, 3:] = np.nan  # masked for rows 0..2
    v2[:, :, 3:] = np.inf
    dirty = kernel(q, k2, v2, True, None)
    assert np.allclose(dirty[:, :, :3], clean[:, :, :3], rtol=1e-14, atol=1e-14)  # (prefix sums round differently)
    assert np.isnan(dirty[:, :, 3:]).all()  # rows that do see the NaN keys are NaN


def test_gqa_head_mapping():
    q, k, v = qkv(1, 6, 2, 5, 7, 4)
    out = kernel(q, k, v, False, None)
    for h in range(6):  # query head h reads KV head h // (Hq / Hkv)
        single = kernel(q[:, h:h + 1], k[:, h // 3:h // 3 + 1], v[:, h // 3:h // 3 + 1], False, None)
        assert np.allclose(out[:, h:h + 1], single, rtol=1e-13, atol=1e-13)
    rep = kernel(q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1), False, None)
    assert np.allclose(out, rep, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("sq,sk", [(13, 13), (5, 21), (21, 5)])
def test_matches_torch_sdpa(sq, sk):
    import torch
    import torch.nn.functional as F

    q, k, v = qkv(2, 8, 2, sq, sk, 16, seed=3)
    tq, tk, tv = map(torch.from_numpy, (q, k, v))
    for causal in (False, True):
        # torch's is_causal is top-left; the bottom-right convention is an explicit mask (Sq > Sk rows see nothing,
        # where SDPA's math path gives NaN, so compare only rows that see a key)
        mask = torch.ones(sq, sk, dtype=torch.bool).tril(diagonal=sk - sq) if causal else None
        ref = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, enable_gqa=True, scale=0.3).numpy()
        out = kernel(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), causal, 0.3)
        rows = slice(max(sq - sk, 0) if causal else 0, None)
        assert np.allclose(out[:, :, rows], ref[:, :, rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_many_blocks_and_head_chunks(monkeypatch, dtype):
    """Tiny blocks and a tiny budget: every block boundary, partly masked blocks and one-head steps are exercised."""
    monkeypatch.setattr(cpu_attention, "BLOCK_Q", 4)
    monkeypatch.setattr(cpu_attention, "BLOCK_Q_MASKED", 3)  # masked calls' own block rows
    monkeypatch.setattr(cpu_attention, "BLOCK_K", 5)
    monkeypatch.setattr(cpu_attention, "SCORE_BUDGET", 1)
    for sq, sk, causal in ((23, 31, True), (31, 23, True), (17, 17, False)):
        q, k, v = (cast(a, dtype) for a in qkv(2, 4, 2, sq, sk, 8, seed=sq))
        k[:, :, -1, 0] = cast(np.nan, dtype)  # masked for all but the last row when causal
        v[:, :, -1, 1] = cast(np.inf, dtype)
        case = opport.spec.Case(f"blocks-{sq}-{sk}", (q, k, v), {"causal": causal})
        assert_matches(case, dtype, run(case))


def test_memory_stays_bounded_at_long_sequences():
    s, d = 2048, 32
    q, k, v = (a.astype(np.float32) for a in qkv(1, 1, 1, s, s, d, seed=5))
    tracemalloc.start()
    try:
        out = kernel(q, k, v, True, None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    score_matrix = s * s * 4
    assert peak < score_matrix / 8, f"peak {peak} bytes: an S x S temporary ({score_matrix} bytes) is being built"
    assert np.isfinite(out).all()


@pytest.mark.parametrize("dtype", ("float32", "float16"))
def test_strided_inputs_match_contiguous_and_are_not_mutated(dtype):
    q, k, v = (cast(a, dtype) for a in qkv(1, 4, 2, 9, 12, 8))
    qt = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # [B, S, H, D] memory, as from a QKV proj
    kt = np.ascontiguousarray(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    vs = np.repeat(v, 2, axis=-1)[..., ::2]
    before = [a.copy() for a in (qt, kt, vs)]
    out = kernel(qt, kt, vs, True, None)
    assert np.array_equal(out, kernel(q, k, v, True, None))
    assert all(np.array_equal(a, b) for a, b in zip((qt, kt, vs), before))


def test_dispatch_reaches_cpu_kernel():
    q, k, v = (a.astype(np.float32) for a in qkv(1, 2, 1, 3, 3, 4))
    assert opport.explain("attention", q, k, v, backend="cpu").kernel == "cpu.attention"
    assert np.array_equal(opport.attention(q, k, v, causal=True, backend="cpu"), kernel(q, k, v, True, None))




def test_cost_counts_visible_pairs():
    metas = [NumpyAdapter.meta(np.ones(s, np.float16)) for s in ((1, 4, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16))]
    full, causal = spec.get_cost(*metas), spec.get_cost(*metas, causal=True)
    assert full.flops == 4 * 1 * 4 * 8 * 8 * 16
    assert causal.flops == full.flops * 36 // 64  # 8·9/2 of 64 pairs
    assert full.bytes == 2 * (512 + 256 + 256 + 512)


@pytest.mark.parametrize("sq", (1, 5))
def test_batches_merged_or_not_give_the_same_result(sq, monkeypatch):
    """Contiguous inputs run all batch entries as one [1, B*H] problem (decode: one large step); a KV cache
    laid out [B, S, H, D] cannot merge as views: it is copied while the copies stay under MERGE_COPY_MAX, and
    runs batch by batch above it. All three must agree bitwise."""
    q, k, v = (a.astype(np.float32) for a in qkv(3, 8, 2, sq, 40, 16, seed=11))
    assert cpu_attention._batch_heads_merge(q, k, v) == (q, k, v)  # the arrays themselves: no copy
    kt = np.ascontiguousarray(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    vt = np.ascontiguousarray(v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    assert not cpu_attention._views_merged(kt) and not cpu_attention._views_merged(vt)
    copied = cpu_attention._batch_heads_merge(q, kt, vt)
    assert copied[0] is q and copied[1].flags.c_contiguous and copied[2].flags.c_contiguous
    for causal in (False, True):
        merged = kernel(q, k, v, causal, None)
        assert np.array_equal(merged, kernel(q, kt, vt, causal, None))
        with monkeypatch.context() as m:
            m.setattr(cpu_attention, "MERGE_COPY_MAX", 0)
            assert cpu_attention._batch_heads_merge(q, kt, vt) is None  # over the cap: batch by batch
            assert np.array_equal(merged, kernel(q, kt, vt, causal, None))
        case = opport.spec.Case(f"batches-{sq}", (q, k, v), {"causal": causal})
        assert_matches(case, "float32", merged)


# --------------------------------------------------------------------------- soft cap and sliding window


def brute_force_capped(q, k, v, causal, softcap=None, window=None):
    """Dense float64 attention with an explicit mask: c·tanh(s / c), then key j visible to query i iff
    p - W < j <= p, p = i + Sk - Sq (bottom-right)."""
    g = q.shape[1] // k.shape[1]
    sq, sk = q.shape[2], k.shape[2]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = q @ k.swapaxes(-1, -2) / math.sqrt(q.shape[-1])
    s = s if softcap is None else softcap * np.tanh(s / softcap)
    p, j = np.arange(sq)[:, None] + sk - sq, np.arange(sk)[None, :]
    seen = (j <= p) if causal else np.ones((sq, sk), bool)
    seen = seen & (j > p - window) if window else seen
    w = np.where(seen, np.exp(s - np.where(seen, s, -np.inf).max(-1, keepdims=True, initial=-np.inf)), 0.0)
    den = w.sum(-1, keepdims=True)
    return np.where(den > 0, (w / np.where(den > 0, den, 1)) @ v, 0.0)


@pytest.mark.parametrize("sq,sk", [(1, 9), (7, 7), (9, 5), (5, 9), (3, 0), (30, 30)])
@pytest.mark.parametrize("window", [1, 3, 8, 100])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_window_and_softcap_match_brute_force(sq, sk, window, softcap):
    q, k, v = qkv(2, 4, 2, sq, sk, 8, 5, seed=sq * 10 + sk)
    out = kernel(q, k, v, True, None, softcap, window)
    assert np.allclose(out, brute_force_capped(q, k, v, True, softcap, window), rtol=1e-12, atol=1e-12)


def test_softcap_without_causal_matches_brute_force():
    q, k, v = qkv(1, 2, 2, 6, 11, 8, seed=4)
    q *= 4
    assert np.allclose(kernel(q, k, v, False, None, 3.0), brute_force_capped(q, k, v, False, 3.0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_window_skips_and_masks_across_small_blocks(monkeypatch, dtype):
    """Tiny blocks: windows that start inside a key block, blocks before every row's window (skipped), and
    NaN/inf in keys that only rows outside their window could see."""
    monkeypatch.setattr(cpu_attention, "BLOCK_Q", 4)
    monkeypatch.setattr(cpu_attention, "BLOCK_Q_MASKED", 3)  # masked calls' own block rows
    monkeypatch.setattr(cpu_attention, "BLOCK_K", 5)
    monkeypatch.setattr(cpu_attention, "SCORE_BUDGET", 1)
    for sq, sk, w in ((23, 31, 6), (31, 23, 3), (17, 17, 1)):
        q, k, v = (cast(a, dtype) for a in qkv(2, 4, 2, sq, sk, 8, seed=sq))
        k[:, :, 0, 0] = cast(np.nan, dtype)  # inside the window of the first rows only
        v[:, :, 1, 1] = cast(np.inf, dtype)
        case = opport.spec.Case(f"window-blocks-{sq}-{sk}", (q, k, v), {"causal": True, "sliding_window": w,
                                                                         "softcap": 5.0})
        out = run(case)
        assert_matches(case, dtype, out)
        assert np.isfinite(out[:, :, -1]).all()  # the last row's window excludes keys 0 and 1


def test_window_requires_causal():
    q, k, v = qkv(1, 2, 2, 4, 4, 8)
    with pytest.raises(opport.ArgumentError) as info:
        opport.attention(q, k, v, sliding_window=2, backend="cpu")
    assert info.value.constraint == "attention.sliding_window"


def test_cost_counts_window_pairs():
    metas = [NumpyAdapter.meta(np.ones(s, np.float16)) for s in ((1, 4, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16))]
    windowed = spec.get_cost(*metas, causal=True, sliding_window=3)
    assert windowed.flops == 4 * 1 * 4 * (1 + 2 + 3 * 6) * 16  # rows see 1, 2, then 3 keys each


@pytest.mark.parametrize("op", ["attention", "varlen_attention", "paged_attention"])
def test_scale_is_a_scalar_not_an_array_or_tensor(op):
    torch = pytest.importorskip("torch")
    from opport.ops import get_op

    spec_ = get_op(op)
    case = next(iter(spec_.get_cases("float32")))
    fn = getattr(opport, op)
    want = fn(*case.args, **{**case.kwargs, "scale": 0.5})
    for same in (np.float32(0.5), np.array(0.5)):  # NumPy scalars, and 0-d arrays as everywhere in opport
        np.testing.assert_array_equal(fn(*case.args, **{**case.kwargs, "scale": same}), want)
    for bad in (np.array([0.5]), np.array([[0.5]]), torch.tensor(0.5), torch.tensor([0.5]), [0.5]):
        with pytest.raises(opport.ArgumentError) as info:
            fn(*case.args, **{**case.kwargs, "scale": bad})
        assert info.value.constraint == f"{op}.scale" and info.value.arg == "scale"


@pytest.mark.parametrize("causal,window,softcap,hkv", [(True, None, None, 2), (False, None, None, 4), (True, 5, None, 1),
                                                       (True, None, 7.0, 2)])
def test_decode_rows_take_the_fused_loop_and_agree_with_the_blocks(monkeypatch, causal, window, softcap, hkv):
    """One query row per head (decode), float32: the kernel runs `_fused.attention_decode` (checked by a spy), within
    float32's tolerance of the block path (OPPORT_NUMBA=0) and of the float64 reference; GQA, a window, a soft cap."""
    from opport.backends.cpu import _fused

    q, k, v = qkv(2, 4, hkv, 1, 37, 16, seed=3, dtype=np.float32)
    args = (q, k, v, causal, None, softcap, window)
    calls = []
    real = _fused.attention_decode
    monkeypatch.setattr(_fused, "attention_decode", lambda *a: calls.append(1) or real(*a))
    fused = kernel(*args)
    assert calls, "decode loop not taken"
    monkeypatch.setenv("OPPORT_NUMBA", "0")
    blocks = kernel(*args)
    np.testing.assert_allclose(fused, blocks, rtol=2e-6, atol=2e-6)
    ref = spec.run_reference(*(a.astype(np.float64) if isinstance(a, np.ndarray) else a for a in args))
    np.testing.assert_allclose(fused, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d", [8, 16, 40])
def test_decode_loop_bits_do_not_depend_on_layout_batch_or_key_offset(d):
    """Each q.k of the decode loop is its 16 lanes over the head dim, added as a tree, then the tail: a row's bits
    depend on its own q, keys and values only. A [B, S, H, D] cache's strided view against a contiguous copy, one
    batch entry alone against the batch, the visible keys [2, 37) of a longer buffer against those keys alone (a
    window's offset): all the same bits (a head dim of 8 has no lanes, 40 a tail after them)."""
    from opport.backends.cpu import _fused

    q, k, v = qkv(2, 4, 2, 1, 37, d, seed=5, dtype=np.float32)
    ks = np.ascontiguousarray(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    whole = _fused.attention_decode(q, ks, v, 0.3, None, 2, 37)
    assert whole is not None
    for got in (_fused.attention_decode(q, k, v, 0.3, None, 2, 37),
                _fused.attention_decode(q, k[:, :, 2:].copy(), v[:, :, 2:].copy(), 0.3, None, 0, 35)):
        for a, b in zip(whole, got):
            np.testing.assert_array_equal(a, b)
    alone = _fused.attention_decode(q[1:], k[1:], v[1:], 0.3, None, 2, 37)
    for a, b in zip(whole, alone):
        np.testing.assert_array_equal(a[1:], b)


def test_decode_loop_sums_each_score_in_its_documented_order():
    """The scores' order, checked through lse (max + log(sum of exp)): with one visible key lse is that key's scaled
    score itself, which must be the 16 lanes in order over the head dim, the tree of lanes, then the tail, in
    float32: a NumPy emulation of that order gives the same bits (and a plain sum would differ for these values)."""
    from opport.backends.cpu import _fused

    rng = np.random.default_rng(11)
    d = 72
    q = (rng.standard_normal((1, 1, 1, d)) * 10).astype(np.float32)
    k = (rng.standard_normal((1, 1, 1, d)) * 10).astype(np.float32)
    v = rng.standard_normal((1, 1, 1, 4)).astype(np.float32)
    _, lse = _fused.attention_decode(q, k, v, 1.0, None, 0, 1)
    p = q[0, 0, 0] * k[0, 0, 0]  # float32 products
    lanes = p[:16].copy()
    for d0 in range(16, 64, 16):
        lanes = lanes + p[d0:d0 + 16]
    for w in (8, 4, 2):
        lanes = lanes[:w] + lanes[w:2 * w]
    s = lanes[0] + lanes[1]
    for x in range(64, d):
        s = s + p[x]
    assert lse[0, 0, 0] == s  # m + log(1): the score itself
    plain = np.float32(0)
    for x in p:
        plain = plain + x
    assert plain != s  # the values tell the orders apart


def test_decode_loop_leaves_non_finite_rows_to_the_blocks():
    """A non-finite score (an inf or NaN in q or a visible k) makes the loop decline: the call is the block path's,
    bit for bit (its rules for inf, NaN and masked values)."""
    q, k, v = qkv(1, 2, 1, 1, 9, 8, seed=4, dtype=np.float32)
    k[0, 0, 3, 2] = np.inf
    from opport.backends.cpu import _fused

    assert _fused.attention_decode(q, k, v, 0.3, None, 0, 9) is None
    got = kernel(q, k, v, True, None)
    np.testing.assert_array_equal(got, cpu_attention._attention(q, k, v, True, None, None))


@pytest.mark.parametrize("causal,window,softcap", [(False, None, None), (True, None, None), (True, 3, None),
                                                   (True, 5, 2.0), (False, None, 2.0)])
@pytest.mark.parametrize("sq,sk", [(9, 9), (5, 12), (12, 5), (1, 7)])
def test_reference_row_blocks_match_brute_force(monkeypatch, sq, sk, causal, window, softcap):
    """The reference computes rows of different visible ranges together when the inputs are finite (row_blocks):
    with blocks of one to a few rows (BLOCK shrunk) it agrees with the brute-force mask."""
    import opport.ops.attention as mod

    q, k, v = qkv(2, 4, 2, sq, sk, 8, 5, seed=sq + 3 * sk)
    want = brute_force_capped(q, k, v, causal, softcap, window)
    for block in (1 << 20, 2 * 8 * sk, 1):
        monkeypatch.setattr(mod, "BLOCK", block)
        got = spec.run_reference(q, k, v, causal, None, softcap, window)
        assert np.allclose(got, want, rtol=1e-12, atol=1e-12), block


def test_reference_and_its_vjp_never_see_masked_non_finite_values():
    """An inf or NaN under the mask changes nothing for the rows that do not see it (forward and dq), while finite
    inputs take the blocks of mixed ranges: both paths give the same gradients."""
    import opport.ops.attention as mod

    q, k, v = qkv(1, 2, 1, 6, 6, 8)
    grad = np.random.default_rng(1).standard_normal((1, 2, 6, 8))
    out, (lse,) = spec.run_reference(q, k, v, True, None), mod._saved(q, k, v, True, None)
    clean = mod._vjp(grad, q, k, v, out, lse, True, None, None, None, True)
    k2, v2 = k.copy(), v.copy()
    k2[:, :, 3:], v2[:, :, 3:] = np.nan, np.inf  # masked for rows 0..2
    dirty = spec.run_reference(q, k2, v2, True, None)
    assert np.allclose(dirty[:, :, :3], out[:, :, :3], rtol=1e-14, atol=1e-14) and np.isnan(dirty[:, :, 3:]).all()
    dq = mod._vjp(grad, q, k2, v2, out, lse, True, None, None, None, True)[0]
    assert np.allclose(dq[:, :, :3], clean[0][:, :, :3], rtol=1e-12, atol=1e-12)
    blocks = mod.row_blocks
    by_range = lambda lo, hi, heads, *arrays: blocks(lo, hi, heads, *arrays, np.array(np.nan))  # the per-range path
    mod.row_blocks = by_range
    try:
        again = mod._vjp(grad, q, k, v, out, lse, True, None, None, None, True)
    finally:
        mod.row_blocks = blocks
    for a, b in zip(clean, again):
        assert np.allclose(a, b, rtol=1e-12, atol=1e-12)
