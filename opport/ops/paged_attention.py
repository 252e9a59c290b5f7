"""paged_attention: one decode step per sequence over its paged KV cache (vLLM's paged attention)."""

from __future__ import annotations

import math

import numpy as np

from opport import casegen as cg
from opport.arraymath import FP8_MAX, SCALE_FLOOR, gather, per_token_scales, scale_rows, visible
from opport.dtypes import FLOATS, FP8
from opport.errors import ArgumentError, DTypeError, ShapeError
from opport.ops.attention import SCALE_RULE, check_scale
from opport.ops.kv_cache_write import HOST_READ
from opport.spec import (
    FLOAT32,
    INT32,
    Case,
    Cost,
    Domain,
    ErrorCase,
    Tolerance,
    check,
    check_domain,
    check_float,
    check_ndim,
    check_same_dtype,
    op,
)

NAME = "paged_attention"
INDEX_DTYPE = "int32"  # block tables and context lengths, as vLLM passes them
KV_CACHE = Domain("q's dtype or an fp8 array", FLOATS + FP8)  # an fp8 cache comes with its scales (kv_cache_write_fp8)
CACHE_DOMAINS = {"k_cache": KV_CACHE, "v_cache": KV_CACHE, "k_scale": FLOAT32, "v_scale": FLOAT32}


def _positive(x) -> bool:
    return isinstance(x, (int, float, np.floating)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def constraints(name: str, q_rank: str) -> dict:
    """The constraints paged_attention and paged_varlen_attention share (q's rank and batch rules differ)."""
    return {
        f"{name}.dtype": "q is float32, float16, bfloat16 or float64",
        f"{name}.dtype_mismatch": "k_cache and v_cache have q's dtype, or both one fp8 format (float8_e4m3fn, "
                                  "float8_e5m2) with scales",
        f"{name}.kv_scale": "k_scale and v_scale are both None for caches in q's dtype; for fp8 caches both float32, "
                            "[1] (per tensor) or [num_blocks, block_size, Hkv] (per token and head)",
        f"{name}.scale_values": "per-tensor k_scale and v_scale are finite and > 0" + HOST_READ,
        f"{name}.rank": q_rank,
        f"{name}.gqa_ratio": "k_cache and v_cache have the same Hkv >= 1 and Hq % Hkv == 0",
        f"{name}.head_dim": "k_cache.shape[-1] == q.shape[-1] = D >= 1",
        f"{name}.cache_shape": "k_cache and v_cache share num_blocks and block_size >= 1",
        f"{name}.scale": SCALE_RULE,
        f"{name}.softcap": "softcap is None or a finite number > 0",
        f"{name}.sliding_window": "sliding_window is None or an int >= 1",
        f"{name}.context_range": "0 <= context_lens[b] <= max_blocks * block_size" + HOST_READ,
        f"{name}.block_range": "the blocks a sequence reads (block_tables[b, :cdiv(context_lens[b], block_size)]) are in "
                               "[0, num_blocks)" + HOST_READ,
    }


@op(
    arrays=("q", "k_cache", "v_cache", "block_tables", "context_lens", "k_scale", "v_scale"),
    domains={"block_tables": INT32, "context_lens": INT32, **CACHE_DOMAINS},
    constraints={
        **constraints(NAME, "q [B, Hq, D], caches [num_blocks, block_size, Hkv, D/Dv], block_tables [B, max_blocks], "
                            "context_lens [B]"),
        "paged_attention.batch": "block_tables and context_lens have q's B",
        "paged_attention.index_dtype": "block_tables and context_lens are int32",
    },
)
def paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale: float | None = None,
                    softcap: float | None = None, sliding_window: int | None = None, k_scale=None, v_scale=None):
    """Decode attention over a paged KV cache, out [B, Hq, Dv].

    Sequence b's keys are positions 0 .. context_lens[b] - 1; position p lives in block
    block_tables[b, p // block_size] at offset p % block_size. q[b] is the token at position
    context_lens[b] - 1 (already in the cache), so it sees every key of its sequence. Query head h reads KV
    head h // (Hq / Hkv). scale defaults to 1/sqrt(D); softcap c turns the scaled scores s into
    c * tanh(s / c) (Gemma 2); sliding_window W keeps the last W keys (positions > context_len - 1 - W).
    A sequence of length 0 outputs 0, as does a row whose visible scores are all -inf; cache slots a
    sequence does not see (the tail of its last block, other blocks) never reach its output, NaN or not.
    Table entries past a sequence's last block are not read. Same numerics as `attention`.
    An fp8 KV cache (float8_e4m3fn or float8_e5m2, as `kv_cache_write_fp8` writes it) is read as code x scale
    with its float32 k_scale and v_scale: [1] per tensor or [num_blocks, block_size, Hkv] per token and head.
    """
    check_cache(NAME, q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale)
    b = q.shape[0]
    for arg, m in (("block_tables", block_tables), ("context_lens", context_lens)):
        check(m.shape[0] == b, ShapeError, NAME, arg, f"{NAME}.batch", f"B = {b} (as q)", m.shape)
    for arg, m in (("block_tables", block_tables), ("context_lens", context_lens)):
        check_domain(NAME, arg, m, INT32, f"{NAME}.index_dtype")
    check_scalars(NAME, scale, softcap, sliding_window)


