"""topk_router in Triton: one program per block of token rows, k passes of an exact argmax (lowest index on ties)."""

import torch

from opport.backends.cuda._launch import (
    INTERPRET,
    ROW_MAX,
    cdiv,
    exp_f32,
    f32,
    narrow,
    next_pow2,
    tile_elements,
    tl,
    triton,
    warps_for,
)
from opport.dispatch import impl
from opport.ops.topk_router import topk_router as spec

NAN_RANK = tl.constexpr(0x7FFFFFFF)  # every NaN's rank: above +inf's (0x7F800000)
TAKEN = tl.constexpr(-9223372036854775807 - 1)  # INT64_MIN: below every combined key; padding and chosen experts
MAX_EXPERTS = ROW_MAX  # a row of experts in registers (16K); the combined key's low 16 bits hold 0xFFFF - expert


@triton.jit
def _rank(key):
    """float32 keys as int32 ranks of the same order: the bits of a non-negative float, a negative one's magnitude
    bits flipped; -0 ranks as +0 and every NaN above every number (torch.topk's rule). Integer compares are exact:
    the argmax below cannot be swayed by NaN semantics of float max."""
    key = tl.where(key == 0.0, 0.0, key)
    b = key.to(tl.int32, bitcast=True)
    return tl.where(key != key, NAN_RANK, tl.where(b >= 0, b, b ^ 0x7FFFFFFF))


@triton.jit
def _sigmoid(x, PRECISE: tl.constexpr):
    """float32 sigmoid exponentiating only -|x| (libdevice's expf where PRECISE: float32 weights' tolerance)."""
    e = exp_f32(-tl.abs(x), PRECISE)
    return tl.where(x >= 0, 1.0, e) / (1.0 + e)


