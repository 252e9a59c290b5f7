"""varlen_attention: attention over packed sequences of different lengths (FlashAttention's flash_attn_varlen_func)."""

from __future__ import annotations

import math

import numpy as np

from opport import casegen as cg
from opport.arraymath import as_heads, cu, sequences
from opport.errors import ArgumentError, DTypeError, ShapeError
from opport.ops import attention as dense
from opport.spec import (
    INT32,
    Case,
    Cost,
    ErrorCase,
    check,
    check_bool,
    check_domain,
    check_float,
    check_grad,
    check_ndim,
    check_same_dtype,
    grad_constraints,
    op,
)

NAME = "varlen_attention"


@op(
    arrays=("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"),
    domains={"cu_seqlens_q": INT32, "cu_seqlens_k": INT32},
    constraints={
        "varlen_attention.dtype": "q is float32, float16, bfloat16 or float64",
        "varlen_attention.dtype_mismatch": "k and v have q's dtype",
        "varlen_attention.rank": "q, k, v are 3-d: [Tq, Hq, D], [Tk, Hkv, D], [Tk, Hkv, Dv]",
        "varlen_attention.gqa_ratio": "k and v have the same Hkv >= 1 and Hq % Hkv == 0",
        "varlen_attention.head_dim": "k.shape[-1] == q.shape[-1] = D >= 1",
        "varlen_attention.kv_tokens": "k and v have the same token count Tk",
        "varlen_attention.cu_dtype": "cu_seqlens_q and cu_seqlens_k are int32",
        "varlen_attention.cu_shape": "cu_seqlens_q and cu_seqlens_k are 1-d of the same length B + 1 >= 1",
        "varlen_attention.cu_values": "each cu_seqlens starts at 0, never decreases and ends at its T (Tq, Tk)",
        "varlen_attention.causal": "causal is True or False",
        "varlen_attention.scale": dense.SCALE_RULE,
        "varlen_attention.softcap": "softcap is None or a finite number > 0",
        "varlen_attention.sliding_window": "sliding_window is None or an int, 1 <= W <= 2**31 - 1, given with causal=True",
    },
)
def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool = False, scale: float | None = None,
                     softcap: float | None = None, sliding_window: int | None = None):
    """Attention over B packed sequences, out [Tq, Hq, Dv].

    Sequence b holds query tokens cu_seqlens_q[b]:cu_seqlens_q[b+1] and key tokens
    cu_seqlens_k[b]:cu_seqlens_k[b+1] (int32 prefix sums); its queries attend to its keys only, as
    `attention` on that sequence alone: the same GQA, scale, bottom-right causal mask (per sequence),
    soft cap and sliding window, and rows that see no key (a sequence without keys) output 0. Sequences
    may be empty in q, in k or both. The cu_seqlens values are checked on every call before any kernel
    runs (they decide which memory a kernel reads).
    """
    check_float(NAME, "q", q)
    check_same_dtype(NAME, "q", q, k=k, v=v)
    for arg, m in (("q", q), ("k", k), ("v", v)):
        check_ndim(NAME, arg, m, 3, constraint=f"{NAME}.rank")
    hq, hkv = q.shape[1], k.shape[1]
    check(hkv >= 1 and hq % hkv == 0, ShapeError, NAME, "k", f"{NAME}.gqa_ratio", f"Hkv >= 1 dividing Hq = {hq}", k.shape)
    check(v.shape[1] == hkv, ShapeError, NAME, "v", f"{NAME}.gqa_ratio", f"Hkv = {hkv} heads (as k)", v.shape)
    check(q.shape[2] >= 1 and k.shape[2] == q.shape[2], ShapeError, NAME, "k", f"{NAME}.head_dim",
          f"head dim D = {q.shape[2]} (as q), >= 1", k.shape)
    check(v.shape[0] == k.shape[0], ShapeError, NAME, "v", f"{NAME}.kv_tokens", f"Tk = {k.shape[0]} (as k)", v.shape)
    for arg, m in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_domain(NAME, arg, m, INT32, f"{NAME}.cu_dtype")
        check(m.ndim == 1 and m.shape[0] >= 1, ShapeError, NAME, arg, f"{NAME}.cu_shape", "1-d, length B + 1 >= 1", m.shape)
    check(cu_seqlens_k.shape == cu_seqlens_q.shape, ShapeError, NAME, "cu_seqlens_k", f"{NAME}.cu_shape",
          f"{cu_seqlens_q.shape} (as cu_seqlens_q)", cu_seqlens_k.shape)
    check_bool(NAME, "causal", causal)
    dense.check_scale(NAME, scale)
    dense.check_softcap_window(NAME, softcap, sliding_window, causal)