def check_cache(name: str, q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale) -> None:
    """q's dtype, the caches' dtype (and fp8 scales), ranks and shapes against q's heads (q [..., Hq, D] either way)."""
    check_float(name, "q", q)
    if k_cache.dtype in FP8:
        check_same_dtype(name, "k_cache", k_cache, v_cache=v_cache)
    else:
        check_same_dtype(name, "q", q, k_cache=k_cache, v_cache=v_cache)
    for arg, m, nd in (("q", q, 3), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4), ("block_tables", block_tables, 2),
                       ("context_lens", context_lens, 1)):
        check_ndim(name, arg, m, nd, constraint=f"{name}.rank")
    hq, hkv = q.shape[1], k_cache.shape[2]
    check(hkv >= 1 and hq % hkv == 0, ShapeError, name, "k_cache", f"{name}.gqa_ratio", f"Hkv >= 1 dividing Hq = {hq}",
          k_cache.shape)
    check(v_cache.shape[2] == hkv, ShapeError, name, "v_cache", f"{name}.gqa_ratio", f"Hkv = {hkv} (as k_cache)",
          v_cache.shape)
    check(q.shape[2] >= 1 and k_cache.shape[3] == q.shape[2], ShapeError, name, "k_cache", f"{name}.head_dim",
          f"head dim D = {q.shape[2]} (as q), >= 1", k_cache.shape)
    check(k_cache.shape[1] >= 1 and v_cache.shape[:2] == k_cache.shape[:2], ShapeError, name, "v_cache",
          f"{name}.cache_shape", f"[{k_cache.shape[0]}, {k_cache.shape[1]} >= 1, ...] (as k_cache)", v_cache.shape)
    check_kv_scales(name, k_cache, k_scale, v_scale)


def check_kv_scales(name: str, k_cache, k_scale, v_scale) -> None:
    """`<name>.kv_scale`: no scales for a cache in q's dtype; both, float32 and one of the two shapes, for fp8."""
    fp8 = k_cache.dtype in FP8
    per_token = tuple(k_cache.shape[:3])
    for arg, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not fp8:
            check(s is None, ArgumentError, name, arg, f"{name}.kv_scale", "None (the caches are not fp8)",
                  f"a {s.dtype} array" if s is not None else None)
            continue
        check(s is not None, ArgumentError, name, arg, f"{name}.kv_scale", "float32 scales for the fp8 cache", "None")
        check(s.dtype == "float32", DTypeError, name, arg, f"{name}.kv_scale", "float32", s.dtype)
        check(tuple(s.shape) in ((1,), per_token), ShapeError, name, arg, f"{name}.kv_scale",
              f"[1] or {list(per_token)} (k_cache's [num_blocks, block_size, Hkv])", s.shape)
    if fp8:
        check(tuple(k_scale.shape) == tuple(v_scale.shape), ShapeError, name, "v_scale", f"{name}.kv_scale",
              f"{tuple(k_scale.shape)} (as k_scale: one granularity)", v_scale.shape)


def check_tensor_scales(name: str, k_scale, v_scale) -> None:
    """`<name>.scale_values`: a per-tensor scale is finite and > 0 (per-token ones come from kv_cache_write_fp8,
    which floors them at 2^-126; reading them all back would cost a pass over the cache's scales per call)."""
    for arg, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is not None and not per_token_scales(s):
            v = float(np.asarray(s, np.float32).reshape(-1)[0])
            check(math.isfinite(v) and v > 0, ArgumentError, name, arg, f"{name}.scale_values", "finite and > 0",
                  repr(v))


