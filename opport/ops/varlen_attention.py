"""varlen_attention: attention over packed sequences of different lengths (FlashAttention's flash_attn_varlen_func)."""

from __future__ import annotations

import math

import numpy as np

from opport import casegen as cg
from opport.arraymath import cu, sequences
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
    check_ndim,
    check_same_dtype,
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
    for arg, cuv, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]), ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
        check(int(cuv[0]) == 0, ArgumentError, NAME, arg, f"{NAME}.cu_values", "cu[0] == 0", int(cuv[0]))
        steps = np.diff(cuv.astype(np.int64))
        bad = int(np.argmax(steps < 0)) if (steps < 0).any() else None
        check(bad is None, ArgumentError, NAME, arg, f"{NAME}.cu_values", "non-decreasing values",
              None if bad is None else f"cu[{bad}] = {cuv[bad]} > cu[{bad + 1}] = {cuv[bad + 1]}")
        check(int(cuv[-1]) == total, ArgumentError, NAME, arg, f"{NAME}.cu_values", f"cu[-1] == {total} (the token count)",
              int(cuv[-1]))


def _as_dense(x):
    """[T, H, D] tokens of one sequence as attention's [1, H, T, D] (a view)."""
    return x.transpose(1, 0, 2)[None]


@varlen_attention.reference
def _reference(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, softcap, sliding_window):
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]))
    for qs, ks in sequences(cu_seqlens_q, cu_seqlens_k):
        o = dense.attention._reference(_as_dense(q[qs]), _as_dense(k[ks]), _as_dense(v[ks]), causal,
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
    yield _case("prefill-noncausal", dtype, [17, 60, 3], [17, 60, 3], 4, 4, 32)
    # chunked prefill: each sequence's new tokens against its cache plus them (Sq <= Sk, bottom-right)
    yield _case("chunked-prefill", dtype, [16, 5, 40], [80, 5, 200], 8, 2, 128, causal=True, tags=("llm",))
    yield _case("decode-batch", dtype, [1] * 6, [1, 30, 300, 7, 129, 64], 8, 1, 64, causal=True, tags=("llm",))
    yield _case("empty-q-and-k-seqs", dtype, [0, 12, 0, 9, 5], [3, 12, 0, 0, 8], 4, 2, 32, causal=True, tags=("edge",))
    yield _case("sq-gt-sk", dtype, [30, 9], [10, 20], 2, 1, 16, causal=True, tags=("edge",))
    yield _case("single-seq", dtype, [70], [70], 4, 2, 64, dv=32, causal=True)
    yield _case("no-seqs", dtype, [], [], 2, 1, 16, tags=("edge",))
    yield _case("gemma2-softcap-window", dtype, [96, 33, 150], [96, 33, 150], 4, 2, 256, causal=True, softcap=50.0,
                sliding_window=32, tags=("llm",))
    yield _case("window-1-softcap", dtype, [20, 45], [20, 60], 4, 4, 32, causal=True, softcap=5.0, sliding_window=1,
                qk_scale=3.0)
    yield _case("scale-explicit", dtype, [31, 8], [31, 40], 2, 2, 64, scale=0.5)
    yield _nonfinite_elsewhere(dtype)


def _nonfinite_elsewhere(dtype: str) -> Case:
    """NaN/inf in one sequence's k and v: the other sequences, which must never read them, stay finite."""
    case = _case("nonfinite-other-seq", dtype, [20, 20, 20], [20, 24, 20], 4, 2, 32, causal=True, tags=("edge",))
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
        n = draw(st.integers(0, 4))
        lq = draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))
        extra = draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))
        causal = draw(st.booleans())
        lk = [a + b for a, b in zip(lq, extra)] if draw(st.booleans()) else extra
        hkv, g = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 4]))
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