@varlen_attention.check_values(("cu_seqlens_q", "cu_seqlens_k"))
def _check_cu_seqlens(q, k, v, cu_seqlens_q, cu_seqlens_k, *scalars):
    check_cu_values(NAME, q, k, cu_seqlens_q, cu_seqlens_k)


def check_cu_values(name: str, q, k, cu_seqlens_q, cu_seqlens_k) -> None:
    """`<name>.cu_values` (the forward's and the backward's): each cu_seqlens starts at 0, never decreases and ends
    at its token count."""
    for arg, cuv, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]), ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
        check(int(cuv[0]) == 0, ArgumentError, name, arg, f"{name}.cu_values", "cu[0] == 0", int(cuv[0]))
        steps = np.diff(cuv.astype(np.int64))
        bad = int(np.argmax(steps < 0)) if (steps < 0).any() else None
        check(bad is None, ArgumentError, name, arg, f"{name}.cu_values", "non-decreasing values",
              None if bad is None else f"cu[{bad}] = {cuv[bad]} > cu[{bad + 1}] = {cuv[bad + 1]}")
        check(int(cuv[-1]) == total, ArgumentError, name, arg, f"{name}.cu_values", f"cu[-1] == {total} (the token count)",
              int(cuv[-1]))


@varlen_attention.reference
def _reference(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, softcap, sliding_window):
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]))
    for qs, ks in sequences(cu_seqlens_q, cu_seqlens_k):
        o = dense.attention._reference(as_heads(q[qs]), as_heads(k[ks]), as_heads(v[ks]), causal,
                                       scale, softcap, sliding_window)
        out[qs] = o[0].transpose(1, 0, 2)
    return out


varlen_attention.tolerance(**dense.attention.tolerances)  # attention's: the same K-accumulation, per sequence


def _case(name, dtype, lq, lk, hq, hkv, d, dv=None, tags=(), qk_scale=1.0, **kw):
    rng = cg.rng_for(NAME, name, dtype)
    tq, tk = int(sum(lq)), int(sum(lk))
    q = cg.array((tq, hq, d), dtype, rng, "normal", qk_scale)
    k = cg.array((tk, hkv, d), dtype, rng, "normal", qk_scale)
    v = cg.array((tk, hkv, dv or d), dtype, rng, "normal", 1.0)
    kwargs = {"causal": False, "scale": None, **kw}
    return Case(name, (q, k, v, cu(lq), cu(lk)), kwargs, tags)


@varlen_attention.cases
def _cases(dtype):
    lens = [37, 1, 128, 64, 0, 90]
    yield _case("prefill-causal-gqa", dtype, lens, lens, 8, 2, 64, causal=True, tags=("llm",))
    yield _case("prefill-noncausal", dtype, [17, 60, 3], [17, 60, 3], 2, 2, 32)
    # small ones (framework integrations' samples, finite differences): GQA, an empty sequence, a soft cap and window
    yield _case("small-causal-gqa", dtype, [5, 11, 0], [5, 7, 3], 4, 1, 16, causal=True)  # Sq > Sk, then no queries
    yield _case("small-softcap-window", dtype, [9], [12], 2, 1, 16, causal=True, softcap=4.0, sliding_window=5)
    # chunked prefill: each sequence's new tokens against its cache plus them (Sq <= Sk, bottom-right)
    yield _case("chunked-prefill", dtype, [16, 5, 40], [80, 5, 200], 8, 2, 128, causal=True, tags=("llm",))
    yield _case("decode-batch", dtype, [1] * 6, [1, 30, 300, 7, 129, 64], 8, 1, 64, causal=True, tags=("llm",))
    yield _case("empty-q-and-k-seqs", dtype, [0, 12, 0, 9, 5], [3, 12, 0, 0, 8], 2, 1, 32, causal=True, tags=("edge",))
    yield _case("single-seq", dtype, [48], [48], 4, 2, 64, dv=32, causal=True)
    yield _case("no-seqs", dtype, [], [], 2, 1, 16, tags=("edge",))
    yield _case("gemma2-softcap-window", dtype, [96, 33, 150], [96, 33, 150], 4, 2, 256, causal=True, softcap=50.0,
                sliding_window=32, tags=("llm",))
    yield _case("window-1-softcap", dtype, [12, 30], [12, 40], 2, 2, 32, causal=True, softcap=5.0, sliding_window=1,
                qk_scale=3.0)
    yield _case("scale-explicit", dtype, [13, 8], [13, 24], 2, 2, 64, scale=0.5)
    yield _nonfinite_elsewhere(dtype)


