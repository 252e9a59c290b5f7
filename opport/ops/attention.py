"""attention: softmax(softcap(q @ k^T * scale), masked) @ v with grouped KV heads, a bottom-right causal mask
and an optional sliding window."""

from __future__ import annotations

import math

import numpy as np

from opport import casegen as cg
from opport.arraymath import capped, visible_keys, visible_range
from opport.dtypes import finfo
from opport.errors import ArgumentError, DTypeError, ShapeError
from opport.spec import (
    Case,
    Cost,
    ErrorCase,
    Tolerance,
    check,
    check_bool,
    check_float,
    check_grad,
    check_ndim,
    check_same_dtype,
    check_scale,
    check_softcap_window,
    grad_constraints,
    op,
)

NAME = "attention"
SCALE_RULE = "scale is None or a finite real scalar (Python or NumPy, not an array or tensor), abs(scale) <= 1e4"


@op(
    arrays=("q", "k", "v"),
    constraints={
        "attention.dtype": "q is float32, float16, bfloat16 or float64",
        "attention.dtype_mismatch": "k and v have q's dtype",
        "attention.rank": "q, k, v are 4-d: [B, Hq, Sq, D], [B, Hkv, Sk, D], [B, Hkv, Sk, Dv]",
        "attention.batch": "q, k, v share the batch size B",
        "attention.gqa_ratio": "k and v have the same Hkv >= 1 and Hq % Hkv == 0",
        "attention.head_dim": "k.shape[-1] == q.shape[-1] = D >= 1",
        "attention.kv_seq": "k and v have the same key length Sk",
        "attention.causal": "causal is True or False",
        "attention.scale": SCALE_RULE,
        "attention.softcap": "softcap is None or a finite number > 0",
        "attention.sliding_window": "sliding_window is None or an int, 1 <= W <= 2**31 - 1, given with causal=True",
    },
)
def attention(q, k, v, causal: bool = False, scale: float | None = None, softcap: float | None = None,
              sliding_window: int | None = None):
    """Scaled dot-product attention, out [B, Hq, Sq, Dv].

    Query head h reads KV head h // (Hq / Hkv) (grouped-query attention). scale defaults to
    1/sqrt(D); |scale| <= 1e4 (scores are computed in float32). The causal mask is bottom-right
    aligned (FlashAttention): query i sees key j iff j <= i + Sk - Sq. A query row that sees no key
    (Sk = 0, or i < Sq - Sk when causal) outputs 0, as does a row whose visible scores are all -inf
    (SDPA's safe softmax). Masked keys get exactly zero weight: NaN or inf in masked k or v never
    reaches the output.

    softcap c (Gemma 2, FlashAttention's softcap): the scaled scores s become c·tanh(s / c) before the
    softmax. sliding_window W (requires causal=True; FlashAttention's window_size=(W - 1, 0)): query i,
    whose causal limit is p = i + Sk - Sq, sees key j iff p - W < j <= p, so W = 1 sees only key p.

    Range (docs/numerics.md 3.9), with M the largest finite value of the accumulation dtype (float32 for 16-
    and 32-bit inputs, float64 for float64): a query row's output is defined while, for each key it sees,
    sum_d |q_d| |k_d| max(1, 2|scale|) <= M (no partial sum of a score overflows, unscaled, scaled, or times
    log2(e) for an exp2), and, per output column, the sum over its visible keys of |v| is <= M (no partial
    weighted sum of v overflows: the unnormalised weights are <= 1); `range_bounds` computes both. There
    it is the exact result rounded to the dtype (finite: it is an average of v). float16 inputs are always
    inside. A score that overflows is ±inf, as torch's float32 attention computes it: a row with a visible
    +inf score is NaN, a key at -inf gets weight 0 (the exact limit, which the reference agrees with).
    Between the bound and overflow the result is unspecified. The backward additionally needs the saved
    float32 lse to pin the probabilities, P = exp(s - lse), to within the tolerance: |lse| u << 1
    (u = 2^-24), i.e. scores far below 1e5; past that its gradients are unspecified.
    """
    check_float(NAME, "q", q)
    check_same_dtype(NAME, "q", q, k=k, v=v)
    for arg, m in (("q", q), ("k", k), ("v", v)):
        check_ndim(NAME, arg, m, 4, constraint="attention.rank")
    for arg, m in (("k", k), ("v", v)):
        check(m.shape[0] == q.shape[0], ShapeError, NAME, arg, "attention.batch", f"batch {q.shape[0]} (as q)", m.shape)
    hq, hkv = q.shape[1], k.shape[1]
    check(hkv >= 1 and hq % hkv == 0, ShapeError, NAME, "k", "attention.gqa_ratio", f"Hkv >= 1 dividing Hq = {hq}", k.shape)
    check(v.shape[1] == hkv, ShapeError, NAME, "v", "attention.gqa_ratio", f"Hkv = {hkv} heads (as k)", v.shape)
    check(q.shape[3] >= 1 and k.shape[3] == q.shape[3], ShapeError, NAME, "k", "attention.head_dim",
          f"head dim D = {q.shape[3]} (as q), >= 1", k.shape)
    check(v.shape[2] == k.shape[2], ShapeError, NAME, "v", "attention.kv_seq", f"Sk = {k.shape[2]} (as k)", v.shape)
    check_bool(NAME, "causal", causal)
    check_scale(NAME, scale)
    check_softcap_window(NAME, softcap, sliding_window, causal)


