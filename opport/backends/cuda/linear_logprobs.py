"""linear_logprobs in Triton: linear_cross_entropy's logit tiles (matmul's K loop, bias, softcap) scaled by 1/T and
folded into an online logsumexp plus the entropy's running sum; never written to memory.

Forward: one program per BLOCK_M tokens and vocabulary split (as linear_cross_entropy's, the same splits) carries
the row max m, s = sum exp(z - m), u = sum exp(z - m) (z - m) and the target's logit; a second kernel combines the
splits in order: logp = (z_t - m) - log s, entropy = log s - u / s (terms of the order of log V: no cancellation of
lse against the mean logit). Backward: linear_cross_entropy's chunk loop (a float32 dlogits chunk buffer, its two
GEMMs and the column sum), with dlogits = (-p (g_logp + g_entropy (z - lse + H)) + g_logp onehot) (1 - tanh²) / T.
Deterministic: fixed tiles and orders, no atomics.
"""

import torch

from opport.backends.cuda._launch import cdiv, exp_f32, log_f32, narrow, next_pow2, tl, triton
from opport.backends.cuda.cross_entropy import _target_term
from opport.backends.cuda.linear_cross_entropy import (
    _logit_tile,
    _precision,
    _strides,
    head_gradients,
    vocabulary_splits,
)
from opport.dispatch import impl
from opport.ops.linear_logprobs import linear_logprobs as spec


