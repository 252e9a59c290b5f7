"""linear_cross_entropy in Triton: logits made tile by tile with matmul's K loop, never written to memory.

Forward: one program per BLOCK_M tokens and vocabulary split walks its split in BLOCK_V tiles; each tile
of logits is `_k_loop` (matmul's GEMM inner loop, float32 accumulation over H) plus the bias and softcap,
folded at once into the rows' online logsumexp, target logit and logit sum; a second small kernel combines
the splits' partials (in order) into the loss. Splits: about 2 programs per SM over row blocks x splits (N
8192: 128 row blocks x 3 splits; N 1024: 16 x 17). Extra memory: the partials [4, splits, N] and lse [N].
Backward, per vocabulary chunk of CHUNK_ELEMENTS / N columns (host loop, chunks in order):
  1. `_lce_dlogits_kernel`: the chunk's logits recomputed by the same tiles, turned into
     dlogits = c (p - eps/V - (1 - eps) onehot) (1 - tanh²), written to a float32 chunk buffer [N, chunk] (the only
     N x something buffer: 2^25 elements at most, 128 MiB, vs 2 GiB of bfloat16 logits at N 8192, V 128256);
  2. dhidden += dlogits @ weight[chunk] (`_gemm_kernel`, ACCUMULATE: float32 accumulator [N, H], the output
     itself for float32 inputs);
  3. dweight[chunk] = dlogits^T @ hidden (`_gemm_kernel`, rounded once: each chunk owns its rows);
  4. dbias[chunk] = column sums of dlogits (matmul's two-stage column sum).
The buffer is float32, not the inputs' 16-bit dtype: dlogits rounded to bfloat16 before the GEMMs put the
gradients' RMSE at 10-20x that of a single rounding (measured in the interpreter). With 16-bit inputs the two
GEMMs run as TF32 dots (the 16-bit operand is exact in TF32; dlogits rounds to 2^-11, below the bf16/fp16 output's
own rounding); float32 inputs use IEEE FMA throughout, never TF32.
Deterministic: fixed tiles and chunk order, no atomics (as the other cuda backward kernels).
"""

import torch

from opport.backends.cuda._launch import (
    INTERPRET,
    INTERPRETED,
    cdiv,
    exp_f32,
    f32,
    libdevice,
    log_f32,
    narrow,
    next_pow2,
    sm_count,
    tl,
    triton,
)
from opport.backends.cuda.cross_entropy import _target_term
from opport.backends.cuda.matmul import _column_sum, _k_loop
from opport.dispatch import impl
from opport.ops.linear_cross_entropy import linear_cross_entropy as spec

CHUNK_ELEMENTS = (1 << 12) if INTERPRET else (1 << 25)  # dlogits buffer; small in the interpreter: several chunks
# forward programs per SM: the vocabulary is split so that few tokens (N 1024: 16 row blocks) still fill the GPU;
# in the interpreter 2 programs in all, so that single-row-block cases run two splits and their combination
SPLIT_TARGET = 2


@triton.jit
def _tanh(u):
    """float32 tanh: libdevice's on a GPU; (1 - e) / (1 + e), e = exp(-2|u|), signed, in the interpreter."""
    if INTERPRETED:
        e = tl.exp(-2.0 * tl.abs(u))
        r = (1.0 - e) / (1.0 + e)
        return tl.where(u < 0, -r, r)
    else:
        return libdevice.tanh(u)


