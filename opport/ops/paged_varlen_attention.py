"""paged_varlen_attention: one attention call for a mixed batch (decodes and prefill chunks) over a paged KV cache."""

from __future__ import annotations

import numpy as np

from opport import casegen as cg
from opport.arraymath import as_heads, cu, gather, paged_spans
from opport.errors import ArgumentError, DTypeError, ShapeError
from opport.ops import attention as dense
from opport.ops.kv_cache_write import HOST_READ
from opport.ops.paged_attention import (
    CACHE_DOMAINS,
    as_fp8,
    check_cache,
    check_scalars,
    check_tables,
    check_tensor_scales,
    constraints,
    kv_bytes,
    kv_scale_errors,
    kv_values,
    visited_blocks,
)
from opport.ops.varlen_attention import check_cu_values
from opport.spec import INT32, Case, Cost, ErrorCase, check, check_domain, check_ndim, op

NAME = "paged_varlen_attention"


@op(
    arrays=("q", "k_cache", "v_cache", "block_tables", "cu_seqlens_q", "context_lens", "k_scale", "v_scale"),
    domains={"block_tables": INT32, "cu_seqlens_q": INT32, "context_lens": INT32, **CACHE_DOMAINS},
    constraints={
        **constraints(NAME, "q [T, Hq, D], caches [num_blocks, block_size, Hkv, D/Dv], block_tables [B, max_blocks], "
                            "cu_seqlens_q [B + 1], context_lens [B]"),
        f"{NAME}.batch": "block_tables and context_lens have B rows, cu_seqlens_q B + 1 entries",
        f"{NAME}.index_dtype": "block_tables, cu_seqlens_q and context_lens are int32",
        f"{NAME}.cu_values": "cu_seqlens_q starts at 0, never decreases and ends at T" + HOST_READ,
        f"{NAME}.query_range": "each sequence's query count cu_seqlens_q[b + 1] - cu_seqlens_q[b] <= context_lens[b]"
                               + HOST_READ,
    },
)
def paged_varlen_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale: float | None = None,
                           softcap: float | None = None, sliding_window: int | None = None, k_scale=None,
                           v_scale=None):
    """Attention of a mixed batch's new tokens over a paged KV cache, out [T, Hq, Dv].

    Sequence b's new tokens are q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]], n_b of them: a decode step (n_b = 1),
    a prefill chunk, a whole prompt, or none. They are the last n_b positions of its context of
    context_lens[b] positions, already written to the cache (kv_cache_write first), so its token i is at
    position p = context_lens[b] - n_b + i and sees the keys at positions <= p (causal within the new tokens,
    everything cached before them: chunked prefill and prefix caching); with sliding_window W only those
    > p - W. Position p of sequence b lives in block block_tables[b, p // block_size] at offset
    p % block_size, and sequences may share blocks (a cached prefix). GQA, scale, soft cap and safe softmax
    as `paged_attention`, which is the case n_b = 1 for every b; per sequence this is `attention(causal=True)`
    of its new tokens over its gathered context. Cache slots no query sees never reach the output, NaN or not.
    fp8 caches with k_scale and v_scale as `paged_attention`'s.
    """
    check_cache(NAME, q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale)
    check_ndim(NAME, "cu_seqlens_q", cu_seqlens_q, 1, constraint=f"{NAME}.rank")
    b = block_tables.shape[0]
    check(context_lens.shape[0] == b, ShapeError, NAME, "context_lens", f"{NAME}.batch",
          f"B = {b} (as block_tables)", context_lens.shape)
    check(cu_seqlens_q.shape[0] == b + 1, ShapeError, NAME, "cu_seqlens_q", f"{NAME}.batch",
          f"B + 1 = {b + 1} entries (block_tables has B rows)", cu_seqlens_q.shape)
    for arg, m in (("block_tables", block_tables), ("cu_seqlens_q", cu_seqlens_q), ("context_lens", context_lens)):
        check_domain(NAME, arg, m, INT32, f"{NAME}.index_dtype")
    check_scalars(NAME, scale, softcap, sliding_window)


@paged_varlen_attention.check_values(("block_tables", "cu_seqlens_q", "context_lens", "k_scale", "v_scale"))
def _check_tables(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, softcap, window, k_scale,
                  v_scale):
    check_tensor_scales(NAME, k_scale, v_scale)
    check_cu_values(NAME, q, q, cu_seqlens_q, cu_seqlens_q)
    check_tables(NAME, k_cache, block_tables, context_lens)
    n = np.diff(np.asarray(cu_seqlens_q, np.int64))
    bad = n > np.asarray(context_lens, np.int64)
    first = int(np.flatnonzero(bad)[0]) if bad.any() else 0
    check(not bad.any(), ArgumentError, NAME, "cu_seqlens_q", f"{NAME}.query_range",
          "at most context_lens[b] new tokens per sequence",
          f"{int(n[first])} tokens for sequence {first} of context {int(context_lens[first])}" if bad.any() else None)