def range_bounds(q, k, v, causal: bool = False, scale=None, sliding_window=None) -> tuple:
    """(scores, values) in float64 for the op's Range: the largest sum_d |q_d| |k_d| max(1, 2|scale|) over the
    (query, key) pairs that are visible, and the largest sum of |v| over one row's visible keys (per output
    column). Both at most M, the accumulation dtype's largest finite value: defined."""
    b, hq, sq, d = q.shape
    sk = k.shape[2]
    if sq == 0 or sk == 0:
        return 0.0, 0.0
    g = hq // k.shape[1]
    qa = np.abs(np.asarray(q, np.float64))
    ka = np.repeat(np.abs(np.asarray(k, np.float64)), g, axis=1)
    va = np.repeat(np.abs(np.asarray(v, np.float64)), g, axis=1)
    factor = max(1.0, 2 * abs(1.0 / math.sqrt(d) if scale is None else scale))
    lo, hi = visible_range(sq, sk, causal, sliding_window)
    scores = values = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for i in range(sq):
            if hi[i] > lo[i]:
                keys = slice(lo[i], hi[i])
                scores = max(scores, float(np.einsum("bhd,bhkd->bhk", qa[:, :, i], ka[:, :, keys]).max()) * factor)
                values = max(values, float(va[:, :, keys].sum(axis=2).max()))
    return scores, values


# batch invariance (docs/conformance.md): the arrays whose leading axis is the batch
attention.batched("q", "k", "v")  # [B, H, S, D]: sequences


@attention.reference
def _reference(q, k, v, causal, scale, softcap=None, sliding_window=None):
    b, hq, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    out = np.zeros((b, hq, sq, dv))
    if sk == 0 or sq == 0:
        return out
    g = hq // hkv
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    lo, hi = visible_range(sq, sk, causal, sliding_window)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for rows, keys, seen in row_blocks(lo, hi, b * hq, q, k, v):  # masked k/v values never enter: see there
            s = capped(np.einsum("bhqd,bhkd->bhqk", q[:, :, rows], k[:, :, keys]) * scale, softcap)
            s = s if seen is None else np.where(seen, s, -np.inf)
            m = s.max(axis=-1, keepdims=True)
            m = np.where(m == -np.inf, 0.0, m)  # all -inf: weights 0, row stays 0
            p = np.exp(s - m)
            den = p.sum(axis=-1)[..., None]
            row = np.einsum("bhqk,bhkd->bhqd", p, v[:, :, keys])
            out[:, :, rows] = np.where(den == 0, 0.0, row / np.where(den == 0, 1.0, den))
    return out


BLOCK = 1 << 20  # float64 scores per block of query rows (8 MB): the references' working set