def _nonfinite_elsewhere(dtype: str) -> Case:
    """NaN/inf in one sequence's k and v: the other sequences, which must never read them, stay finite."""
    case = _case("nonfinite-other-seq", dtype, [20, 20, 20], [20, 24, 20], 2, 1, 32, causal=True, tags=("edge",))
    q, k, v, cq, ck = case.args
    k, v = k.copy(), v.copy()
    k[20:44, :, ::3] = cg.cast(np.nan, dtype)
    v[20:44, :, ::5] = cg.cast(np.inf, dtype)
    return Case(case.name, (q, k, v, cq, ck), case.kwargs, case.tags)


@varlen_attention.strategy
def _strategy(dtype):
    from hypothesis import strategies as st

    @st.composite
    def case(draw):
        n = draw(st.sampled_from([0, 1, 1, 2, 2, 3]))
        lq = draw(st.lists(st.integers(0, 32), min_size=n, max_size=n))
        extra = draw(st.lists(st.integers(0, 32), min_size=n, max_size=n))
        causal = draw(st.booleans())
        lk = [a + b for a, b in zip(lq, extra)] if draw(st.booleans()) else extra
        g = draw(st.sampled_from([1, 2, 4]))
        hkv = draw(st.sampled_from([1, 1, 2])) if g == 1 else 1  # at most 4 query heads: few programs when emulated
        d = draw(st.sampled_from([8, 16, 32, 64]))
        window = draw(st.sampled_from([None, 1, 7, 50])) if causal else None
        softcap = draw(st.sampled_from([None, 2.0, 30.0]))
        seed = draw(cg.seeds())
        rng = np.random.default_rng(seed)
        q = cg.array((sum(lq), hkv * g, d), dtype, rng)
        k = cg.array((sum(lk), hkv, d), dtype, rng)
        v = cg.array((sum(lk), hkv, d), dtype, rng)
        kw = {"causal": causal, "scale": None, "softcap": softcap, "sliding_window": window}
        return Case(f"hyp-{seed}", (q, k, v, cu(lq), cu(lk)), kw, ("hypothesis",))

    return case()


@varlen_attention.error_cases
def _error_cases():
    def t(*shape, dt=np.float32):
        return np.ones(shape, dt)

    q, k, v, c = t(10, 4, 16), t(12, 2, 16), t(12, 2, 16), np.array([0, 4, 10], np.int32)
    ck = np.array([0, 5, 12], np.int32)
    yield ErrorCase(f"{NAME}.dtype", DTypeError, (t(10, 4, 16, dt=np.int32), k, v, c, ck))
    yield ErrorCase(f"{NAME}.dtype_mismatch", DTypeError, (q, t(12, 2, 16, dt=np.float16), v, c, ck))
    yield ErrorCase(f"{NAME}.rank", ShapeError, (t(1, 10, 4, 16), k, v, c, ck))
    yield ErrorCase(f"{NAME}.gqa_ratio", ShapeError, (q, t(12, 3, 16), t(12, 3, 16), c, ck))
    yield ErrorCase(f"{NAME}.gqa_ratio", ShapeError, (q, k, t(12, 4, 16), c, ck))
    yield ErrorCase(f"{NAME}.head_dim", ShapeError, (q, t(12, 2, 8), v, c, ck))
    yield ErrorCase(f"{NAME}.kv_tokens", ShapeError, (q, k, t(11, 2, 16), c, ck))
    yield ErrorCase(f"{NAME}.cu_dtype", DTypeError, (q, k, v, c.astype(np.int64), ck))
    yield ErrorCase(f"{NAME}.cu_dtype", DTypeError, (q, k, v, c, ck.astype(np.float32)))
    yield ErrorCase(f"{NAME}.cu_shape", ShapeError, (q, k, v, c[None], ck))
    yield ErrorCase(f"{NAME}.cu_shape", ShapeError, (q, k, v, c, np.array([0, 12], np.int32)))
    yield ErrorCase(f"{NAME}.cu_values", ArgumentError, (q, k, v, np.array([1, 4, 10], np.int32), ck))  # start
    yield ErrorCase(f"{NAME}.cu_values", ArgumentError, (q, k, v, c, np.array([0, 13, 12], np.int32)))  # decreasing
    yield ErrorCase(f"{NAME}.cu_values", ArgumentError, (q, k, v, np.array([0, 4, 9], np.int32), ck))  # end
    yield ErrorCase(f"{NAME}.cu_values", ArgumentError, (q, k, v, c, np.array([0, 5, 13], np.int32)))  # beyond Tk
    yield ErrorCase(f"{NAME}.causal", ArgumentError, (q, k, v, c, ck), {"causal": 1})
    yield ErrorCase(f"{NAME}.scale", ArgumentError, (q, k, v, c, ck), {"scale": float("nan")})
    for bad in (np.array([0.5]), [0.5]):  # a 1-element array is not a scalar
        yield ErrorCase(f"{NAME}.scale", ArgumentError, (q, k, v, c, ck), {"scale": bad})
    yield ErrorCase(f"{NAME}.softcap", ArgumentError, (q, k, v, c, ck), {"softcap": 0.0})
    yield ErrorCase(f"{NAME}.sliding_window", ArgumentError, (q, k, v, c, ck), {"causal": True, "sliding_window": 0})
    yield ErrorCase(f"{NAME}.sliding_window", ArgumentError, (q, k, v, c, ck), {"sliding_window": 8})