@triton.jit
def _llp_partial_kernel(
    h_ptr, w_ptr, b_ptr, t_ptr, part_ptr,
    N, V, H, h_s0, h_s1, w_s0, w_s1, b_s, t_s, split_cols, softcap, inv_t,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One split of the vocabulary for BLOCK_M rows: m, s, u and the target's tempered logit, written to
    part [4, splits, N] (program (row block, split)).

    Dimensions: hidden [N, H], weight [V, H], bias [V], target [N] (all strided); split p covers columns
    [p * split_cols, (p + 1) * split_cols).
    Notes: z = cap(a) / T per tile in registers; a new max m' rescales s by e = exp(m - m') and u to
    (u + (m - m') s) e, then adds the tile's sum of exp(z - m') and exp(z - m') (z - m'). Columns past the split
    are -inf (exp 0, and their (z - m') never multiplied in: masked).
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    v_lo = tl.program_id(1) * split_cols
    v_hi = tl.minimum(v_lo + split_cols, V)
    t = tl.load(t_ptr + rows.to(tl.int64) * t_s, mask=row_ok, other=0).to(tl.int64)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_M,), tl.float32)
    u = tl.zeros((BLOCK_M,), tl.float32)
    z_t = tl.zeros((BLOCK_M,), tl.float32)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        a, _th = _logit_tile(h_ptr, w_ptr, b_ptr, rows, cols, N, V, H, h_s0, h_s1, w_s0, w_s1, b_s, softcap,
                             HAS_BIAS, SOFTCAP, PRECISION, BLOCK_M, BLOCK_V, BLOCK_K)
        z = a * inv_t
        col_ok = (cols < v_hi)[None, :]
        zm = tl.where(col_ok, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(zm, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        scale = tl.exp(m - m_safe)
        shift = tl.where(s == 0.0, 0.0, (m - m_safe) * s)
        w = tl.where(col_ok, z - m_safe[:, None], 0.0)
        e = tl.where(col_ok, tl.exp(w), 0.0)
        u = (u + shift) * scale + tl.sum(e * w, 1)
        s = s * scale + tl.sum(e, 1)
        m = m_new
        z_t += tl.sum(tl.where(col_ok & (cols[None, :] == t[:, None]), z, 0.0), 1)
    part = part_ptr + tl.program_id(1).to(tl.int64) * N + rows
    stride = tl.num_programs(1).to(tl.int64) * N
    tl.store(part, m, mask=row_ok)
    tl.store(part + stride, s, mask=row_ok)
    tl.store(part + 2 * stride, u, mask=row_ok)
    tl.store(part + 3 * stride, z_t, mask=row_ok)


@triton.jit
def _llp_combine_kernel(
    part_ptr, t_ptr, logp_ptr, ent_ptr, lse_ptr, N, V, splits, stride, t_s, ignore_index,
    STORE_LSE: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """logp = (z_t - m) - log s and entropy = log s - u / s from the splits' partials, rescaled to the global max in
    split order (deterministic); ignored rows 0, a target outside [0, V) a NaN logp. STORE_LSE: also m + log s."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_M,), tl.float32)
    u = tl.zeros((BLOCK_M,), tl.float32)
    z_t = tl.zeros((BLOCK_M,), tl.float32)
    for p in range(0, splits):
        part = part_ptr + p * N + rows
        m_p = tl.load(part, mask=row_ok, other=float("-inf"))
        s_p = tl.load(part + stride, mask=row_ok, other=0.0)
        u_p = tl.load(part + 2 * stride, mask=row_ok, other=0.0)
        m_new = tl.maximum(m, m_p)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        e_old, e_p = tl.exp(m - m_safe), tl.exp(m_p - m_safe)
        u = tl.where(s == 0.0, 0.0, (u + (m - m_safe) * s) * e_old) \
            + tl.where(s_p == 0.0, 0.0, (u_p + (m_p - m_safe) * s_p) * e_p)
        s = s * e_old + s_p * e_p
        m = m_new
        z_t += tl.load(part + 3 * stride, mask=row_ok, other=0.0)
    t = tl.load(t_ptr + rows.to(tl.int64) * t_s, mask=row_ok, other=0).to(tl.int64)
    log_s = log_f32(s)
    ignored = t == ignore_index
    logp = tl.where(ignored, 0.0, tl.where((t >= 0) & (t < V), (z_t - m) - log_s, float("nan")))
    tl.store(logp_ptr + rows, logp, mask=row_ok)
    tl.store(ent_ptr + rows, tl.where(ignored, 0.0, log_s - u / s), mask=row_ok)
    if STORE_LSE:
        tl.store(lse_ptr + rows, m + log_s, mask=row_ok)


@triton.jit
def _llp_dlogits_kernel(
    gl_ptr, ge_ptr, h_ptr, w_ptr, b_ptr, t_ptr, lse_ptr, ent_ptr, d_ptr,
    N, V, H, c0, C, h_s0, h_s1, w_s0, w_s1, b_s, t_s, gl_s, ge_s, lse_s, ent_s, d_s0,
    ignore_index, softcap, inv_t,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, PRECISE: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """d[r, j] = (-p (g_l + g_e (zl + H)) + g_l [c0 + j == t]) (1 - tanh²) / T, zl = z - lse, for one tile of a chunk.

    Dimensions: the chunk is vocabulary columns [c0, c0 + C); d [N, >= C] row stride d_s0; grads, lse, H [N].
    Notes: the target entry's 1 - p_t through cross_entropy's `_target_term` (expm1 where p_t > 1/2); ignored
    rows exactly 0, targets outside [0, V) NaN; libdevice exp for float32 (PRECISE).
    """
    pid = tl.program_id(0)
    tiles_v = tl.cdiv(C, BLOCK_V)
    rows = (pid // tiles_v) * BLOCK_M + tl.arange(0, BLOCK_M)
    local = (pid % tiles_v) * BLOCK_V + tl.arange(0, BLOCK_V)
    cols = c0 + local
    row_ok = rows < N
    r64 = rows.to(tl.int64)
    t = tl.load(t_ptr + r64 * t_s, mask=row_ok, other=0).to(tl.int64)
    lse = tl.load(lse_ptr + r64 * lse_s, mask=row_ok, other=0.0)
    ent = tl.load(ent_ptr + r64 * ent_s, mask=row_ok, other=0.0)
    ignored = t == ignore_index
    g_l = tl.load(gl_ptr + r64 * gl_s, mask=row_ok, other=0.0)
    g_l = tl.where((t >= 0) & (t < V), g_l, float("nan"))
    g_e = tl.load(ge_ptr + r64 * ge_s, mask=row_ok, other=0.0)
    a, th = _logit_tile(h_ptr, w_ptr, b_ptr, rows, cols, N, V, H, h_s0, h_s1, w_s0, w_s1, b_s, softcap,
                        HAS_BIAS, SOFTCAP, PRECISION, BLOCK_M, BLOCK_V, BLOCK_K)
    zl = a * inv_t - lse[:, None]
    p = exp_f32(zl, PRECISE)
    y = -p * (g_l[:, None] + g_e[:, None] * (zl + ent[:, None]))
    at_t = -g_l[:, None] * _target_term(zl, 0.0, V, PRECISE) - g_e[:, None] * p * (zl + ent[:, None])
    y = tl.where(cols[None, :] == t[:, None], at_t, y)
    y = tl.where(ignored[:, None], 0.0, y)  # ignored: exactly 0 even where z is NaN
    if SOFTCAP:
        y = y * (1.0 - th * th)
    y = y * inv_t
    mask = row_ok[:, None] & (local < C)[None, :]
    tl.store(d_ptr + r64[:, None] * d_s0 + local[None, :], narrow(y, d_ptr.dtype.element_ty), mask=mask)


@impl(spec, "cuda")
def linear_logprobs(hidden, weight, target, bias, temperature, softcap, ignore_index):
    return _forward(hidden, weight, target, bias, temperature, softcap, ignore_index, None)


@impl(spec.train_forward, "cuda")
def linear_logprobs_forward(hidden, weight, target, bias, temperature, softcap, ignore_index):
    """The forward plus each row's logsumexp [N] (float32), written by the same programs."""
    lse = torch.empty((hidden.shape[0],), dtype=torch.float32, device=hidden.device)
    return (*_forward(hidden, weight, target, bias, temperature, softcap, ignore_index, lse), lse)


def _forward(hidden, weight, target, bias, temperature, softcap, ignore_index, lse) -> tuple:
    (n, h), v = hidden.shape, weight.shape[0]
    dev = hidden.device
    logp = torch.empty((n,), dtype=torch.float32, device=dev)
    ent = torch.empty((n,), dtype=torch.float32, device=dev)
    if n == 0:
        return logp, ent
    cfg, row_blocks, splits, split_cols = vocabulary_splits(n, v, h, hidden.dtype, hidden.device)
    part = torch.empty((4, splits, n), dtype=torch.float32, device=dev)
    _llp_partial_kernel[(row_blocks, splits)](
        hidden, weight, hidden if bias is None else bias, target, part, n, v, h,
        *_strides(hidden, weight, target, bias), split_cols, float(softcap or 1.0), 1.0 / float(temperature),
        HAS_BIAS=bias is not None, SOFTCAP=softcap is not None, PRECISION=_precision(hidden.dtype), **cfg)
    block = min(next_pow2(n), 1024)
    _llp_combine_kernel[(cdiv(n, block),)](
        part, target, logp, ent, logp if lse is None else lse, n, v, splits, splits * n, target.stride(0),
        int(ignore_index), STORE_LSE=lse is not None, BLOCK_M=block, num_warps=4)
    return logp, ent


@impl(spec.backward_op, "cuda")
def linear_logprobs_backward(grad_logps, grad_entropy, hidden, weight, target, entropy, lse, bias, temperature,
                             softcap, ignore_index):
    """dhidden, dweight, dbias chunk by chunk of the vocabulary (linear_cross_entropy's `head_gradients`)."""

    def dlogits(buf, c0, c, cfg):
        (n, h), v = hidden.shape, weight.shape[0]
        _llp_dlogits_kernel[(cdiv(n, cfg["BLOCK_M"]) * cdiv(c, cfg["BLOCK_V"]),)](
            grad_logps, grad_entropy, hidden, weight, hidden if bias is None else bias, target, lse, entropy, buf,
            n, v, h, c0, c, *_strides(hidden, weight, target, bias), grad_logps.stride(0), grad_entropy.stride(0),
            lse.stride(0), entropy.stride(0), buf.stride(0), int(ignore_index), float(softcap or 1.0),
            1.0 / float(temperature), HAS_BIAS=bias is not None, SOFTCAP=softcap is not None,
            PRECISE=hidden.dtype == torch.float32, PRECISION=_precision(hidden.dtype), **cfg)

    return head_gradients(hidden, weight, bias, dlogits)