def row_blocks(lo, hi, heads: int, *arrays):
    """Blocks of query rows the references compute together: (rows, keys, seen), slices of rows and of the keys
    they span, and `seen`, a [rows, keys] mask of what each row sees (None: all of `keys`). Rows of different
    ranges share a block only when `arrays` are all finite: a masked score's weight is then an exact 0 and every
    product with it too, so a masked key changes nothing; with an inf or NaN about (0 * inf is NaN), rows of one
    range [lo, hi) at a time, each over its visible keys only, as the op's mask says."""
    sq = len(lo)
    if not sq:
        return
    mixed = all(np.isfinite(a).all() for a in arrays)
    step = max(1, BLOCK // (max(1, heads) * max(1, int(hi.max() - lo.min()))))
    i = 0
    while i < sq:
        j = min(sq, i + step) if mixed else i + 1
        while not mixed and j < sq and lo[j] == lo[i] and hi[j] == hi[i]:
            j += 1
        k0, k1 = int(lo[i:j].min()), int(hi[i:j].max())
        if k1 > k0:
            seen = None
            if mixed:
                keys = np.arange(k0, k1)
                seen = (keys >= lo[i:j, None]) & (keys < hi[i:j, None])
            yield slice(i, j), slice(k0, k1), None if seen is None or seen.all() else seen
        i = j


_WHY = "docs/numerics.md 3.3: K-accumulating (over D and Sk), norm-wise against max|r|"
attention.tolerance(
    float64=Tolerance(1e-7, 1e-7, "normwise", reason=_WHY),
    float32=Tolerance(1e-5, 1e-5, "normwise", reason=_WHY),
    float16=Tolerance(2e-3, 1e-5, "normwise", reason=_WHY + "; fp32 accumulation"),
    bfloat16=Tolerance(1.6e-2, 1e-5, "normwise", reason=_WHY + "; fp32 accumulation"),
)


def _qkv(rng, dtype, b, hq, hkv, sq, sk, d, dv=None, qk_scale=1.0, v_dist="normal"):
    """q and k are normal with std qk_scale, so scores have std ~qk_scale**2: softmax amplifies the float32
    rounding of a score s (~eps·|s|) into the output, so well-conditioned cases keep |s| in the low hundreds
    at most; v, which enters linearly, may take any distribution."""
    q = cg.array((b, hq, sq, d), dtype, rng, "normal", qk_scale)
    k = cg.array((b, hkv, sk, d), dtype, rng, "normal", qk_scale)
    v = cg.array((b, hkv, sk, dv or d), dtype, rng, v_dist, 1.0)
    return q, k, v


def _case(name, dtype, b, hq, hkv, sq, sk, d, dv=None, causal=False, scale=None, v_dist="normal", qk_scale=1.0, tags=(),
          softcap=None, window=None):
    q, k, v = _qkv(cg.rng_for(NAME, name, dtype), dtype, b, hq, hkv, sq, sk, d, dv, qk_scale, v_dist)
    extra = {k: x for k, x in (("softcap", softcap), ("sliding_window", window)) if x is not None}
    return Case(name, (q, k, v), {"causal": causal, "scale": scale, **extra}, tags)


def _nan_under_mask(dtype: str) -> Case:
    """Causal with Sq > Sk: NaN/inf in every k and v position some query must not see; the first rows see nothing."""
    rng = cg.rng_for(NAME, "nan-under-mask", dtype)
    sq, sk = 48, 40
    q, k, v = _qkv(rng, dtype, 1, 2, 1, sq, sk, 32)  # GQA 2:1 (heads: the emulated backends' time)
    k[:, :, sk - 3:, ::5] = cg.cast(np.nan, dtype)  # the last keys are masked for all but the last rows
    v[:, :, sk - 3:, ::7] = cg.cast(np.inf, dtype)
    q[:, :, : sq - sk] = cg.cast(np.nan, dtype)  # rows that see no key: output 0 whatever q holds
    return Case("nan-under-mask", (q, k, v), {"causal": True, "scale": None}, ("edge",))


def _nonfinite_v_on_diagonal(dtype: str) -> Case:
    """Causal, finite scores, NaN/inf in v at keys that later rows see and earlier rows do not.

    Rows from key j on get NaN/±inf in exactly v[j]'s non-finite columns (weights are > 0); rows
    before j must stay finite, although a kernel's tile holds both kinds of rows in one key block.
    """
    rng = cg.rng_for(NAME, "nonfinite-v-on-diagonal", dtype)
    q, k, v = _qkv(rng, dtype, 1, 2, 2, 70, 70, 32)  # two kv heads, each with its own non-finite keys
    v[:, 0, 21, ::3] = cg.cast(np.inf, dtype)
    v[:, 0, 22, 1::3] = cg.cast(-np.inf, dtype)
    v[:, 1, 45, ::4] = cg.cast(np.nan, dtype)
    v[:, 1, 66, 2] = cg.cast(np.inf, dtype)
    return Case("nonfinite-v-on-diagonal", (q, k, v), {"causal": True, "scale": None}, ("edge",))


def _nonfinite_visible(dtype: str) -> Case:
    """A NaN in one query row and +inf scores in one head: those rows are NaN, every other row is untouched."""
    rng = cg.rng_for(NAME, "nonfinite-visible", dtype)
    q, k, v = _qkv(rng, dtype, 1, 2, 2, 16, 16, 32)
    q[0, 0, 3, 4] = cg.cast(np.nan, dtype)
    k[0, 1, 5, :] = cg.cast(np.inf, dtype)
    q[0, 1, :, :] = np.abs(q[0, 1])  # q·k[5] = +inf exactly (no inf - inf)
    return Case("nonfinite-visible", (q, k, v), {"causal": False, "scale": None}, ("edge",))


@attention.cases
def _cases(dtype):
    yield _case("prefill-h8-d64", dtype, 1, 8, 8, 128, 128, 64, tags=("llm",))
    yield _case("prefill-causal-h4-d128", dtype, 1, 4, 4, 64, 64, 128, causal=True, tags=("llm",))
    yield _case("gqa-8-2-causal", dtype, 1, 8, 2, 96, 96, 64, causal=True, tags=("llm",))
    yield _case("gqa-8-2", dtype, 2, 8, 2, 33, 47, 64)
    yield _case("mqa-4-1-causal", dtype, 1, 4, 1, 70, 70, 32, causal=True)
    yield _case("decode", dtype, 2, 8, 2, 1, 300, 128, causal=True, tags=("llm",))
    yield _case("decode-noncausal", dtype, 1, 4, 4, 1, 129, 64)
    # a long cache over few KV heads: kernels may split the keys (flash-decoding); scores of std ~9 give
    # each split a different running max, so merging the splits must rescale them
    yield _case("decode-long-kv", dtype, 2, 8, 1, 1, 1000, 64, qk_scale=3.0, tags=("llm",))
    yield _case("chunked-prefill-sq-lt-sk", dtype, 1, 4, 2, 37, 150, 64, causal=True, tags=("llm",))
    yield _case("sq-gt-sk-causal-masked-rows", dtype, 1, 2, 1, 50, 20, 64, causal=True, tags=("edge",))
    yield _case("sq-gt-sk-noncausal", dtype, 1, 2, 1, 50, 20, 64)
    yield _case("dv-ne-d", dtype, 1, 2, 2, 17, 23, 64, dv=32, causal=True)
    yield _case("head-dim-1", dtype, 1, 1, 1, 9, 9, 1)
    yield _case("scale-explicit", dtype, 1, 2, 2, 31, 31, 64, scale=0.5)
    yield _case("empty-kv", dtype, 1, 2, 2, 5, 0, 64, tags=("edge",))
    yield _case("empty-q", dtype, 1, 2, 2, 0, 7, 64, tags=("edge",))
    # scores up to ~150: exp overflows float32 unless the running max is subtracted
    yield _case("large-scores", dtype, 1, 2, 2, 65, 65, 64, causal=True, qk_scale=5.0, tags=("edge",))
    yield _case("heavy-tailed-v", dtype, 1, 2, 1, 64, 64, 64, v_dist="heavy")
    yield _case("loguniform-v", dtype, 1, 2, 1, 40, 64, 64, v_dist="loguniform", causal=True)
    yield _nan_under_mask(dtype)
    yield _nonfinite_v_on_diagonal(dtype)
    yield _nonfinite_visible(dtype)
    yield from _softcap_window_cases(dtype)
    yield from _range_cases(dtype)


def _range_cases(dtype):
    """The edge of the op's Range (docs/numerics.md 3.9), whose backward stays defined too. "near-max-qk": q, k of
    random signs with range_bounds' scores at 0.9 M (float16: q, k up to 65504, whose products would overflow a
    float16 score), under a tiny scale that leaves the scaled scores std ~3. "near-max-v": q = k = 0 (uniform
    weights) and v with range_bounds' values at 0.9 M (float16: v up to 65504): the output is the mean of v.
    "past-max-negative": two of three keys score about -6 M (every product one sign), which overflows to -inf
    and gets weight 0, the exact limit too; every row also sees moderate keys. "past-max-softcap": those keys at
    +6 M under a soft cap: +inf capped to the cap, as the exact score is."""
    rng = cg.rng_for(NAME, "range", dtype)
    big = float(np.finfo(np.float64 if dtype == "float64" else np.float32).max)
    wide = dtype != "float16"  # float16's products cannot reach float32's maximum

    def signed(*shape):
        return rng.uniform(0.5, 1, shape) * rng.choice([-1, 1], shape)

    uq, uk = signed(1, 2, 16, 32), signed(1, 1, 24, 32)
    c = math.sqrt(0.9 * big / range_bounds(uq, uk, uk, True, 1e-30)[0]) if wide else float(finfo(dtype).max)
    q, k = cg.cast(uq * c, dtype), cg.cast(uk * c, dtype)
    s = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64) / c, np.repeat(k.astype(np.float64) / c, 2, axis=1))
    v = cg.cast(rng.standard_normal((1, 1, 24, 32)) * 10, dtype)
    yield Case("near-max-qk", (q, k, v), {"causal": True, "scale": 3.0 / (float(s.std()) * c * c)}, ("edge",))
    vv = signed(1, 1, 128, 8)
    scale_v = 0.9 * big / np.abs(vv).sum(axis=2).max() if wide else float(finfo(dtype).max)
    zeros = cg.cast(np.zeros((1, 2, 4, 8)), dtype)
    yield Case("near-max-v", (zeros, zeros[:, :1].repeat(32, axis=2), cg.cast(vv * scale_v, dtype)),
               {"causal": False, "scale": None}, ("edge",))
    if dtype in ("float32", "bfloat16"):  # (float64 scores of -6 M: NumPy's own einsum returns NaN)
        cq = math.sqrt(2 * big / 32)  # |q . k| = 32 cq^2 u^2 >= 2 M for the far keys
        q = cg.cast(rng.uniform(1, 2, (1, 2, 12, 32)) * cq, dtype)
        far = np.arange(20) % 3 != 0
        k = np.where(far[:, None], -2 * cq, rng.standard_normal((20, 32)) / (4 * cq))[None, None]
        v = cg.cast(rng.standard_normal((1, 1, 20, 16)), dtype)
        yield Case("past-max-negative", (q, cg.cast(k, dtype), v), {"causal": True, "scale": 1.0}, ("edge",))
        # the far keys at +6 M instead: +inf, capped to exactly the cap as the exact score is
        yield Case("past-max-softcap", (q, cg.cast(np.abs(k), dtype), v), {"causal": True, "scale": 1.0, "softcap": 8.0},
                   ("edge",))