@varlen_attention.shape
def _shape(q, k, v, cu_seqlens_q, cu_seqlens_k, *scalars):
    return (q.shape[0], q.shape[1], v.shape[2])


@varlen_attention.cost
def _cost(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, softcap, sliding_window):
    """Bytes of q, k, v, out; FLOPs over the visible pairs when the cu_seqlens values are at hand (as arrays),
    else (Metas) as one dense sequence of Tq queries and Tk keys, an upper bound."""
    hq, d, dv = q.shape[1], q.shape[2], v.shape[2]
    item = np.dtype(cg.np_dtype(getattr(q.dtype, "name", q.dtype))).itemsize
    if isinstance(cu_seqlens_q, np.ndarray) and isinstance(cu_seqlens_k, np.ndarray):
        pairs = sum(int(dense.visible_keys(qs.stop - qs.start, ks.stop - ks.start, causal, sliding_window).sum())
                    for qs, ks in sequences(cu_seqlens_q, cu_seqlens_k))
    else:
        pairs = int(dense.visible_keys(q.shape[0], k.shape[0], causal, sliding_window).sum())
    out = q.shape[0] * hq * dv
    size = math.prod(q.shape) + math.prod(k.shape) + math.prod(v.shape)
    return Cost(bytes=(size + out) * item + 4 * (cu_seqlens_q.shape[0] + cu_seqlens_k.shape[0]),
                flops=2 * hq * pairs * (d + dv))


# --------------------------------------------------------------------------- backward

BWD = f"{NAME}_backward"
_CU = "integer sequence boundaries: they pick which tokens meet, not a differentiable quantity"


@varlen_attention.saves(("lse",), shapes=lambda q, k, v, *rest: [(q.shape[1], q.shape[0])])
def _saved(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, softcap, sliding_window):
    """Per query head and token, the log-sum-exp of its visible scaled scores [Hq, Tq] (float32; FlashAttention's
    varlen softmax_lse layout): -inf for a token that sees no key or only -inf scores (its output is 0), NaN where
    a visible score is NaN or +inf."""
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    g = q.shape[1] // k.shape[1]
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for qs, ks in sequences(cu_seqlens_q, cu_seqlens_k):
            lo, hi = dense.visible_range(qs.stop - qs.start, ks.stop - ks.start, causal, sliding_window)
            for i in np.flatnonzero(hi > lo):
                keys = slice(ks.start + lo[i], ks.start + hi[i])
                s = _scores(q[qs.start + i], k[keys], g, scale, softcap)[1]  # [Hq, keys]
                m = s.max(axis=-1)
                lse[:, qs.start + i] = m + np.log(np.exp(s - np.where(m == -np.inf, 0.0, m)[:, None]).sum(axis=-1))
    return (lse,)