@triton.jit
def _topk_router_kernel(
    # pointers
    logits_ptr, bias_ptr, w_ptr, idx_ptr,
    # shapes, strides
    n_rows, n_exp, k, l_st, l_se, b_s, w_st, w_sk, i_st, i_sk,
    # meta-parameters
    SIGMOID: tl.constexpr, BIAS: tl.constexpr, RENORM: tl.constexpr, PRECISE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Each row's k best experts (weights, int32 indices), best first, for BLOCK_T rows of E logits.

    Dimensions: logits [T, E], bias [E] (float32), weights and indices [T, k]; all strided.
    Args: SIGMOID: sigmoid scoring (else softmax); BIAS: a bias enters the sigmoid ranking; RENORM: weights divided by
    their sum; PRECISE: libdevice's expf (float32 logits).
    Returns: nothing; weights and indices are written.
    Notes: the ranking key is the logit itself (softmax and unbiased sigmoid: their scores are increasing in it, so
    the order is exact whatever the rounding of p) or sigmoid(x) + bias in float32. Each key becomes an int32 rank
    (_rank) and, with 0xFFFF - expert in its low bits, an int64 combined key: one max per pass then takes the
    largest rank and, among the experts holding it, the lowest index (a stable descending order, NaN first, no
    float compare involved); the winner's key is then set below all others. After the k passes the chosen logits
    are re-read at their indices (L1/L2-resident) and the weights follow the reference's formulas in float32:
    exp(x - rowmax) / rowsum (NaN rows stay NaN), or renormalized over the k chosen. Logits are read once (plus
    k per row); weights and indices written once.
    Pseudocode: key = r(e) << 16 | (0xFFFF - e); for j < k: best_j = max(key); key[best_j] = TAKEN;
        i = 0xFFFF - (best & 0xFFFF); weights = f(x[i]); store (weights, i)
    """
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    live = t < n_rows
    emask = e < n_exp
    mask = live[:, None] & emask[None, :]
    row = logits_ptr + t[:, None] * l_st
    x = f32(tl.load(row + e[None, :].to(tl.int64) * l_se, mask=mask, other=float("-inf")))
    if BIAS:
        key = _sigmoid(x, PRECISE) + tl.load(bias_ptr + e * b_s, mask=emask, other=0.0)[None, :]
    else:
        key = x
    lowbits = (0xFFFF - e).to(tl.int64)
    comb = tl.where(mask, (_rank(key).to(tl.int64) << 16) | lowbits[None, :], TAKEN)
    kk = tl.arange(0, BLOCK_K)[None, :]
    best = tl.full((BLOCK_T, BLOCK_K), TAKEN, tl.int64)
    for j in range(0, k):
        top = tl.max(comb, axis=1)[:, None]
        comb = tl.where(comb == top, TAKEN, comb)  # the combined keys are distinct: exactly the winner
        best = tl.where(kk == j, top, best)
    kmask = kk < k
    out = live[:, None] & kmask
    chosen = (0xFFFF - (best & 0xFFFF)).to(tl.int32)
    kk64 = kk.to(tl.int64)
    tl.store(idx_ptr + t[:, None] * i_st + kk64 * i_sk, chosen, mask=out)
    v = f32(tl.load(row + chosen.to(tl.int64) * l_se, mask=out, other=float("-inf")))
    if SIGMOID:
        w = _sigmoid(v, PRECISE)
    else:
        if RENORM:  # the first chosen logit is the row's max (or NaN/inf, which make the row NaN, as the reference)
            w = exp_f32(v - tl.max(v, axis=1)[:, None], PRECISE)
        else:
            m = tl.max(x, axis=1)
            w = exp_f32(v - m[:, None], PRECISE) / tl.sum(exp_f32(x - m[:, None], PRECISE), axis=1)[:, None]
    if RENORM:
        w = w / tl.sum(tl.where(kmask, w, 0.0), axis=1)[:, None]
    tl.store(w_ptr + t[:, None] * w_st + kk64 * w_sk, narrow(w, w_ptr.dtype.element_ty), mask=out)


@triton.jit
def _topk_router_backward_kernel(
    # pointers
    g_ptr, logits_ptr, idx_ptr, d_ptr,
    # shapes, strides
    n_rows, n_exp, k, g_st, g_sk, l_st, l_se, i_st, i_sk, d_st, d_se,
    # meta-parameters
    SIGMOID: tl.constexpr, RENORM: tl.constexpr, PRECISE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """dlogits for BLOCK_T rows from the upstream gradient of the weights and the forward's indices.

    Dimensions: grad_weights, indices [T, k]; logits, dlogits [T, E]; all strided.
    Args: SIGMOID, RENORM, PRECISE as in the forward.
    Returns: nothing; dlogits is written (every element: zeros off the chosen experts where the Jacobian has none).
    Notes: G (the upstream gradient scattered onto the chosen experts) is built over k passes of a compare with
    the row's expert ids, then the reference's formulas in float32 on the row tile: softmax p (G - c),
    c = sum_j g_j w_j; renormalized w (G - c) on the chosen; sigmoid s (1 - s) G, renormalized
    s (1 - s) (G - c) / S. s (1 - s) is formed as sigmoid(x) sigmoid(-x) (no cancellation for large x). Logits read
    once, dlogits written once; the choice is never redone.
    Pseudocode: G = scatter(g, idx); scores from x; c = sum(G w); d = slope (G - c) on the row; store d
    """
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    live = t < n_rows
    mask = live[:, None] & (e < n_exp)[None, :]
    e64 = e[None, :].to(tl.int64)
    x = f32(tl.load(logits_ptr + t[:, None] * l_st + e64 * l_se, mask=mask, other=float("-inf")))
    big_g = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
    chosen = tl.zeros((BLOCK_T, BLOCK_E), tl.int1)
    for j in range(0, k):
        i = tl.load(idx_ptr + t * i_st + j * i_sk, mask=live, other=-1)
        g = f32(tl.load(g_ptr + t * g_st + j * g_sk, mask=live, other=0.0))
        hit = e[None, :] == i[:, None]
        big_g = tl.where(hit, g[:, None], big_g)
        chosen = chosen | hit
    if SIGMOID:
        s = _sigmoid(x, PRECISE)
        slope = s * _sigmoid(-x, PRECISE)
        if RENORM:
            total = tl.sum(tl.where(chosen, s, 0.0), axis=1)[:, None]
            c = tl.sum(tl.where(chosen, big_g * s, 0.0), axis=1)[:, None] / total
            d = tl.where(chosen, slope * (big_g - c) / total, 0.0)
        else:
            d = tl.where(chosen, slope * big_g, 0.0)
    else:
        if RENORM:
            top = tl.max(tl.where(chosen, x, float("-inf")), axis=1)
            z = tl.where(chosen, exp_f32(x - top[:, None], PRECISE), 0.0)
            w = z / tl.sum(z, axis=1)[:, None]
            c = tl.sum(tl.where(chosen, big_g * w, 0.0), axis=1)[:, None]
            d = tl.where(chosen, w * (big_g - c), 0.0)
        else:
            m = tl.max(x, axis=1)
            z = exp_f32(x - m[:, None], PRECISE)
            p = z / tl.sum(z, axis=1)[:, None]
            c = tl.sum(tl.where(chosen, big_g * p, 0.0), axis=1)[:, None]
            d = p * (big_g - c)
    tl.store(d_ptr + t[:, None] * d_st + e64 * d_se, narrow(d, d_ptr.dtype.element_ty), mask=mask)


def _config(n_rows: int, n_exp: int, share: int = 1) -> tuple:
    """(rows per program, padded experts): whole rows of about tile_elements() / share per program (the backward
    keeps more row-sized arrays live: a quarter of the tile on a GPU, where 4K elements spilled 32 bytes and 2K still 8
    with sigmoid scoring and renormalisation)."""
    block_e = next_pow2(n_exp)
    return max(1, min(next_pow2(n_rows), tile_elements() // (1 if INTERPRET else share) // block_e)), block_e


def _supports(logits, k, renormalize, scoring, bias):
    if logits.shape[1] > MAX_EXPERTS:
        return f"E = {logits.shape[1]} experts: a row is held in registers and indexed in 16 bits (at most {MAX_EXPERTS})"
    return None


@impl(spec, "cuda", supports=_supports)
def topk_router(logits: torch.Tensor, k: int, renormalize: bool, scoring: str, bias):
    t, e = logits.shape
    weights = torch.empty((t, k), dtype=logits.dtype, device=logits.device)
    indices = torch.empty((t, k), dtype=torch.int32, device=logits.device)
    if t == 0:
        return weights, indices
    block_t, block_e = _config(t, e)
    _topk_router_kernel[(cdiv(t, block_t),)](
        logits, bias if bias is not None else logits, weights, indices, t, e, k, *logits.stride(),
        bias.stride(0) if bias is not None else 0, *weights.stride(), *indices.stride(),
        SIGMOID=scoring == "sigmoid", BIAS=bias is not None, RENORM=bool(renormalize),
        PRECISE=logits.dtype == torch.float32, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=next_pow2(k),
        num_warps=warps_for(block_t * block_e))
    return weights, indices


@impl(spec.backward_op, "cuda", supports=lambda grad_weights, logits, indices, k, renormalize, scoring:
      _supports(logits, k, renormalize, scoring, None))
def topk_router_backward(grad_weights: torch.Tensor, logits: torch.Tensor, indices: torch.Tensor, k: int,
                         renormalize: bool, scoring: str):
    t, e = logits.shape
    d = torch.empty((t, e), dtype=logits.dtype, device=logits.device)
    if t == 0:
        return (d,)
    block_t, block_e = _config(t, e, share=4)
    _topk_router_backward_kernel[(cdiv(t, block_t),)](
        grad_weights, logits, indices, d, t, e, k, *grad_weights.stride(), *logits.stride(), *indices.stride(),
        *d.stride(), SIGMOID=scoring == "sigmoid", RENORM=bool(renormalize), PRECISE=logits.dtype == torch.float32,
        BLOCK_T=block_t, BLOCK_E=block_e, num_warps=warps_for(2 * block_t * block_e))
    return (d,)