@triton.jit
def _logit_tile(h_ptr, w_ptr, b_ptr, rows, cols, N, V, H, h_s0, h_s1, w_s0, w_s1, b_s, softcap,
                HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """(z, tanh(logits / softcap) or 0): the float32 logits hidden[rows] @ weight[cols]^T + bias[cols], softcapped.

    weight [V, H] is read as the GEMM's b = weight^T [H, V] through its strides (no transpose copy).
    """
    acc = tl.zeros((BLOCK_M, BLOCK_V), tl.float32)
    acc = _k_loop(acc, h_ptr, w_ptr, h_s0, h_s1, w_s1, w_s0, rows, cols, N, V, H, PRECISION, BLOCK_K)
    if HAS_BIAS:
        acc += f32(tl.load(b_ptr + cols.to(tl.int64) * b_s, mask=cols < V, other=0.0))[None, :]
    th = tl.zeros((BLOCK_M, BLOCK_V), tl.float32)
    if SOFTCAP:
        th = _tanh(acc / softcap)
        acc = softcap * th
    return acc, th


@triton.jit
def _lce_partial_kernel(
    # pointers
    h_ptr, w_ptr, b_ptr, t_ptr, part_ptr,
    # shapes, strides
    N, V, H, h_s0, h_s1, w_s0, w_s1, b_s, t_s, split_cols, softcap,
    # meta-parameters
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One split of the vocabulary for BLOCK_M rows: its running max m, sum s of exp(z - m), target logit and logit
    sum, written to part [4, splits, N] (program (row block, split)).

    Dimensions: hidden [N, H], weight [V, H], bias [V], target [N] (all strided); split p covers vocabulary
    columns [p * split_cols, (p + 1) * split_cols) (a multiple of BLOCK_V).
    Notes: each BLOCK_V tile of logits (`_logit_tile`: matmul's K loop, bias, softcap) lives only in registers:
    its max and exp-sum update (m, s) (rescaled by exp(m_old - m_new)); the target's logit is picked by a column
    compare (0 where the target lies in another split); columns past the split are -inf / 0. exp is the fast
    path, as cross_entropy's forward (its ~2e-6 relative error moves log(s) far inside the loss tolerance).
    Pseudocode: for v0 in split: z = hidden[rows] @ weight[v0:v0+BV]^T; m, s = online(m, s, z); z_t += z[t]
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    v_lo = tl.program_id(1) * split_cols
    v_hi = tl.minimum(v_lo + split_cols, V)
    t = tl.load(t_ptr + rows.to(tl.int64) * t_s, mask=row_ok, other=0).to(tl.int64)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_M,), tl.float32)
    z_t = tl.zeros((BLOCK_M,), tl.float32)
    z_sum = tl.zeros((BLOCK_M,), tl.float32)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        z, _th = _logit_tile(h_ptr, w_ptr, b_ptr, rows, cols, N, V, H, h_s0, h_s1, w_s0, w_s1, b_s, softcap,
                             HAS_BIAS, SOFTCAP, PRECISION, BLOCK_M, BLOCK_V, BLOCK_K)
        col_ok = (cols < v_hi)[None, :]
        zm = tl.where(col_ok, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(zm, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(zm - m_safe[:, None]), 1)
        m = m_new
        z_t += tl.sum(tl.where(col_ok & (cols[None, :] == t[:, None]), z, 0.0), 1)
        z_sum += tl.sum(tl.where(col_ok, z, 0.0), 1)
    part = part_ptr + tl.program_id(1).to(tl.int64) * N + rows
    stride = tl.num_programs(1).to(tl.int64) * N
    tl.store(part, m, mask=row_ok)
    tl.store(part + stride, s, mask=row_ok)
    tl.store(part + 2 * stride, z_t, mask=row_ok)
    tl.store(part + 3 * stride, z_sum, mask=row_ok)


@triton.jit
def _lce_combine_kernel(
    part_ptr, t_ptr, loss_ptr, lse_ptr, N, V, splits, stride, t_s, ignore_index, smoothing,
    SMOOTH: tl.constexpr, STORE_LSE: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """loss[r] = (m - z[t]) + log(s) from the splits' partials, in split order (deterministic), smoothed as
    cross_entropy: (1 - eps) loss + eps ((m - sum(z) / V) + log(s)); ignored rows 0, targets outside [0, V) NaN.

    Dimensions: part [4, splits, N] float32 (m, s, z_t, sum z per split; stride = splits * N); loss, lse [N] float32.
    Notes: the partial sums are rescaled to the global max as the online logsumexp does; STORE_LSE (the training
    forward) also writes m + log(s).
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_M,), tl.float32)
    z_t = tl.zeros((BLOCK_M,), tl.float32)
    z_sum = tl.zeros((BLOCK_M,), tl.float32)
    for p in range(0, splits):
        part = part_ptr + p * N + rows
        m_p = tl.load(part, mask=row_ok, other=float("-inf"))
        m_new = tl.maximum(m, m_p)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.load(part + stride, mask=row_ok, other=0.0) * tl.exp(m_p - m_safe)
        m = m_new
        z_t += tl.load(part + 2 * stride, mask=row_ok, other=0.0)
        z_sum += tl.load(part + 3 * stride, mask=row_ok, other=0.0)
    t = tl.load(t_ptr + rows.to(tl.int64) * t_s, mask=row_ok, other=0).to(tl.int64)
    log_s = log_f32(s)
    loss = (m - z_t) + log_s
    if SMOOTH:
        loss = (1.0 - smoothing) * loss + smoothing * ((m - z_sum / V) + log_s)
    loss = tl.where(t == ignore_index, 0.0, tl.where((t >= 0) & (t < V), loss, float("nan")))
    tl.store(loss_ptr + rows, loss, mask=row_ok)
    if STORE_LSE:
        tl.store(lse_ptr + rows, m + log_s, mask=row_ok)


@triton.jit
def _lce_dlogits_kernel(
    # pointers
    grad_ptr, h_ptr, w_ptr, b_ptr, t_ptr, lse_ptr, kept_ptr, d_ptr,
    # shapes, strides
    N, V, H, c0, C, h_s0, h_s1, w_s0, w_s1, b_s, t_s, g_s, lse_s, d_s0,
    ignore_index, smoothing, softcap,
    # meta-parameters
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, MEAN: tl.constexpr, PRECISE: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """d[r, j] = coef[r] (exp(z - lse[r]) - eps/V - (1 - eps) [c0 + j == t[r]]) (1 - tanh²) for one tile of a chunk.

    Dimensions: the chunk is vocabulary columns [c0, c0 + C); d [N, >= C] row stride d_s0; grad [N] (g_s 1) or
    0-d (g_s 0); kept: the device count of non-ignored rows ("mean").
    Notes: z is the forward's tile (same K loop, bias, softcap); coef and the target term are
    cross_entropy's backward (its `_target_term`: expm1 where p_t > 1/2); ignored rows exactly 0, targets
    outside [0, V) NaN; libdevice exp for float32 (PRECISE), the fast exp under a 16-bit buffer.
    """
    pid = tl.program_id(0)
    tiles_v = tl.cdiv(C, BLOCK_V)
    rows = (pid // tiles_v) * BLOCK_M + tl.arange(0, BLOCK_M)
    local = (pid % tiles_v) * BLOCK_V + tl.arange(0, BLOCK_V)
    cols = c0 + local
    row_ok = rows < N
    t = tl.load(t_ptr + rows.to(tl.int64) * t_s, mask=row_ok, other=0).to(tl.int64)
    lse = tl.load(lse_ptr + rows.to(tl.int64) * lse_s, mask=row_ok, other=0.0)
    ignored = t == ignore_index
    coef = tl.load(grad_ptr + rows.to(tl.int64) * g_s, mask=row_ok, other=0.0)
    if MEAN:
        coef = coef / tl.maximum(tl.load(kept_ptr), 1).to(tl.float32)
    coef = tl.where(ignored, 0.0, tl.where((t >= 0) & (t < V), coef, float("nan")))
    z, th = _logit_tile(h_ptr, w_ptr, b_ptr, rows, cols, N, V, H, h_s0, h_s1, w_s0, w_s1, b_s, softcap,
                        HAS_BIAS, SOFTCAP, PRECISION, BLOCK_M, BLOCK_V, BLOCK_K)
    zl = z - lse[:, None]
    y = exp_f32(zl, PRECISE) - smoothing / V
    y = tl.where(cols[None, :] == t[:, None], _target_term(zl, smoothing, V, PRECISE), y)
    y = tl.where(ignored[:, None], 0.0, coef[:, None] * y)  # ignored: exactly 0 even where z is NaN
    if SOFTCAP:
        y = y * (1.0 - th * th)
    mask = row_ok[:, None] & (local < C)[None, :]
    tl.store(d_ptr + rows.to(tl.int64)[:, None] * d_s0 + local[None, :], narrow(y, d_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemm_kernel(
    a_ptr, b_ptr, out_ptr, M, N, K, a_sm, a_sk, b_sk, b_sn, o_sm, o_sn,
    ACCUMULATE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out (+)= a @ b for one [BLOCK_M, BLOCK_N] tile, float32 accumulation, rounded once to out's dtype.

    Dimensions: a [M, K] float32 (the dlogits chunk), b [K, N] in the inputs' dtype, out [M, N], all strided.
    Notes: matmul's K loop with both operands widened to float32 (tl.dot takes one dtype): TF32 dots for 16-bit
    inputs, IEEE for float32 (PRECISION). ACCUMULATE adds out's float32 values (the dhidden accumulator).
    """
    tiles_n = tl.cdiv(N, BLOCK_N)
    offs_m = (tl.program_id(0) // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (tl.program_id(0) % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * a_sm + offs_k.to(tl.int64)[None, :] * a_sk
    b_ptrs = b_ptr + offs_k.to(tl.int64)[:, None] * b_sk + offs_n.to(tl.int64)[None, :] * b_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < K - k), other=0.0)
        b = f32(tl.load(b_ptrs, mask=(offs_k[:, None] < K - k) & (offs_n[None, :] < N), other=0.0))
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * a_sk
        b_ptrs += BLOCK_K * b_sk
    ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * o_sm + offs_n.to(tl.int64)[None, :] * o_sn
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if ACCUMULATE:
        acc += tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, narrow(acc, out_ptr.dtype.element_ty), mask=mask)


def _fit(n: int, cap: int) -> int:
    """The smallest power of two >= n, between 16 (tl.dot's minimum) and cap."""
    return max(16, min(cap, next_pow2(n)))


def _config(n: int, v: int, h: int, dtype: torch.dtype) -> dict:
    """Logit tiles. GPU numbers are design choices for Hopper (wgmma 64 x 128 bf16 tiles), not tuned on hardware."""
    if INTERPRET:  # few, large programs: each tl.dot is one NumPy matmul
        return {"BLOCK_M": _fit(n, 64), "BLOCK_V": _fit(v, 128), "BLOCK_K": _fit(h, 128), "num_warps": 4,
                "num_stages": 1}
    # the online-logsumexp epilogue keeps several [BLOCK_M, BLOCK_V] float32 temporaries live: 64 x 64 float32 tiles
    # spilled 384 bytes per thread at 4 warps and 12 at 8, 64 x 128 16-bit tiles ~300 (tools/cuda_aot.py, sm_90)
    if dtype == torch.float32:  # IEEE FMA path: register-bound, small tiles
        return {"BLOCK_M": _fit(n, 32), "BLOCK_V": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": _fit(n, 64), "BLOCK_V": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # float32: IEEE FMA, never TF32; ignored for 16-bit


def _strides(hidden, weight, target, bias) -> tuple:
    b_s = bias.stride(0) if bias is not None else 0
    return (*hidden.stride(), *weight.stride(), b_s, target.stride(0))


@impl(spec, "cuda")
def linear_cross_entropy(hidden, weight, target, bias, ignore_index: int, reduction: str, label_smoothing: float,
                         softcap):
    return _forward(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap, None)


@impl(spec.train_forward, "cuda")
def linear_cross_entropy_forward(hidden, weight, target, bias, ignore_index: int, reduction: str,
                                 label_smoothing: float, softcap):
    """The forward plus each row's logsumexp [N] (float32), written by the same programs."""
    lse = torch.empty((hidden.shape[0],), dtype=torch.float32, device=hidden.device)
    return _forward(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap, lse), lse


def _forward(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap, lse):
    (n, h), v = hidden.shape, weight.shape[0]
    dev = hidden.device
    loss = torch.empty((n,), dtype=torch.float32, device=dev)
    if n:
        cfg, row_blocks, splits, split_cols = vocabulary_splits(n, v, h, hidden.dtype, dev)
        part = torch.empty((4, splits, n), dtype=torch.float32, device=dev)
        _lce_partial_kernel[(row_blocks, splits)](
            hidden, weight, hidden if bias is None else bias, target, part, n, v, h,
            *_strides(hidden, weight, target, bias), split_cols, float(softcap or 1.0), HAS_BIAS=bias is not None,
            SOFTCAP=softcap is not None, PRECISION=_precision(hidden.dtype), **cfg)
        block = min(next_pow2(n), 1024)
        _lce_combine_kernel[(cdiv(n, block),)](
            part, target, loss, loss if lse is None else lse, n, v, splits, splits * n, target.stride(0), int(ignore_index),
            float(label_smoothing), SMOOTH=label_smoothing != 0, STORE_LSE=lse is not None, BLOCK_M=block,
            num_warps=4)
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return total
    return total / (target != ignore_index).sum().to(torch.float32)


def vocabulary_splits(n: int, v: int, h: int, dtype: torch.dtype, dev) -> tuple:
    """(tile config, row blocks, splits, columns per split) of a forward over the vocabulary (module docstring)."""
    cfg = _config(n, v, h, dtype)
    row_blocks, tiles_v = cdiv(n, cfg["BLOCK_M"]), cdiv(v, cfg["BLOCK_V"])
    programs = 2 if INTERPRET else SPLIT_TARGET * sm_count(dev)
    splits = min(tiles_v, max(1, cdiv(programs, row_blocks)))
    split_cols = cdiv(tiles_v, splits) * cfg["BLOCK_V"]
    return cfg, row_blocks, cdiv(v, split_cols), split_cols


def _chunk_cols(n: int, v: int, block_v: int) -> int:
    """Vocabulary columns per backward chunk: CHUNK_ELEMENTS / N, a multiple of the tile, at least one tile."""
    cols = max(block_v, (CHUNK_ELEMENTS // max(n, 1)) // block_v * block_v)
    return min(cols, cdiv(v, block_v) * block_v)


@impl(spec.backward_op, "cuda")
def linear_cross_entropy_backward(grad, hidden, weight, target, lse, bias, ignore_index: int, reduction: str,
                                  label_smoothing: float, softcap):
    """dhidden, dweight, dbias chunk by chunk of the vocabulary (module docstring): the logits are recomputed,
    never stored; the dlogits buffer holds one chunk."""
    kept = (target != ignore_index).sum() if reduction == "mean" else grad  # a device count: no host sync

    def dlogits(buf, c0, c, cfg):
        n, h = hidden.shape
        _lce_dlogits_kernel[(cdiv(n, cfg["BLOCK_M"]) * cdiv(c, cfg["BLOCK_V"]),)](
            grad, hidden, weight, hidden if bias is None else bias, target, lse, kept, buf,
            n, weight.shape[0], h, c0, c, *_strides(hidden, weight, target, bias), grad.stride(0) if grad.dim() else 0,
            lse.stride(0), buf.stride(0), int(ignore_index), float(label_smoothing), float(softcap or 1.0),
            HAS_BIAS=bias is not None, SOFTCAP=softcap is not None, MEAN=reduction == "mean",
            PRECISE=hidden.dtype == torch.float32, PRECISION=_precision(hidden.dtype), **cfg)

    return head_gradients(hidden, weight, bias, dlogits)


def head_gradients(hidden, weight, bias, dlogits) -> tuple:
    """dhidden, dweight, dbias of an LM head's loss, chunk by chunk of the vocabulary (module docstring; shared with
    linear_logprobs): `dlogits(buf, c0, c, cfg)` writes the chunk's float32 dlogits [N, c] into buf, then the chunk's
    two GEMMs and column sum run."""
    (n, h), v = hidden.shape, weight.shape[0]
    dev = hidden.device
    dw = torch.empty(weight.shape, dtype=weight.dtype, device=dev)
    db = None if bias is None else torch.empty((v,), dtype=bias.dtype, device=dev)
    acc_dh = torch.zeros((n, h), dtype=torch.float32, device=dev)
    if n == 0 or h == 0:
        dw.zero_()
        if db is not None:
            db.zero_()
        return acc_dh.to(hidden.dtype), dw, db
    cfg = _config(n, v, h, hidden.dtype)
    width = _chunk_cols(n, v, cfg["BLOCK_V"])
    buf = torch.empty((n, width), dtype=torch.float32, device=dev)
    for c0 in range(0, v, width):
        c = min(width, v - c0)
        dlogits(buf, c0, c, cfg)
        d = buf[:, :c]
        _gemm(d, weight[c0:c0 + c], acc_dh, hidden.dtype, accumulate=c0 > 0)
        _gemm(d.transpose(0, 1), hidden, dw[c0:c0 + c], hidden.dtype, accumulate=False)
        if db is not None:
            db[c0:c0 + c] = _column_sum(d, bias.dtype)
    return acc_dh.to(hidden.dtype), dw, db


def _gemm(a, b, out, dtype: torch.dtype, accumulate: bool) -> None:
    """out [M, N] (+)= a [M, K] (float32) @ b [K, N] (`dtype`, the inputs')."""
    (m, k), n = a.shape, b.shape[1]
    if INTERPRET:
        bm, bn, bk, warps, stages = _fit(m, 128), _fit(n, 128), _fit(k, 128), 4, 1
    elif dtype == torch.float32:  # IEEE FMA: register-bound, small tiles
        bm, bn, bk, warps, stages = 64, 64, 32, 4, 3
    else:  # TF32 wgmma: 128 x 64 x 32 float32 tiles, (128 + 64) * 32 * 4 B * 3 stages = 72 KiB of shared memory
        bm, bn, bk, warps, stages = 128, 64, 32, 8, 3  # (128 x 128 spilled: the widened 16-bit b tile in registers)
    _gemm_kernel[(cdiv(m, bm) * cdiv(n, bn),)](
        a, b, out, m, n, k, *a.stride(), *b.stride(), *out.stride(), ACCUMULATE=accumulate,
        PRECISION=_precision(dtype), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