def _scores(q_row, keys, g: int, scale: float, softcap) -> tuple:
    """One token's (raw scaled, capped) scores [Hq, n] against n keys [n, Hkv, D] (query head h reads KV head h // g)."""
    raw = np.einsum("hd,khd->hk", q_row, np.repeat(keys, g, axis=1)) * scale
    return raw, dense.capped(raw, softcap)


@varlen_attention.backward(
    wrt=("q", "k", "v"),
    reduces=("k", "v"),
    constants={"cu_seqlens_q": _CU, "cu_seqlens_k": _CU},
    constraints={**grad_constraints(NAME), f"{BWD}.saved": "out has the forward output's shape and q's dtype; lse is "
                 "[Hq, Tq] in the accumulation dtype, float32 (float64 for float64 inputs): the training forward's",
                 f"{BWD}.cu_values": "each cu_seqlens starts at 0, never decreases and ends at its T (Tq, Tk)"},
)
def varlen_attention_backward(grad, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal: bool = False,
                              scale: float | None = None, softcap: float | None = None, sliding_window: int | None = None):
    """Gradients of varlen_attention for q, k and v (FlashAttention-2's varlen backward).

    Per sequence, exactly attention's backward on that sequence alone: saves q, k, v, the output and the
    log-sum-exp lse [Hq, Tq] (float32; float64 for float64 inputs), recomputes P = exp(s·scale − lse) block by
    block; with D = rowsum(dO·O) and dS = P (dP − D): dV = P^T dO, dQ = scale·dS K, dK = scale·dS^T Q, GQA
    summed over each KV head's query heads, a soft cap's slope 1 - tanh²(s / c) on dS. Only visible (query,
    key) pairs of one sequence enter: NaN or inf under a causal mask or window, or in another sequence, never
    leaks. A token that sees no key (a sequence without keys, or before the bottom-right diagonal) has output
    0, zero gradient, and its q and dO reach no dK or dV; keys of a sequence without queries get dK = dV = 0.
    cu_seqlens are not differentiable; their values are checked again before any kernel runs.
    """
    varlen_attention.validate(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, softcap, sliding_window)
    shape = (q.shape[0], q.shape[1], v.shape[2])
    check_grad(BWD, grad, shape, q.dtype)
    acc = "float64" if q.dtype == "float64" else "float32"
    for arg, m, want, dtype in (("out", out, shape, q.dtype), ("lse", lse, (q.shape[1], q.shape[0]), acc)):
        check(m is not None, ArgumentError, BWD, arg, f"{BWD}.saved", "the training forward's " + arg, None)
        check(m.dtype == dtype, DTypeError, BWD, arg, f"{BWD}.saved", dtype, m.dtype)
        check(tuple(m.shape) == want, ShapeError, BWD, arg, f"{BWD}.saved", f"{want} (the training forward's)",
              tuple(m.shape))


@varlen_attention_backward.check_values(("cu_seqlens_q", "cu_seqlens_k"))
def _check_backward_cu(grad, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *scalars):
    check_cu_values(BWD, q, k, cu_seqlens_q, cu_seqlens_k)


@varlen_attention_backward.reference
def _backward_reference(grad, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, scale, softcap=None,
                        sliding_window=None):
    return _vjp(grad, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, scale, softcap, sliding_window, True)


def _vjp(grad, q, k, v, out, lse, cu_q, cu_k, causal, scale, softcap, window, slope: bool):
    """The float64 gradients, sequence by sequence as dense attention's (its reference VJP over each sequence's
    tokens as [1, H, T, D]); slope=False drops the soft cap's chain rule (a mutant)."""
    dq, dk, dvv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for qs, ks in sequences(cu_q, cu_k):
        if qs.stop == qs.start or ks.stop == ks.start:
            continue  # no query, or nothing to see: no gradient
        g, q1, k1, v1, o1 = (as_heads(a[t]) for a, t in ((grad, qs), (q, qs), (k, ks), (v, ks), (out, qs)))
        grads = dense._vjp(g, q1, k1, v1, o1, lse[None, :, qs], causal, scale, softcap, window, slope)
        for full, part, t in zip((dq, dk, dvv), grads, (qs, ks, ks)):
            full[t] = part[0].transpose(1, 0, 2)
    return dq, dk, dvv