# on device arrays only under OPPORT_CHECK_VALUES=1 (a host read per call would break CUDA-graph capture); the cuda
# kernels guard their memory accesses instead (docs/serving.md, "What each call checks")
_check_tables.on_device = False


@paged_varlen_attention.reference
def _reference(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, softcap, sliding_window, k_scale,
               v_scale):
    k_cache, v_cache = kv_values(k_cache, k_scale), kv_values(v_cache, v_scale)
    out = np.zeros((q.shape[0], q.shape[1], v_cache.shape[3]))
    for b, (ts, lo, ctx) in enumerate(paged_spans(cu_seqlens_q, context_lens, sliding_window)):
        if ts.stop > ts.start:  # bottom-right causal over the keys lo .. ctx - 1: token i sees positions <= its own
            k, v = gather(k_cache, block_tables[b], lo, ctx), gather(v_cache, block_tables[b], lo, ctx)
            o = dense.attention._reference(as_heads(q[ts]), as_heads(k), as_heads(v), True, scale, softcap,
                                           sliding_window)
            out[ts] = o[0].transpose(1, 0, 2)
    return out


paged_varlen_attention.tolerance(**dense.attention.tolerances)  # attention's: the same K-accumulation, per sequence


def make_inputs(rng, dtype, ctx, new, hq, hkv, d, block_size, dv=None, shared=(), extra_blocks=2, qk_scale=1.0):
    """q, caches and tables for sequences with context lengths `ctx` whose last `new` positions are the queries.
    `shared`: (b, a, n_blocks) triples, sequence b's first n_blocks blocks are sequence a's (a cached prefix: the
    same blocks, so the same keys). Every slot no sequence sees holds NaN (k) or inf (v), so a kernel that reads
    past a context, or a block it was not given, shows in the output; table padding is 0, as vLLM pads."""
    dv = dv or d
    need = [-(-n // block_size) for n in ctx]
    owners = {b: (a, m) for b, a, m in shared}
    own = [m - owners.get(b, (0, 0))[1] for b, m in enumerate(need)]
    num_blocks = sum(own) + extra_blocks
    order = iter(rng.permutation(num_blocks))
    tables = np.zeros((len(ctx), max([1, *need])), np.int32)
    for b, m in enumerate(need):
        a, s = owners.get(b, (0, 0))
        tables[b, :s] = tables[a, :s]
        tables[b, s:m] = [next(order) for _ in range(m - s)]
    k_cache = cg.array((num_blocks, block_size, hkv, d), dtype, rng, "normal", qk_scale)
    v_cache = cg.array((num_blocks, block_size, hkv, dv), dtype, rng)
    seen = np.zeros((num_blocks, block_size), bool)
    for b, n in enumerate(ctx):
        pos = np.arange(n)
        seen[tables[b, pos // block_size], pos % block_size] = True
    k_cache[~seen] = cg.cast(np.nan, dtype)
    v_cache[~seen] = cg.cast(np.inf, dtype)
    q = cg.array((sum(new), hq, d), dtype, rng, "normal", qk_scale)
    return q, k_cache, v_cache, tables, cu(new), np.asarray(ctx, np.int32)


def make_case(name, dtype, ctx, new, hq, hkv, d, block_size, dv=None, shared=(), scale=None, softcap=None,
              sliding_window=None, qk_scale=1.0, tags=()):
    rng = cg.rng_for(NAME, name, dtype)
    args = make_inputs(rng, dtype, ctx, new, hq, hkv, d, block_size, dv, shared, qk_scale=qk_scale)
    return Case(name, args, {"scale": scale, "softcap": softcap, "sliding_window": sliding_window}, tags)


def _window_nan(dtype: str) -> Case:
    """NaN in k and -inf in v at positions before every new token's window (the sequence's own blocks) never reach
    the output."""
    c = make_case("window-hides-nan", dtype, [70, 40], [6, 1], 4, 2, 32, 16, sliding_window=20)
    q, kc, vc, bt, cuq, lens = c.args
    kc, vc = kc.copy(), vc.copy()
    for b in range(2):
        pos = np.arange(int(lens[b]) - int(cuq[b + 1] - cuq[b]) + 1 - 20)
        kc[bt[b, pos // 16], pos % 16, :, ::3] = cg.cast(np.nan, dtype)
        vc[bt[b, pos // 16], pos % 16, :, 1::4] = cg.cast(-np.inf, dtype)
    return Case(c.name, (q, kc, vc, bt, cuq, lens), c.kwargs, ("edge",))


def _nonfinite_v_in_chunk(dtype: str) -> Case:
    """NaN/inf in v at new tokens' positions that later tokens of the chunk see and earlier ones do not: rows from
    that position on get NaN/inf in exactly its non-finite columns, earlier rows stay finite (one tile holds both)."""
    c = make_case("nonfinite-v-in-chunk", dtype, [50, 30], [20, 30], 4, 2, 32, 16)
    q, kc, vc, bt, cuq, lens = c.args
    vc = vc.copy()
    for b, pos, cols, val in ((0, 41, slice(0, None, 3), np.inf), (0, 45, slice(1, None, 4), -np.inf),
                              (1, 20, slice(2, 3), np.nan)):
        vc[bt[b, pos // 16], pos % 16, b, cols] = cg.cast(val, dtype)
    return Case(c.name, (q, kc, vc, bt, cuq, lens), c.kwargs, ("edge",))


@paged_varlen_attention.cases
def _cases(dtype):
    # decode, a prefill chunk after cached context, a whole prompt, a chunk crossing blocks: one call
    yield make_case("mixed-gqa", dtype, [17, 40, 5, 33], [1, 16, 5, 3], 8, 2, 32, 16, tags=("llm",))
    yield make_case("shared-prefix", dtype, [40, 37, 20], [8, 1, 20], 4, 2, 32, 16, shared=((1, 0, 2), (2, 0, 1)))
    yield make_case("decode-only", dtype, [9, 30, 1], [1, 1, 1], 4, 1, 64, 16)
    yield make_case("long-chunk", dtype, [300], [140], 2, 1, 64, 32, qk_scale=2.0, tags=("llm",))
    yield make_case("no-new-tokens", dtype, [12, 0, 20], [0, 0, 4], 2, 1, 16, 8, tags=("edge",))
    yield make_case("dv-ne-d", dtype, [20, 9], [4, 9], 2, 1, 64, 16, dv=32)
    yield make_case("softcap", dtype, [60, 31], [12, 1], 4, 2, 32, 16, softcap=5.0, qk_scale=3.0)
    yield make_case("sliding-window", dtype, [70, 10, 33], [30, 1, 33], 4, 2, 32, 16, sliding_window=20)
    yield make_case("window-of-one", dtype, [5, 16], [5, 2], 2, 1, 32, 32, sliding_window=1, tags=("edge",))
    yield make_case("large-scores", dtype, [50, 17], [7, 17], 2, 1, 64, 16, qk_scale=5.0, tags=("edge",))
    yield _window_nan(dtype)
    yield _nonfinite_v_in_chunk(dtype)
    # fp8 caches (kv_cache_write_fp8's): per token and head, and one static scale per tensor
    yield as_fp8(make_case("mixed", dtype, [17, 40, 33], [1, 16, 3], 4, 2, 32, 16, shared=((2, 1, 2),),
                           tags=("llm",)), "float8_e4m3fn", True)
    yield as_fp8(make_case("mixed", dtype, [30, 9], [5, 1], 4, 1, 32, 16, sliding_window=12), "float8_e5m2", False)


@paged_varlen_attention.strategy
def _strategy(dtype):
    from hypothesis import strategies as st

    from opport.ops.attention import _well_conditioned_qk

    @st.composite
    def case(draw):
        bsz, hkv, g = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 4]))
        bs = draw(st.sampled_from([8, 16]))
        ctx = draw(st.lists(st.integers(0, 90), min_size=bsz, max_size=bsz))
        new = [draw(st.integers(0, min(n, 40))) for n in ctx]
        d = draw(st.sampled_from([1, 8, 16, 32]))
        scale = draw(st.sampled_from([None, None, 0.05, 1.0]))
        softcap = draw(st.sampled_from([None, None, 1.0, 30.0]))
        window = draw(st.sampled_from([None, None, 1, 16, 50]))
        qk, seed = draw(st.sampled_from([0.1, 1.0, 3.0])), draw(cg.seeds())
        qk = min(qk, _well_conditioned_qk(d, scale))
        shared = ((1, 0, min(ctx[0], ctx[1]) // bs),) if bsz > 1 else ()
        args = make_inputs(np.random.default_rng(seed), dtype, ctx, new, hkv * g, hkv, d, bs, shared=shared,
                           qk_scale=qk)
        return Case(f"hyp-{seed}", args, {"scale": scale, "softcap": softcap, "sliding_window": window}, ("hypothesis",))

    return case()


@paged_varlen_attention.error_cases
def _error_cases():
    def t(*shape, dt=np.float32):
        return np.zeros(shape, dt)

    q, kc, vc = t(5, 4, 16), t(5, 16, 2, 16), t(5, 16, 2, 16)
    bt, cuq, lens = np.array([[0, 1], [2, 3]], np.int32), np.array([0, 4, 5], np.int32), np.array([20, 3], np.int32)
    ok = (q, kc, vc, bt, cuq, lens)

    def with_(**kw):
        names = ("q", "k_cache", "v_cache", "block_tables", "cu_seqlens_q", "context_lens")
        return tuple(kw.get(n, a) for n, a in zip(names, ok))

    yield ErrorCase(f"{NAME}.dtype", DTypeError, with_(q=t(5, 4, 16, dt=np.int32)))
    yield ErrorCase(f"{NAME}.dtype_mismatch", DTypeError, with_(k_cache=t(5, 16, 2, 16, dt=np.float16)))
    yield ErrorCase(f"{NAME}.rank", ShapeError, with_(q=t(1, 5, 4, 16)))
    yield ErrorCase(f"{NAME}.rank", ShapeError, with_(cu_seqlens_q=cuq[None]))
    yield ErrorCase(f"{NAME}.batch", ShapeError, with_(context_lens=lens[:1]))
    yield ErrorCase(f"{NAME}.batch", ShapeError, with_(cu_seqlens_q=cuq[:2]))
    yield ErrorCase(f"{NAME}.gqa_ratio", ShapeError, with_(k_cache=t(5, 16, 3, 16), v_cache=t(5, 16, 3, 16)))
    yield ErrorCase(f"{NAME}.head_dim", ShapeError, with_(k_cache=t(5, 16, 2, 8)))
    yield ErrorCase(f"{NAME}.cache_shape", ShapeError, with_(v_cache=t(5, 32, 2, 16)))
    yield ErrorCase(f"{NAME}.index_dtype", DTypeError, with_(cu_seqlens_q=cuq.astype(np.int64)))
    yield ErrorCase(f"{NAME}.index_dtype", DTypeError, with_(block_tables=bt.astype(np.int64)))
    yield ErrorCase(f"{NAME}.scale", ArgumentError, ok, {"scale": float("nan")})
    yield ErrorCase(f"{NAME}.softcap", ArgumentError, ok, {"softcap": 0.0})
    yield ErrorCase(f"{NAME}.sliding_window", ArgumentError, ok, {"sliding_window": 0})
    yield ErrorCase(f"{NAME}.cu_values", ArgumentError, with_(cu_seqlens_q=np.array([0, 4, 4], np.int32)))
    yield ErrorCase(f"{NAME}.cu_values", ArgumentError, with_(cu_seqlens_q=np.array([1, 4, 5], np.int32)))
    yield ErrorCase(f"{NAME}.context_range", ArgumentError, with_(context_lens=np.array([33, 3], np.int32)))
    yield ErrorCase(f"{NAME}.block_range", ArgumentError, with_(block_tables=np.array([[0, 5], [2, 3]], np.int32)))
    yield ErrorCase(f"{NAME}.query_range", ArgumentError, with_(context_lens=np.array([3, 3], np.int32)))
    yield from kv_scale_errors(NAME, lambda kc, vc: with_(k_cache=kc, v_cache=vc))


@paged_varlen_attention.shape
def _shape(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, softcap, sliding_window, *kv_scales):
    return (*q.shape[:2], v_cache.shape[3])


@paged_varlen_attention.cost
def _cost(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, softcap, sliding_window, k_scale,
          v_scale):
    """Bytes: the visited blocks' K and V once (from the tables' shape, as paged_attention's), q, out and the
    indices. FLOPs: each new token against at most a table's capacity (a window's) of keys."""
    t, hq, d = q.shape
    _, bs, hkv, dv = v_cache.shape
    item = np.dtype(cg.np_dtype(q.dtype)).itemsize
    kv = kv_bytes(k_cache, v_cache, k_scale, visited_blocks(block_tables, bs, sliding_window))
    keys = block_tables.shape[1] * bs if sliding_window is None else min(block_tables.shape[1] * bs, sliding_window)
    io = (q.size + t * hq * dv) * item + 4 * (block_tables.size + cu_seqlens_q.size + context_lens.size)
    return Cost(bytes=kv + io, flops=2 * hq * t * keys * (d + dv))