def kv_values(cache, scale):
    """The cache's values as the reference reads them: float64, times its scales for an fp8 cache."""
    c = np.asarray(cache, np.float64)
    if scale is None:
        return c
    return c * scale_rows(np.asarray(scale, np.float64))


def check_scalars(name: str, scale, softcap, sliding_window) -> None:
    check_scale(name, scale)
    check(softcap is None or _positive(softcap), ArgumentError, name, "softcap", f"{name}.softcap",
          "None or a finite number > 0", repr(softcap))
    ok = sliding_window is None or isinstance(sliding_window, (int, np.integer)) and not isinstance(sliding_window, bool) \
        and sliding_window >= 1
    check(ok, ArgumentError, name, "sliding_window", f"{name}.sliding_window", "None or an int >= 1", repr(sliding_window))


@paged_attention.check_values(("block_tables", "context_lens", "k_scale", "v_scale"))
def _check_tables(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, sliding_window, k_scale, v_scale):
    check_tables(NAME, k_cache, block_tables, context_lens)
    check_tensor_scales(NAME, k_scale, v_scale)


# on device arrays only under OPPORT_CHECK_VALUES=1 (a host read per call would break CUDA-graph capture); the cuda
# kernels guard their memory accesses instead (docs/serving.md, "What each call checks")
_check_tables.on_device = False