@varlen_attention_backward.error_cases
def _backward_error_cases():
    q, k, v = np.ones((10, 4, 16), np.float32), np.ones((12, 2, 16), np.float32), np.ones((12, 2, 16), np.float32)
    o, lse = np.ones((10, 4, 16), np.float32), np.zeros((4, 10), np.float32)
    cq, ck = np.array([0, 4, 10], np.int32), np.array([0, 5, 12], np.int32)
    yield ErrorCase(f"{BWD}.grad_shape", ShapeError, (np.ones((10, 4, 8), np.float32), q, k, v, o, lse, cq, ck))
    yield ErrorCase(f"{BWD}.grad_dtype", DTypeError, (o.astype(np.float16), q, k, v, o, lse, cq, ck))
    yield ErrorCase(f"{BWD}.saved", ShapeError, (o, q, k, v, np.ones((10, 4, 8), np.float32), lse, cq, ck))
    yield ErrorCase(f"{BWD}.saved", DTypeError, (o, q, k, v, o.astype(np.float16), lse, cq, ck))
    yield ErrorCase(f"{BWD}.saved", ShapeError, (o, q, k, v, o, np.zeros((10, 4), np.float32), cq, ck))  # [Tq, Hq]
    yield ErrorCase(f"{BWD}.saved", DTypeError, (o, q, k, v, o, lse.astype(np.float64), cq, ck))
    yield ErrorCase(f"{BWD}.cu_values", ArgumentError, (o, q, k, v, o, lse, np.array([0, 6, 4], np.int32), ck))
    yield ErrorCase(f"{BWD}.cu_values", ArgumentError, (o, q, k, v, o, lse, cq, np.array([0, 5, 11], np.int32)))


@varlen_attention_backward.cost
def _backward_cost(grad, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, scale, softcap=None,
                   sliding_window=None):
    fwd = _cost(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, softcap, sliding_window)
    item = np.dtype(cg.np_dtype(getattr(q.dtype, "name", q.dtype))).itemsize
    size = math.prod(q.shape) + math.prod(k.shape) + math.prod(v.shape)
    # read q, k, v, out, dO, lse and cu_seqlens; write dq, dk, dv. FLOPs: five matmuls over the visible pairs (s, dP,
    # dV, dQ, dK) against the forward's two: 2.5x, as FlashAttention-2 counts
    return Cost(bytes=(2 * size + 2 * math.prod(out.shape)) * item + 4 * math.prod(lse.shape)
                + 4 * (cu_seqlens_q.shape[0] + cu_seqlens_k.shape[0]), flops=int(2.5 * fwd.flops))


def _grad_case(name: str, dtype: str, forward: Case, grad=None, tags=("edge",)) -> Case:
    """The backward case of `forward` (its output and lse from the float64 reference) with `grad` (float64 values)."""
    (shape, _), = varlen_attention.out_metas(varlen_attention.bind(*forward.args, **forward.kwargs))
    g = cg.array(shape, "float64", cg.rng_for(BWD, name, dtype)) if grad is None else grad
    case = varlen_attention_backward.from_forward(forward, dtype, grad=cg.cast(g, dtype))
    return Case(name, case.args, case.kwargs, tags)


def _with(case: Case, **arrays) -> Case:
    """`case` with some of q, k, v replaced."""
    q, k, v = (arrays.get(n, a) for n, a in zip("qkv", case.args[:3]))
    return Case(case.name, (q, k, v, *case.args[3:]), case.kwargs, case.tags)