def _softcap_window_cases(dtype):
    """Soft caps and sliding windows: Gemma-2-like heads (D = 256, cap 50, GQA 2), small windows inside and
    across blocks, windows of 1 and wider than Sk, chunked prefill and Sq > Sk under a window."""
    yield _case("gemma2-softcap-window", dtype, 1, 4, 2, 96, 96, 256, causal=True, softcap=50.0, window=32, tags=("llm",))
    yield _case("gemma2-softcap-global", dtype, 1, 4, 2, 80, 80, 256, causal=True, softcap=50.0, tags=("llm",))
    # scores of std ~9 against a cap of 5: tanh saturates, its slope near 0
    yield _case("softcap-saturated", dtype, 1, 2, 1, 40, 56, 64, softcap=5.0, qk_scale=3.0)
    yield _case("softcap-noncausal-gqa", dtype, 2, 8, 2, 33, 47, 64, softcap=30.0, scale=0.5)
    yield _case("window-1", dtype, 1, 4, 2, 40, 40, 32, causal=True, window=1)
    yield _case("window-7-gqa", dtype, 1, 8, 2, 70, 70, 64, causal=True, window=7)
    yield _case("window-wider-than-sk", dtype, 1, 2, 2, 30, 30, 64, causal=True, window=1000)
    yield _case("window-chunked-prefill", dtype, 1, 4, 2, 37, 150, 64, causal=True, window=50, tags=("llm",))
    yield _case("window-sq-gt-sk", dtype, 1, 2, 1, 50, 20, 64, causal=True, window=8, softcap=10.0, tags=("edge",))
    yield _case("window-decode", dtype, 2, 8, 2, 1, 300, 128, causal=True, window=64, softcap=50.0, tags=("llm",))
    yield _window_nan_outside(dtype)