def check_tables(name: str, k_cache, block_tables, context_lens) -> None:
    """`<name>.context_range` and `<name>.block_range`: the lengths fit the tables, the blocks read exist."""
    num_blocks, bs = k_cache.shape[:2]
    bt, lens = np.asarray(block_tables).astype(np.int64), np.asarray(context_lens).astype(np.int64)
    cap = bt.shape[1] * bs
    bad = (lens < 0) | (lens > cap)
    first = int(np.flatnonzero(bad)[0]) if bad.any() else 0
    check(not bad.any(), ArgumentError, name, "context_lens", f"{name}.context_range",
          f"0 <= length <= max_blocks * block_size = {cap}", f"{int(lens[first])} for sequence {first}")
    used = np.arange(bt.shape[1])[None, :] < -(-lens[:, None] // bs)
    out = used & ((bt < 0) | (bt >= num_blocks))
    where = np.argwhere(out)[0] if out.any() else (0, 0)
    check(not out.any(), ArgumentError, name, "block_tables", f"{name}.block_range", f"blocks in [0, {num_blocks})",
          f"block {int(bt[tuple(where)])} at [{int(where[0])}, {int(where[1])}]")


def softmax_rows(s):
    """Safe softmax weights over the last axis: a row of all -inf gets weight 0 (its output is 0)."""
    m = s.max(axis=-1, keepdims=True)
    m = np.where(m == -np.inf, 0.0, m)
    p = np.exp(s - m)
    den = p.sum(axis=-1, keepdims=True)
    return p, den


# batch invariance (docs/conformance.md): the arrays whose leading axis is the batch
paged_attention.batched("q", "block_tables", "context_lens")  # sequences over one shared cache


@paged_attention.reference
def _reference(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, sliding_window, k_scale, v_scale):
    k_cache, v_cache = kv_values(k_cache, k_scale), kv_values(v_cache, v_scale)
    bsz, hq, d = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[3]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = np.zeros((bsz, hq, dv))
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for b in range(bsz):
            lo, hi = visible(int(context_lens[b]), sliding_window)
            if hi <= lo:
                continue
            k = np.repeat(gather(k_cache, block_tables[b], lo, hi), g, axis=1)  # [n, Hq, D]
            v = np.repeat(gather(v_cache, block_tables[b], lo, hi), g, axis=1)
            s = np.einsum("hd,nhd->hn", q[b], k) * scale
            if softcap is not None:
                s = softcap * np.tanh(s / softcap)
            p, den = softmax_rows(s)
            row = np.einsum("hn,nhd->hd", p, v)
            out[b] = np.where(den == 0, 0.0, row / np.where(den == 0, 1.0, den))
    return out


_WHY = "docs/numerics.md 3.3: K-accumulating (over D and the context), norm-wise against max|r|, as attention"
paged_attention.tolerance(
    float64=Tolerance(1e-7, 1e-7, "normwise", reason=_WHY),
    float32=Tolerance(1e-5, 1e-5, "normwise", reason=_WHY),
    float16=Tolerance(2e-3, 1e-5, "normwise", reason=_WHY + "; fp32 accumulation"),
    bfloat16=Tolerance(1.6e-2, 1e-5, "normwise", reason=_WHY + "; fp32 accumulation"),
)


def make_inputs(rng, dtype, lens, hq, hkv, d, block_size, dv=None, extra_blocks=3, qk_scale=1.0, pad_value=None):
    """q, caches and tables for sequences of the given lengths: each sequence gets distinct blocks shuffled over
    a cache with `extra_blocks` blocks nobody owns; every slot no sequence sees holds NaN (k) or inf (v), so a
    kernel that reads past a context, or a block it was not given, shows in the output. Table entries past a
    sequence's last block hold `pad_value` (default 0, as vLLM pads; the op never reads them, whatever they hold)."""
    dv = dv or d
    need = [-(-n // block_size) for n in lens]
    max_blocks = max([1, *need])
    num_blocks = sum(need) + extra_blocks
    order = rng.permutation(num_blocks)
    k_cache = cg.array((num_blocks, block_size, hkv, d), dtype, rng, "normal", qk_scale)
    v_cache = cg.array((num_blocks, block_size, hkv, dv), dtype, rng)
    seen_k = np.zeros((num_blocks, block_size), bool)
    tables = np.full((len(lens), max_blocks), 0 if pad_value is None else pad_value, np.int32)
    at = 0
    for b, (n, m) in enumerate(zip(lens, need)):
        tables[b, :m] = order[at:at + m]
        at += m
        pos = np.arange(n)
        seen_k[tables[b, pos // block_size], pos % block_size] = True
    k_cache[~seen_k] = cg.cast(np.nan, dtype)
    v_cache[~seen_k] = cg.cast(np.inf, dtype)
    q = cg.array((len(lens), hq, d), dtype, rng, "normal", qk_scale)
    return q, k_cache, v_cache, tables, np.asarray(lens, np.int32)


def make_case(name, dtype, lens, hq, hkv, d, block_size, dv=None, scale=None, softcap=None, sliding_window=None,
              qk_scale=1.0, tags=(), pad_value=None):
    rng = cg.rng_for(NAME, name, dtype)
    args = make_inputs(rng, dtype, lens, hq, hkv, d, block_size, dv, qk_scale=qk_scale, pad_value=pad_value)
    return Case(name, args, {"scale": scale, "softcap": softcap, "sliding_window": sliding_window}, tags)


def fp8_scales(x: np.ndarray, fmt: str, per_token: bool) -> np.ndarray:
    """float32 scales for a float cache [num_blocks, block_size, Hkv, D] as kv_cache_write_fp8 makes them: per token
    and head max(amax / fp8_max, 2^-126) over the row's finite values; per tensor the same over the whole cache."""
    a = np.where(np.isfinite(x), np.abs(np.asarray(x, np.float64)), 0.0)
    amax = a.max(axis=-1) if per_token else np.array([a.max(initial=0.0)])
    return np.maximum((amax / FP8_MAX[fmt]).astype(np.float32), np.float32(SCALE_FLOOR))


def fp8_quotients(x, scale, fmt: str) -> np.ndarray:
    """x / scale in float64 (per token and head, or one scale), clipped to ±fp8_max: NaN stays NaN, ±inf saturates
    (kv_cache_write_fp8's reference: the codes are judged as the fp8 values nearest these)."""
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.asarray(x, np.float64) / scale_rows(np.asarray(scale, np.float64))
        return np.clip(q, -FP8_MAX[fmt], FP8_MAX[fmt])


def fp8_codes(x: np.ndarray, scale: np.ndarray, fmt: str) -> np.ndarray:
    """x / scale, saturated to the format's range and rounded to nearest even (NaN stays NaN)."""
    return fp8_quotients(x, scale, fmt).astype(cg.np_dtype(fmt))


def as_fp8(c: Case, fmt: str, per_token: bool, cache_pos: tuple = (1, 2)) -> Case:
    """The case with its caches (at `cache_pos`) quantised to `fmt` and their scales as k_scale, v_scale. Slots no
    sequence sees hold NaN codes and, per token, NaN scales: a kernel that reads either shows in the output."""
    args = list(c.args)
    scales = []
    for i in cache_pos:
        x = np.asarray(args[i], np.float64)
        unseen = ~np.isfinite(x).all(axis=(2, 3))  # the float case poisons whole unseen slots
        s = fp8_scales(np.where(unseen[..., None, None], 0.0, x), fmt, per_token)
        codes = fp8_codes(x, s, fmt)
        codes[unseen] = cg.cast(np.nan, fmt)
        if per_token:
            s[unseen] = np.nan
        args[i] = codes
        scales.append(s)
    tag = f"fp8-{fmt[7:11]}-{'token' if per_token else 'tensor'}"
    return Case(f"{c.name}-{tag}", tuple(args), {**c.kwargs, "k_scale": scales[0], "v_scale": scales[1]}, c.tags)


def _window_nan(dtype: str) -> Case:
    """Sliding window: NaN in the keys before the window (in the cache, in blocks the sequence owns) never
    reaches the output."""
    c = make_case("window-hides-nan", dtype, [70, 33], 4, 2, 32, 16, sliding_window=20)
    q, kc, vc, bt, lens = c.args
    kc, vc = kc.copy(), vc.copy()
    for b in range(2):
        pos = np.arange(int(lens[b]) - 20)
        kc[bt[b, pos // 16], pos % 16, :, ::3] = cg.cast(np.nan, dtype)
        vc[bt[b, pos // 16], pos % 16, :, 1::4] = cg.cast(-np.inf, dtype)
    return Case(c.name, (q, kc, vc, bt, lens), c.kwargs, ("edge",))


@paged_attention.cases
def _cases(dtype):
    yield make_case("decode-b16-gqa", dtype, [1, 17, 40, 63], 8, 2, 64, 16, tags=("llm",))
    yield make_case("decode-b32-mha", dtype, [32, 5, 100], 4, 4, 32, 32)
    yield make_case("mqa-b16", dtype, [48, 49], 4, 1, 64, 16)
    yield make_case("long-context-split", dtype, [700, 3], 4, 1, 64, 16, qk_scale=2.0, tags=("llm",))
    yield make_case("d128-b16", dtype, [130, 77], 8, 2, 128, 16, tags=("llm",))
    yield make_case("dv-ne-d", dtype, [20, 9], 2, 1, 64, 16, dv=32)
    yield make_case("block-size-8", dtype, [9, 24], 2, 2, 16, 8)
    yield make_case("zero-length", dtype, [0, 12, 0], 2, 1, 32, 16, tags=("edge",))
    # table entries past a sequence's last block hold a block id that does not exist: never read
    yield make_case("padded-table", dtype, [3, 40, 17], 4, 2, 32, 16, pad_value=-1, tags=("edge",))
    yield make_case("softcap", dtype, [60, 31], 4, 2, 32, 16, softcap=5.0, qk_scale=3.0)
    yield make_case("sliding-window", dtype, [70, 10, 33], 4, 2, 32, 16, sliding_window=20)
    yield make_case("window-of-one", dtype, [5, 16], 2, 1, 32, 32, sliding_window=1, tags=("edge",))
    yield make_case("softcap-window-scale", dtype, [45], 4, 2, 32, 16, scale=0.3, softcap=2.0, sliding_window=32)
    yield make_case("large-scores", dtype, [90, 17], 2, 1, 64, 16, qk_scale=5.0, tags=("edge",))
    yield make_case("head-dim-1", dtype, [7, 20], 1, 1, 1, 16)
    yield _window_nan(dtype)
    # fp8 caches (kv_cache_write_fp8's): per token and head, and one static scale per tensor
    yield as_fp8(make_case("decode", dtype, [1, 40, 63], 4, 2, 64, 16, tags=("llm",)), "float8_e4m3fn", True)
    yield as_fp8(make_case("decode", dtype, [17, 30], 4, 1, 32, 16, softcap=5.0), "float8_e5m2", False)


@paged_attention.strategy
def _strategy(dtype):
    from hypothesis import strategies as st

    from opport.ops.attention import _well_conditioned_qk

    @st.composite
    def case(draw):
        bsz, hkv, g = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 4]))
        bs = draw(st.sampled_from([8, 16, 32]))
        lens = draw(st.lists(st.integers(0, 150), min_size=bsz, max_size=bsz))
        d = draw(st.sampled_from([1, 8, 16, 32, 64]))
        dv = draw(st.sampled_from([d, d, 16]))
        scale = draw(st.sampled_from([None, None, 0.05, 1.0]))
        softcap = draw(st.sampled_from([None, None, 1.0, 30.0]))
        window = draw(st.sampled_from([None, None, 1, 16, 50]))
        qk, seed = draw(st.sampled_from([0.1, 1.0, 3.0])), draw(cg.seeds())
        qk = min(qk, _well_conditioned_qk(d, scale))
        args = make_inputs(np.random.default_rng(seed), dtype, lens, hkv * g, hkv, d, bs, dv, qk_scale=qk)
        return Case(f"hyp-{seed}", args, {"scale": scale, "softcap": softcap, "sliding_window": window}, ("hypothesis",))

    return case()


@paged_attention.error_cases
def _error_cases():
    def t(*shape, dt=np.float32):
        return np.zeros(shape, dt)

    q, kc, vc = t(2, 4, 16), t(5, 16, 2, 16), t(5, 16, 2, 16)
    bt, lens = np.array([[0, 1], [2, 3]], np.int32), np.array([20, 3], np.int32)
    yield ErrorCase(f"{NAME}.dtype", DTypeError, (t(2, 4, 16, dt=np.int32), kc, vc, bt, lens))
    yield ErrorCase(f"{NAME}.dtype_mismatch", DTypeError, (q, t(5, 16, 2, 16, dt=np.float16), vc, bt, lens))
    yield ErrorCase(f"{NAME}.rank", ShapeError, (t(2, 1, 4, 16), kc, vc, bt, lens))
    yield ErrorCase(f"{NAME}.rank", ShapeError, (q, t(80, 2, 16), vc, bt, lens))
    yield ErrorCase(f"{NAME}.rank", ShapeError, (q, kc, vc, bt.reshape(-1), lens))
    yield ErrorCase(f"{NAME}.batch", ShapeError, (q, kc, vc, bt[:1], lens))
    yield ErrorCase(f"{NAME}.batch", ShapeError, (q, kc, vc, bt, lens[:1]))
    yield ErrorCase(f"{NAME}.gqa_ratio", ShapeError, (q, t(5, 16, 3, 16), t(5, 16, 3, 16), bt, lens))
    yield ErrorCase(f"{NAME}.gqa_ratio", ShapeError, (q, kc, t(5, 16, 1, 16), bt, lens))
    yield ErrorCase(f"{NAME}.head_dim", ShapeError, (q, t(5, 16, 2, 8), vc, bt, lens))
    yield ErrorCase(f"{NAME}.cache_shape", ShapeError, (q, kc, t(5, 32, 2, 16), bt, lens))
    yield ErrorCase(f"{NAME}.cache_shape", ShapeError, (q, t(5, 0, 2, 16), t(5, 0, 2, 16), bt, lens))
    yield ErrorCase(f"{NAME}.index_dtype", DTypeError, (q, kc, vc, bt.astype(np.int64), lens))
    yield ErrorCase(f"{NAME}.index_dtype", DTypeError, (q, kc, vc, bt, lens.astype(np.float32)))
    yield ErrorCase(f"{NAME}.scale", ArgumentError, (q, kc, vc, bt, lens), {"scale": float("nan")})
    for bad in (np.array([0.5]), [0.5]):  # a 1-element array is not a scalar
        yield ErrorCase(f"{NAME}.scale", ArgumentError, (q, kc, vc, bt, lens), {"scale": bad})
    yield ErrorCase(f"{NAME}.softcap", ArgumentError, (q, kc, vc, bt, lens), {"softcap": 0.0})
    yield ErrorCase(f"{NAME}.softcap", ArgumentError, (q, kc, vc, bt, lens), {"softcap": float("inf")})
    yield ErrorCase(f"{NAME}.sliding_window", ArgumentError, (q, kc, vc, bt, lens), {"sliding_window": 0})
    yield ErrorCase(f"{NAME}.sliding_window", ArgumentError, (q, kc, vc, bt, lens), {"sliding_window": 4.0})
    yield ErrorCase(f"{NAME}.context_range", ArgumentError, (q, kc, vc, bt, np.array([33, 3], np.int32)))
    yield ErrorCase(f"{NAME}.context_range", ArgumentError, (q, kc, vc, bt, np.array([-1, 3], np.int32)))
    yield ErrorCase(f"{NAME}.block_range", ArgumentError, (q, kc, vc, np.array([[0, 5], [2, 3]], np.int32), lens))
    yield ErrorCase(f"{NAME}.block_range", ArgumentError, (q, kc, vc, np.array([[0, 1], [-1, 3]], np.int32), lens))
    yield from kv_scale_errors(NAME, lambda kc, vc: (q, kc, vc, bt, lens))


def kv_scale_errors(name: str, args):
    """Bad fp8 caches and scales; `args(k_cache, v_cache)` gives the op's other arguments (caches [5, 16, 2, 16])."""
    e4, e5 = np.zeros((5, 16, 2, 16), cg.np_dtype("float8_e4m3fn")), np.zeros((5, 16, 2, 16), cg.np_dtype("float8_e5m2"))
    one, tok = np.ones(1, np.float32), np.ones((5, 16, 2), np.float32)
    f32 = np.zeros((5, 16, 2, 16), np.float32)
    yield ErrorCase(f"{name}.dtype_mismatch", DTypeError, args(e4, e5), {"k_scale": one, "v_scale": one})
    yield ErrorCase(f"{name}.kv_scale", ArgumentError, args(e4, e4))  # fp8 without scales
    yield ErrorCase(f"{name}.kv_scale", ArgumentError, args(e4, e4), {"k_scale": one})
    yield ErrorCase(f"{name}.kv_scale", ArgumentError, args(f32, f32), {"k_scale": one, "v_scale": one})
    yield ErrorCase(f"{name}.kv_scale", DTypeError, args(e4, e4), {"k_scale": one.astype(np.float16), "v_scale": one})
    yield ErrorCase(f"{name}.kv_scale", ShapeError, args(e4, e4), {"k_scale": tok[:, :, :1], "v_scale": tok[:, :, :1]})
    yield ErrorCase(f"{name}.kv_scale", ShapeError, args(e5, e5), {"k_scale": tok, "v_scale": one})  # mixed granularity
    for bad in (0.0, -1.0, np.nan, np.inf):
        yield ErrorCase(f"{name}.scale_values", ArgumentError, args(e4, e4),
                        {"k_scale": one, "v_scale": np.array([bad], np.float32)})


@paged_attention.shape
def _shape(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, sliding_window, *kv_scales):
    return (*q.shape[:2], v_cache.shape[3])


def visited_blocks(block_tables, block_size: int, sliding_window) -> int:
    """Blocks read, from the tables' shape: every sequence uses its whole table (the bench's rows, and the
    bound for others); a window reads at most cdiv(W - 1, block_size) + 1 blocks per sequence."""
    bsz, max_blocks = block_tables.shape
    per = max_blocks if sliding_window is None else min(max_blocks, -(-(sliding_window - 1) // block_size) + 1)
    return bsz * per


def kv_bytes(k_cache, v_cache, k_scale, blocks: int) -> int:
    """Bytes of `blocks` visited blocks of K and V in the caches' own dtype (1 byte for fp8), with their per-token
    scales (4 bytes per slot and head, K and V) when the cache has them."""
    _, bs, hkv, d = k_cache.shape
    item = np.dtype(cg.np_dtype(k_cache.dtype)).itemsize
    scales = 2 * 4 * hkv if k_scale is not None and per_token_scales(k_scale) else 0
    return blocks * bs * (hkv * (d + v_cache.shape[3]) * item + scales)


@paged_attention.cost
def _cost(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, sliding_window, k_scale, v_scale):
    bsz, hq, d = q.shape
    _, bs, hkv, dv = v_cache.shape
    item = np.dtype(cg.np_dtype(q.dtype)).itemsize
    blocks = visited_blocks(block_tables, bs, sliding_window)
    kv = kv_bytes(k_cache, v_cache, k_scale, blocks)
    keys = blocks * bs
    io = (q.size + bsz * hq * dv) * item + 4 * (block_tables.size + context_lens.size)
    return Cost(bytes=kv + io, flops=2 * (hq // hkv) * hkv * keys * (d + dv))