@varlen_attention_backward.cases
def _backward_cases(dtype):
    """Edge cases for the gradients beside those derived from the forward's (random upstream gradients)."""
    nan, inf = cg.cast(np.nan, dtype), cg.cast(np.inf, dtype)
    # tokens that see no key: sequence 0 (Sq > Sk, causal: its first 6 rows) and sequence 1 (no keys). NaN in their q
    # and dO must not reach dk or dv, which stay finite; the keys of sequence 2 (no queries) get dk = dv = 0
    dead = _case("dead-rows", dtype, [14, 5, 0], [8, 0, 7], 4, 2, 16, causal=True)
    q = dead.args[0].copy()
    q[:6], q[14:19] = nan, nan
    g = cg.array((19, 4, 16), "float64", cg.rng_for(BWD, "dead-rows", dtype))
    g[:6:2], g[14:19] = np.nan, np.inf
    yield _grad_case("dead-rows-nonfinite", dtype, _with(dead, q=q), g)
    # causal with a window of 8: NaN in k and inf in v of keys that only the last rows see, NaN in one live row's dO.
    # Earlier rows' dq, the keys outside those rows' windows and the keys masked from that row stay finite; the
    # other sequence is untouched
    live = _case("nan-under-mask", dtype, [24, 9], [24, 12], 2, 1, 16, causal=True, sliding_window=8)
    k, v = live.args[1].copy(), live.args[2].copy()
    k[21, :, ::5], v[22, :, ::7] = nan, inf
    g = cg.array((33, 2, 16), "float64", cg.rng_for(BWD, "nan-under-mask", dtype))
    g[10, 1, 3] = np.nan
    yield _grad_case("nan-under-mask", dtype, _with(live, k=k, v=v), g)
    # one visible key per row (window 1; a 1-key sequence): P = 1, so dq = dk = 0 exactly where dP - D cancels
    # eps·|dO||v| in float32 (attention's one-key-large-v)
    one = _case("one-key", dtype, [9, 5], [9, 1], 2, 1, 16, causal=True, sliding_window=1)
    big_v = cg.cast(one.args[2].astype(np.float64) * (300.0 if dtype == "float16" else 1e4), dtype)
    yield _grad_case("one-key-large-v", dtype, _with(one, v=big_v))
    yield _grad_case("zero-grad", dtype, _case("zero-grad", dtype, [7, 10], [12, 10], 2, 1, 16, causal=True),
                     np.zeros((17, 2, 16)))
    big = 501.0 if dtype == "float16" else 4988429.2
    yield _grad_case("large-grad", dtype, _case("large-grad", dtype, [10], [12], 2, 1, 16, causal=True),
                     cg.rng_for(BWD, "large-grad", dtype).standard_normal((10, 2, 16)) * big)


@varlen_attention_backward.mutant("dq-unscaled")
def _mutant_dq_unscaled(grad, q, k, v, out, lse, cu_q, cu_k, causal, scale, softcap=None, sliding_window=None):
    """dq without the softmax scale (dS K instead of scale dS K)."""
    dq, dk, dv = _backward_reference(grad, q, k, v, out, lse, cu_q, cu_k, causal, scale, softcap, sliding_window)
    return dq / (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale), dk, dv


@varlen_attention_backward.mutant("dkv-of-first-head")
def _mutant_dkv_not_summed(grad, q, k, v, out, lse, cu_q, cu_k, causal, scale, softcap=None, sliding_window=None):
    """GQA: dk and dv from each group's first query head only, not summed over the group."""
    dq, dk, dv = _backward_reference(grad, q, k, v, out, lse, cu_q, cu_k, causal, scale, softcap, sliding_window)
    g = q.shape[1] // k.shape[1]
    if g == 1:
        return dq, dk, dv * 0.5  # no group: a half-summed dv instead
    first = slice(0, None, g)
    _, dk1, dv1 = _backward_reference(grad[:, first], q[:, first], k, v, out[:, first], lse[first], cu_q, cu_k, causal,
                                      scale, softcap, sliding_window)
    return dq, dk1, dv1


@varlen_attention_backward.mutant("dropped-rowsum-term")
def _mutant_dropped_d(grad, q, k, v, out, lse, cu_q, cu_k, causal, scale, softcap=None, sliding_window=None):
    """dS = P dP without the - P D term (D = rowsum(dO * O))."""
    return _backward_reference(grad, q, k, v, np.zeros_like(out), lse, cu_q, cu_k, causal, scale, softcap,
                               sliding_window)


@varlen_attention_backward.mutant("softcap-slope-dropped")
def _mutant_softcap_slope(grad, q, k, v, out, lse, cu_q, cu_k, causal, scale, softcap=None, sliding_window=None):
    """A soft cap's backward without the chain rule through tanh (dS used as if the cap were the identity)."""
    return _vjp(grad, q, k, v, out, lse, cu_q, cu_k, causal, scale, softcap, sliding_window, False)


@varlen_attention_backward.mutant("other-sequence-keys")
def _mutant_cross_sequence(grad, q, k, v, out, lse, cu_q, cu_k, causal, scale, softcap=None, sliding_window=None):
    """A packed-layout bug: each sequence's key range taken from cu_seqlens_q (right only where the lengths agree)."""
    return _backward_reference(grad, q, k, v, out, lse, cu_q, np.minimum(cu_q, k.shape[0]).astype(cu_k.dtype), causal,
                               scale, softcap, sliding_window)