def _window_nan_outside(dtype: str) -> Case:
    """NaN/inf in k and v keys that fall out of every late row's window: those rows stay finite."""
    rng = cg.rng_for(NAME, "window-nan-outside", dtype)
    q, k, v = _qkv(rng, dtype, 1, 2, 1, 64, 64, 32)
    k[:, :, 2, ::3] = cg.cast(np.nan, dtype)  # seen by rows 2..17 (W = 16) only
    v[:, :, 5, ::4] = cg.cast(np.inf, dtype)  # rows 5..20
    return Case("window-nan-outside", (q, k, v), {"causal": True, "scale": None, "sliding_window": 16}, ("edge",))


# The scaled scores' standard deviation the random cases stay within (the fixed case "large-scores" goes
# to 25): their largest |s| stays near 100, where float32's rounding of s (eps * |s|, amplified by exp)
# is below the float32 tolerance whatever the summation order. scale = 1.0 with std-3 q and k at D = 32
# reached |s| = 223: every backend missed rtol 1e-5 there by up to 15% (hyp-182~2 of the full tier),
# while NumPy's einsum order happened to stay inside.
SCORE_STD_MAX = 20.0


def _well_conditioned_qk(d: int, scale) -> float:
    """The largest q/k standard deviation whose scaled scores have std <= SCORE_STD_MAX (std(s) = qk^2 sqrt(D) scale)."""
    eff = 1.0 / math.sqrt(d) if scale is None else scale
    return math.sqrt(SCORE_STD_MAX / (math.sqrt(d) * eff))


@attention.strategy
def _strategy(dtype):
    from hypothesis import strategies as st

    @st.composite
    def case(draw):
        b, hkv, g = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 4]))
        sq, sk = draw(cg.dims(0, 80)), draw(cg.dims(0, 80))
        d = draw(st.sampled_from([1, 8, 16, 17, 32, 64]))
        dv = draw(st.sampled_from([d, d, 8, 24]))
        causal = draw(st.booleans())
        scale = draw(st.sampled_from([None, None, 0.05, 1.0]))
        softcap = draw(st.sampled_from([None, None, 1.0, 20.0]))
        window = draw(st.sampled_from([None, None, 1, 5, 33, 200])) if causal else None
        v_dist, qk_scale, seed = draw(cg.dists(specials=False)), draw(st.sampled_from([0.1, 1.0, 3.0])), draw(cg.seeds())
        qk_scale = min(qk_scale, _well_conditioned_qk(d, scale))
        q, k, v = _qkv(np.random.default_rng(seed), dtype, b, hkv * g, hkv, sq, sk, d, dv, qk_scale, v_dist)
        kw = {"causal": causal, "scale": scale, "softcap": softcap, "sliding_window": window}
        return Case(f"hyp-{seed}", (q, k, v), kw, ("hypothesis",))

    return case()


@attention.error_cases
def _error_cases():
    def t(*shape, dt=np.float32):
        return np.ones(shape, dt)

    q, k, v = t(1, 4, 8, 16), t(1, 2, 8, 16), t(1, 2, 8, 16)
    yield ErrorCase("attention.dtype", DTypeError, (t(1, 4, 8, 16, dt=np.int32), k, v))
    yield ErrorCase("attention.dtype_mismatch", DTypeError, (q, t(1, 2, 8, 16, dt=np.float16), v))
    yield ErrorCase("attention.dtype_mismatch", DTypeError, (q, k, t(1, 2, 8, 16, dt=np.float64)))
    yield ErrorCase("attention.rank", ShapeError, (t(4, 8, 16), k, v))
    yield ErrorCase("attention.rank", ShapeError, (q, k, t(1, 2, 8, 16, 1)))
    yield ErrorCase("attention.batch", ShapeError, (q, t(2, 2, 8, 16), t(2, 2, 8, 16)))
    yield ErrorCase("attention.gqa_ratio", ShapeError, (q, t(1, 3, 8, 16), t(1, 3, 8, 16)))
    yield ErrorCase("attention.gqa_ratio", ShapeError, (q, t(1, 0, 8, 16), t(1, 0, 8, 16)))
    yield ErrorCase("attention.gqa_ratio", ShapeError, (q, k, t(1, 4, 8, 16)))
    yield ErrorCase("attention.head_dim", ShapeError, (q, t(1, 2, 8, 32), v))
    yield ErrorCase("attention.head_dim", ShapeError, (t(1, 4, 8, 0), t(1, 2, 8, 0), v))
    yield ErrorCase("attention.kv_seq", ShapeError, (q, k, t(1, 2, 9, 16)))
    yield ErrorCase("attention.causal", ArgumentError, (q, k, v), {"causal": 1})
    yield ErrorCase("attention.scale", ArgumentError, (q, k, v), {"scale": float("inf")})
    yield ErrorCase("attention.scale", ArgumentError, (q, k, v), {"scale": "0.1"})
    yield ErrorCase("attention.scale", ArgumentError, (q, k, v), {"scale": 1e300})  # issue 15 item 3
    yield ErrorCase("attention.scale", ArgumentError, (q, k, v), {"scale": -2e4})
    for bad in (np.array([0.5]), np.array([[0.5]]), np.full(4, 0.5), [0.5]):  # a 1-element array is not a scalar
        yield ErrorCase("attention.scale", ArgumentError, (q, k, v), {"scale": bad})
    for bad in (0.0, -1.0, float("inf"), float("nan"), True, "50"):
        yield ErrorCase("attention.softcap", ArgumentError, (q, k, v), {"softcap": bad})
    for bad in (0, -3, 2.5, True, 2**31):
        yield ErrorCase("attention.sliding_window", ArgumentError, (q, k, v), {"causal": True, "sliding_window": bad})
    yield ErrorCase("attention.sliding_window", ArgumentError, (q, k, v), {"sliding_window": 4})  # not causal


