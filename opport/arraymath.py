"""NumPy helpers that both the float64 references (opport/ops/) and the cpu kernels use.

They live here, apart from the declarations, so that no kernel imports the code that judges it. Because
the oracle and the cpu kernels share them, a bug here would be invisible to the cpu conformance run:
each helper is therefore checked on its own, against hand-computed values (tests/test_arraymath.py).
"""

from __future__ import annotations

import numpy as np


def reduce_losses(loss: np.ndarray, ignored: np.ndarray, reduction: str):
    """Apply the reduction to per-row losses (ignored rows already 0); the mean divides by the kept rows."""
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return np.asarray(total)
    kept = int(ignored.size - np.count_nonzero(ignored))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.asarray(total / loss.dtype.type(kept))


def row_scale(x: np.ndarray, limit: float) -> np.ndarray:
    """Per-row power of two that brings max|x| of rows above `limit` into [0.5, 1); 1 for the other rows.

    Scaling by a power of two is exact (short of underflow far below the row's largest value), and
    the norms are scale invariant once eps is scaled along: eps * s**2.
    """
    amax = np.max(np.abs(x), axis=-1, keepdims=True)
    big = np.isfinite(amax) & (amax > limit)
    return np.where(big, np.ldexp(x.dtype.type(1), -np.frexp(amax)[1]), x.dtype.type(1))


def pair_views(a: np.ndarray, interleaved: bool):
    """Views of the two members of each rotated pair: (a[..., 0::2], a[..., 1::2]) or the two halves."""
    h = a.shape[-1] // 2
    return (a[..., 0::2], a[..., 1::2]) if interleaved else (a[..., :h], a[..., h:])


# fp8 scaling (quantize_fp8, dequantize_fp8, scaled_matmul)
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}  # the formats' largest finite values (OCP FP8)

SCALE_FLOOR = float(np.finfo(np.float32).tiny)  # smallest normal float32: the scale of an all-zero group (never 0)


def scales_shape(shape: tuple, granularity: str, block: int) -> tuple:
    """The shape of the scales of an array shaped `shape` (x's rank; see quantize_fp8's docstring)."""
    if granularity == "tensor":
        return (1,) * len(shape)
    return tuple(shape[:-1]) + ((1,) if granularity == "token" else (shape[-1] // block,))


def grouped(x: np.ndarray, granularity: str, block: int) -> np.ndarray:
    """x viewed as (*scales shape, group elements): the last axis is one scaling group."""
    if granularity == "tensor":
        return x.reshape((1,) * x.ndim + (-1,))
    if granularity == "token":
        return x[..., None, :]
    return x.reshape(x.shape[:-1] + (x.shape[-1] // block, block))


BLOCK = 128  # DeepSeek-V3's block: a scaled in 1 x 128 blocks along K, b in 128 x 128 blocks


def expand_a(scale_a: np.ndarray, k: int) -> np.ndarray:
    """scale_a broadcastable against a_q: each K group's scale repeated over its 128 columns (0-d as it is)."""
    g = scale_a.shape[-1] if scale_a.ndim else 1
    return scale_a if g == 1 else np.repeat(scale_a, k // g, axis=-1)


def expand_b(scale_b: np.ndarray, k: int, n: int) -> np.ndarray:
    """scale_b broadcastable against b_q [K, N]: K groups over their 128 rows, column blocks over their 128
    columns (the last one cut at N); 0-d as it is."""
    if scale_b.ndim == 0:
        return scale_b
    s = scale_b if scale_b.shape[0] == 1 else np.repeat(scale_b, k // scale_b.shape[0], axis=0)
    if s.shape[1] not in (1, n):
        s = np.repeat(s, BLOCK, axis=1)[:, :n]
    return s


# packed and paged sequences (varlen_attention, kv_cache_write, paged_attention)
PAD = -1  # a slot of -1 is skipped: a padding token (vLLM's convention)


def per_token_scales(scale) -> bool:
    """An fp8 cache's scales are per (token, head), [num_blocks, block_size, Hkv] (written by kv_cache_write_fp8),
    not one per tensor, [1] (read)."""
    return tuple(scale.shape) != (1,)


def scale_rows(scale):
    """fp8 scales ready to multiply rows [..., D]: per (token, head) scales [..., Hkv] gain a trailing axis, a
    per-tensor [1] becomes a scalar."""
    return scale[..., None] if per_token_scales(scale) else scale.reshape(())


def sequences(cu_seqlens_q, cu_seqlens_k):
    """(q token slice, k token slice) per sequence."""
    cq, ck = np.asarray(cu_seqlens_q, np.int64), np.asarray(cu_seqlens_k, np.int64)
    return [(slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])) for b in range(len(cq) - 1)]


def cu(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def visible(length: int, sliding_window) -> tuple:
    """(first, end) positions a query at position length - 1 sees."""
    lo = 0 if sliding_window is None else max(0, length - sliding_window)
    return lo, length


def paged_spans(cu_seqlens_q, context_lens, sliding_window) -> list:
    """paged_varlen_attention's sequences: (their token slice of q, the first position any of their new tokens
    sees, their context length). Sequence b's n new tokens are its last n positions."""
    out = []
    for b in range(len(context_lens)):
        t0, t1, ctx = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(context_lens[b])
        first = ctx - (t1 - t0)  # the first new token's position
        lo = 0 if sliding_window is None else max(0, first + 1 - sliding_window)
        out.append((slice(t0, t1), lo, ctx))
    return out


def as_heads(x):
    """[T, H, D] tokens of one sequence as attention's [1, H, T, D] (a view)."""
    return x.transpose(1, 0, 2)[None]


def gather(cache, table, lo: int, hi: int):
    """cache rows of positions lo .. hi - 1 of one sequence: [hi - lo, Hkv, D]."""
    pos = np.arange(lo, hi)
    bs = cache.shape[1]
    return cache[np.asarray(table)[pos // bs].astype(np.int64), pos % bs]


# attention's visibility and soft cap (the references and the cpu kernels)
def visible_range(sq: int, sk: int, causal: bool, window: int | None = None) -> tuple:
    """For each query row, the keys it sees as [lo, hi): hi = min(Sk, max(0, i + Sk - Sq + 1)) when causal
    (Sk otherwise), lo = max(0, hi_unclipped - W) with a window W (never above hi)."""
    i = np.arange(sq)
    limit = i + sk - sq + 1  # one past the last visible key (bottom-right)
    hi = np.clip(limit, 0, sk) if causal else np.full(sq, sk)
    lo = np.zeros(sq, np.int64) if window is None else np.minimum(np.clip(limit - window, 0, sk), hi)
    return lo, hi


def visible_keys(sq: int, sk: int, causal: bool, window: int | None = None) -> np.ndarray:
    """For each query row, how many keys it sees."""
    lo, hi = visible_range(sq, sk, causal, window)
    return hi - lo


def capped(s: np.ndarray, softcap) -> np.ndarray:
    """The scores after the soft cap: c·tanh(s / c) (s itself without one)."""
    return s if softcap is None else softcap * np.tanh(s / softcap)