@attention.shape
def _shape(q, k, v, causal, scale, softcap=None, sliding_window=None):
    return (*q.shape[:3], v.shape[3])


@attention.cost
def _cost(q, k, v, causal, scale, softcap=None, sliding_window=None):
    b, hq, sq, d = q.shape
    sk, dv = k.shape[2], v.shape[3]
    item = np.dtype(cg.np_dtype(q.dtype)).itemsize
    # (query, key) pairs that are computed: ~half when causal, ~Sq·W with a window
    pairs = int(visible_keys(sq, sk, causal, sliding_window).sum())
    out = b * hq * sq * dv
    return Cost(bytes=(q.size + k.size + v.size + out) * item, flops=2 * b * hq * pairs * (d + dv))


# --------------------------------------------------------------------------- backward

BWD = f"{NAME}_backward"


@attention.saves(("lse",), shapes=lambda q, k, v, *scalars: [tuple(q.shape[:3])])
def _saved(q, k, v, causal, scale, softcap=None, sliding_window=None):
    """Per query row, the log-sum-exp of its visible scaled scores [B, Hq, Sq] (float32): -inf for a row that
    sees no key or only -inf scores (its output is 0), NaN where a visible score is NaN or +inf."""
    b, hq, sq, d = q.shape
    sk = k.shape[2]
    lse = np.full((b, hq, sq), -np.inf)
    if sk == 0 or sq == 0:
        return (lse,)
    k = np.repeat(k, hq // k.shape[1], axis=1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    lo, hi = visible_range(sq, sk, causal, sliding_window)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for rows, keys, seen in row_blocks(lo, hi, b * hq, q, k):
            s = capped(np.einsum("bhqd,bhkd->bhqk", q[:, :, rows], k[:, :, keys]) * scale, softcap)
            s = s if seen is None else np.where(seen, s, -np.inf)
            m = s.max(axis=-1)
            m_ref = np.where(m == -np.inf, 0.0, m)
            lse[:, :, rows] = m + np.log(np.exp(s - m_ref[..., None]).sum(axis=-1))  # no key seen: -inf
    return (lse,)


@attention.backward(
    wrt=("q", "k", "v"),
    reduces=("k", "v"),
    constraints={**grad_constraints(NAME), f"{BWD}.saved": "out has the forward output's shape and q's dtype; lse is "
                 "[B, Hq, Sq] in the accumulation dtype, float32 (float64 for float64 inputs): the training forward's"},
)
def attention_backward(grad, q, k, v, out, lse, causal: bool = False, scale: float | None = None,
                       softcap: float | None = None, sliding_window: int | None = None):
    """Gradients of attention for q, k and v (FlashAttention-2's backward).

    Saves q, k, v, the output and the per-row log-sum-exp lse [B, Hq, Sq] (float32; float64 for float64 inputs),
    so the probabilities are
    recomputed block by block, P = exp(s·scale − lse), never held as Sq x Sk. With D = rowsum(dO·O),
    dP = dO V^T and dS = P (dP − D): dV = P^T dO, dQ = scale·dS K, dK = scale·dS^T Q; GQA sums dK and dV over
    each KV head's query heads. With a soft cap c, dS first takes the cap's slope 1 - tanh²(s / c) (s the
    uncapped scaled score). Only visible (query, key) pairs enter, so NaN or inf under the causal mask
    never leaks. A row that sees no key, or only -inf scores (lse = -inf), has output 0 and zero gradient,
    and its q and dO reach no dK or dV. dq accumulates over keys, dk and dv over queries and heads: all
    three are judged norm-wise, as the forward.
    """
    attention.validate(q, k, v, causal, scale, softcap, sliding_window)
    shape = (*q.shape[:3], v.shape[3])
    check_grad(BWD, grad, shape, q.dtype)
    acc = "float64" if q.dtype == "float64" else "float32"
    for arg, m, want, dtype in (("out", out, shape, q.dtype), ("lse", lse, tuple(q.shape[:3]), acc)):
        check(m is not None, ArgumentError, BWD, arg, f"{BWD}.saved", "the training forward's " + arg, None)
        check(m.dtype == dtype, DTypeError, BWD, arg, f"{BWD}.saved", dtype, m.dtype)
        check(tuple(m.shape) == want, ShapeError, BWD, arg, f"{BWD}.saved", f"{want} (the training forward's)",
              tuple(m.shape))


@attention_backward.reference
def _backward_reference(grad, q, k, v, out, lse, causal, scale, softcap=None, sliding_window=None):
    return _vjp(grad, q, k, v, out, lse, causal, scale, softcap, sliding_window, True)


def _vjp(grad, q, k, v, out, lse, causal, scale, softcap, sliding_window, slope: bool):
    """The float64 gradients; slope=False drops the soft cap's chain rule (a mutant)."""
    b, hq, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    g = hq // hkv
    dq, dk, dvv = np.zeros(q.shape), np.zeros((b, hq, sk, d)), np.zeros((b, hq, sk, dv))
    kr, vr = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    with np.errstate(invalid="ignore", over="ignore"):
        big_d = np.sum(grad * out, axis=-1)  # D = rowsum(dO·O)
        lo, hi = visible_range(sq, sk, causal, sliding_window)
        for rows, keys, seen in row_blocks(lo, hi, b * hq, grad, q, k, v):  # masked k and v never enter
            _block_grads(rows, keys, seen, grad, q, kr, vr, lse, big_d, scale, softcap, slope, dq, dk, dvv)
    return dq, dk.reshape(b, hkv, g, sk, d).sum(axis=2), dvv.reshape(b, hkv, g, sk, dv).sum(axis=2)


def _block_grads(r, n, seen, grad, q, kr, vr, lse, big_d, scale, softcap, slope, dq, dk, dv):
    """Query rows r's share of the gradients, over their keys n (slices; `seen`: which each row sees, None: all)
    (float64, in place)."""
    live = (lse[:, :, r] != -np.inf)[..., None]  # -inf: no visible finite score, output 0, no gradient
    use = live if seen is None else live & seen
    raw = np.einsum("bhqd,bhkd->bhqk", q[:, :, r], kr[:, :, n]) * scale
    s = capped(raw, softcap)
    p = np.where(use, np.exp(s - np.where(live, lse[:, :, r, None], 0.0)), 0.0)
    dp = np.einsum("bhqd,bhkd->bhqk", grad[:, :, r], vr[:, :, n])
    ds = np.where(use, p * (dp - big_d[:, :, r, None]), 0.0)
    if softcap is not None and slope:  # d(c tanh(raw / c)) / d raw = 1 - tanh²
        ds = ds * (1.0 - np.tanh(raw / softcap) ** 2)
    dq[:, :, r] = np.where(live, np.einsum("bhqk,bhkd->bhqd", ds, kr[:, :, n]) * scale, 0.0)
    # ds and p are 0 where a row is dead or blind; a dead row's q and dO zeroed too (0 * inf is NaN)
    dk[:, :, n] += np.einsum("bhqk,bhqd->bhkd", ds, np.where(live, q[:, :, r], 0.0)) * scale
    dv[:, :, n] += np.einsum("bhqk,bhqd->bhkd", p, np.where(live, grad[:, :, r], 0.0))


@attention_backward.error_cases
def _backward_error_cases():
    from opport.errors import DTypeError

    q, k, v = np.ones((1, 4, 8, 16), np.float32), np.ones((1, 2, 8, 16), np.float32), np.ones((1, 2, 8, 16), np.float32)
    o, lse = np.ones((1, 4, 8, 16), np.float32), np.zeros((1, 4, 8), np.float32)
    yield ErrorCase(f"{BWD}.grad_shape", ShapeError, (np.ones((1, 4, 8, 8), np.float32), q, k, v, o, lse))
    yield ErrorCase(f"{BWD}.grad_dtype", DTypeError, (o.astype(np.float16), q, k, v, o, lse))
    yield ErrorCase(f"{BWD}.saved", ShapeError, (o, q, k, v, np.ones((1, 4, 7, 16), np.float32), lse))
    yield ErrorCase(f"{BWD}.saved", DTypeError, (o, q, k, v, o.astype(np.float16), lse))
    yield ErrorCase(f"{BWD}.saved", ShapeError, (o, q, k, v, o, np.zeros((1, 2, 8), np.float32)))
    yield ErrorCase(f"{BWD}.saved", DTypeError, (o, q, k, v, o, lse.astype(np.float64)))


@attention_backward.cost
def _backward_cost(grad, q, k, v, out, lse, causal, scale, softcap=None, sliding_window=None):
    fwd = _cost(q, k, v, causal, scale, softcap, sliding_window)
    item = np.dtype(cg.np_dtype(q.dtype)).itemsize
    # read q, k, v, out, dO and lse; write dq, dk, dv. FLOPs: five matmuls over the visible pairs (s, dP, dV, dQ,
    # dK) against the forward's two: 2.5x, as FlashAttention-2 counts
    return Cost(bytes=(2 * (q.size + k.size + v.size) + 2 * out.size) * item + 4 * lse.size, flops=int(2.5 * fwd.flops))


def _grad_case(name: str, dtype: str, forward: Case, grad=None, tags=("edge",)) -> Case:
    """The backward case of `forward` (its output and lse from the float64 reference) with `grad` (float64 values)."""
    (shape, _), = attention.out_metas(attention.bind(*forward.args, **forward.kwargs))
    g = cg.array(shape, "float64", cg.rng_for(BWD, name, dtype)) if grad is None else grad
    case = attention_backward.from_forward(forward, dtype, grad=cg.cast(g, dtype))
    return Case(name, case.args, case.kwargs, tags)


def _with(case: Case, name: str, **arrays) -> Case:
    """`case` with some of q, k, v replaced."""
    q, k, v = (arrays.get(n, a) for n, a in zip("qkv", case.args))
    return Case(name, (q, k, v), case.kwargs, case.tags)


@attention_backward.cases
def _backward_cases(dtype):
    """Edge cases for the gradients beside those derived from the forward's (random upstream gradients)."""
    nan = cg.cast(np.nan, dtype)
    # causal, Sq > Sk: rows 0..9 see no key; NaN in their q and dO must not reach dk or dv, which stay finite
    dead = _case("dead-rows", dtype, 1, 2, 1, 30, 20, 32, causal=True)
    q = dead.args[0].copy()
    q[:, :, :10] = nan
    g = cg.array((1, 2, 30, 32), "float64", cg.rng_for(BWD, "dead-rows", dtype))
    g[:, :, :10:3] = np.nan
    yield _grad_case("dead-rows-nonfinite", dtype, _with(dead, "dead-rows", q=q), g)
    # a live row's NaN (in dO; in q) reaches dk and dv of the keys it sees, not of the keys masked from it
    live = _case("live-nan", dtype, 1, 2, 1, 40, 40, 32, causal=True)
    g = cg.array((1, 2, 40, 32), "float64", cg.rng_for(BWD, "live-nan", dtype))
    g[0, 1, 17, 3] = np.nan
    yield _grad_case("nan-grad-row-causal", dtype, live, g)
    q = live.args[0].copy()
    q[0, 1, 25, 0] = nan
    yield _grad_case("nan-q-row-causal", dtype, _with(live, "live-nan", q=q))
    # a row whose visible scores are all -inf (q = +inf·e0, every k[..., 0] < 0): output 0, zero gradient
    neg = _case("neg-inf-scores", dtype, 1, 2, 2, 6, 9, 16)
    q, k = neg.args[0].copy(), neg.args[1].copy()
    q[0, 1, 2] = 0
    q[0, 1, 2, 0] = cg.cast(np.inf, dtype)
    k[0, 1, :, 0] = -np.abs(k[0, 1, :, 0]) - cg.cast(0.5, dtype)
    yield _grad_case("neg-inf-scores-row", dtype, _with(neg, "neg-inf-scores", q=q, k=k))
    # one visible key: P = 1, so dq = dk = 0 exactly; dP - D cancels eps·|dO||v| in float32 (Hypothesis found it)
    one = _case("one-key", dtype, 1, 2, 1, 5, 1, 16)
    big_v = cg.cast(one.args[2].astype(np.float64) * (300.0 if dtype == "float16" else 1e4), dtype)
    yield _grad_case("one-key-large-v", dtype, _with(one, "one-key", v=big_v))
    yield _grad_case("zero-grad", dtype, _case("zero-grad", dtype, 1, 4, 2, 17, 23, 32, causal=True),
                     np.zeros((1, 4, 17, 32)))
    big = 501.0 if dtype == "float16" else 4988429.2
    yield _grad_case("large-grad", dtype, _case("large-grad", dtype, 1, 2, 1, 33, 33, 32, causal=True),
                     cg.rng_for(BWD, "large-grad", dtype).standard_normal((1, 2, 33, 32)) * big)
    gqa = _grad_case("strided-grad", dtype, _case("strided-grad", dtype, 2, 4, 2, 19, 19, 16, causal=True), tags=())
    gt = np.ascontiguousarray(gqa.args[0].transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # [B, S, H, D] memory
    yield Case("strided-grad", (gt, *gqa.args[1:]), gqa.kwargs, ())


@attention_backward.mutant("dq-unscaled")
def _mutant_dq_unscaled(grad, q, k, v, out, lse, causal, scale, softcap=None, sliding_window=None):
    """dq without the softmax scale (dS K instead of scale dS K)."""
    dq, dk, dv = _backward_reference(grad, q, k, v, out, lse, causal, scale, softcap, sliding_window)
    return dq / (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale), dk, dv


@attention_backward.mutant("dkv-of-first-head")
def _mutant_dkv_not_summed(grad, q, k, v, out, lse, causal, scale, softcap=None, sliding_window=None):
    """GQA: dk and dv from each group's first query head only, not summed over the group."""
    dq, dk, dv = _backward_reference(grad, q, k, v, out, lse, causal, scale, softcap, sliding_window)
    g = q.shape[1] // k.shape[1]
    if g == 1:
        return dq, dk, dv * 0.5  # no group: a half-summed dv instead
    first = slice(0, None, g)
    _, dk1, dv1 = _backward_reference(grad[:, first], q[:, first], k, v, out[:, first], lse[:, first], causal, scale,
                                      softcap, sliding_window)
    return dq, dk1, dv1


@attention_backward.mutant("dropped-rowsum-term")
def _mutant_dropped_d(grad, q, k, v, out, lse, causal, scale, softcap=None, sliding_window=None):
    """dS = P dP without the - P D term (D = rowsum(dO * O))."""
    return _backward_reference(grad, q, k, v, np.zeros_like(out), lse, causal, scale, softcap, sliding_window)


@attention_backward.mutant("softcap-slope-dropped")
def _mutant_softcap_slope(grad, q, k, v, out, lse, causal, scale, softcap=None, sliding_window=None):
    """A soft cap's backward without the chain rule through tanh (dS used as if the cap were the identity)."""
    return _vjp(grad, q, k, v, out, lse, causal, scale, softcap, sliding_window, False)
