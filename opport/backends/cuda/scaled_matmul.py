"""scaled_matmul in Triton: fp8 tiles straight into tl.dot (Hopper's fp8 wgmma), float32 accumulation, scales
applied per 128-wide K group (block scales) or once at the end (tensor / row / column scales), fused bias.

In the interpreter the codes are read through a uint8 view and decoded by bits (dequantize_fp8's `fp8_value`:
Triton 3.6's interpreter has no exact fp8 widening) and the dot runs on those exact float32 values.
"""

import math

import torch

from opport.arraymath import BLOCK
from opport.backends.cuda._launch import INTERPRET, INTERPRETED, cdiv, f32, narrow, next_pow2, sm_count, tl, triton
from opport.backends.cuda.dequantize_fp8 import fp8_value
from opport.backends.cuda.quantize_fp8 import FORMAT
from opport.dispatch import impl
from opport.ops.scaled_matmul import scaled_matmul as spec

# fp8 products summed inside the tensor core between two float32 additions of the partial sum: 32 = every wgmma
# (K = 32 per instruction). Triton keeps fp8 wgmma only for values >= 32 (below, it falls back to mma.sync on
# fp16 copies of the operands), and sm_90's default (2^30) would never promote.
PROMOTE = tl.constexpr(32)


@triton.jit
def _operand(x, MANT: tl.constexpr, BIAS: tl.constexpr, E5M2: tl.constexpr, SUB_UNIT: tl.constexpr):
    """A tl.dot operand: the fp8 tile itself on a GPU (fp8 tensor cores), its exact float32 values in the interpreter."""
    if INTERPRETED:
        return fp8_value(x, MANT, BIAS, E5M2, SUB_UNIT)
    else:
        return x


@triton.jit
def _scaled_matmul_kernel(
    # pointers
    a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, out_ptr,
    # shapes, strides
    M, N, K, a_sm, a_sk, b_sk, b_sn, o_sm, o_sn, sa_m, sa_g, sb_g, sb_n, sb_div, bias_s,
    # meta-parameters
    PER_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_M: tl.constexpr,
    MANT: tl.constexpr, BIAS: tl.constexpr, E5M2: tl.constexpr, SUB_UNIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out = (a * sa) @ (b * sb) + bias for one [BLOCK_M, BLOCK_N] output tile; float32 accumulation, one rounding.

    Dimensions: a [M, K] and b [K, N] fp8 (strided); out [M, N]; scale of a at sa_ptr + m * sa_m + g * sa_g,
    of b at sb_ptr + g * sb_g + (n // sb_div) * sb_n, g = k // 128 the K group (strides 0 where a scale is
    shared: per tensor, per row, per column).
    Args: PER_GROUP: some scale changes along K (128-blocks): each BLOCK_K step (BLOCK_K divides 128) is
    scaled as it is added; else the whole sum is scaled once at the end. MANT, BIAS, E5M2, SUB_UNIT: the fp8
    format (interpreter decoding).
    Notes: tiles ordered in GROUP_M-row bands (L2 reuse of b's columns). Hopper's fp8 wgmma accumulates with
    reduced precision (DeepSeek-V3 measured ~14 bits), so the dot runs with max_num_imprecise_acc=PROMOTE (32):
    each wgmma's partial sum is added to the float32 accumulator on the CUDA cores (DeepSeek-V3's promotion,
    here every instruction rather than every 4). Masked loads pad with +0.0.
    Pseudocode: acc = 0; for k: p = a[tm, k] @ b[k, tn]; acc += p * sa[tm, g] * sb[g, tn] (or acc += p);
    out = (acc [* sa * sb]) + bias
    """
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    band = pid // (GROUP_M * tiles_n)
    first_m = band * GROUP_M
    rows_in_band = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % rows_in_band
    pid_n = (pid % (GROUP_M * tiles_n)) // rows_in_band
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    m64, n64 = offs_m.to(tl.int64), offs_n.to(tl.int64)
    sa_row = sa_ptr + m64 * sa_m
    sb_col = sb_ptr + (offs_n // sb_div).to(tl.int64) * sb_n
    a_ptrs = a_ptr + m64[:, None] * a_sm + offs_k.to(tl.int64)[None, :] * a_sk
    b_ptrs = b_ptr + offs_k.to(tl.int64)[:, None] * b_sk + n64[None, :] * b_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=m_ok[:, None] & (offs_k[None, :] < K - k), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < K - k) & n_ok[None, :], other=0.0)
        a = _operand(a, MANT, BIAS, E5M2, SUB_UNIT)
        b = _operand(b, MANT, BIAS, E5M2, SUB_UNIT)
        if PER_GROUP:
            g = k // 128
            s_a = tl.load(sa_row + g * sa_g, mask=m_ok, other=0.0)
            s_b = tl.load(sb_col + g * sb_g, mask=n_ok, other=0.0)
            part = tl.dot(a, b, max_num_imprecise_acc=PROMOTE)
            acc += part * s_a[:, None] * s_b[None, :]
        else:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=PROMOTE)
        a_ptrs += BLOCK_K * a_sk
        b_ptrs += BLOCK_K * b_sk
    if not PER_GROUP:
        s_a = tl.load(sa_row, mask=m_ok, other=0.0)
        s_b = tl.load(sb_col, mask=n_ok, other=0.0)
        acc = acc * s_a[:, None] * s_b[None, :]
    if HAS_BIAS:
        acc += f32(tl.load(bias_ptr + n64 * bias_s, mask=n_ok, other=0.0))[None, :]
    o_ptrs = out_ptr + m64[:, None] * o_sm + n64[None, :] * o_sn
    tl.store(o_ptrs, narrow(acc, out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _config(m: int, n: int, k: int, per_group: bool) -> dict:
    """Tile shape per problem. GPU numbers are design choices for Hopper's fp8 wgmma (K = 32 per instruction),
    not yet tuned on hardware (docs/cuda.md)."""
    if INTERPRET:  # few, large programs: each tl.dot is one NumPy matmul
        return {"BLOCK_M": _fit(m, 128), "BLOCK_N": _fit(n, 128), "BLOCK_K": BLOCK if per_group else _fit(k, 128),
                "GROUP_M": 8, "num_warps": 4, "num_stages": 1}
    block_k = BLOCK if per_group else _fit(k, 128)  # short K: small steps (a 128-step at K = 17 spilled 2.5 KB)
    if m <= 64:  # decode-like: wgmma's 64-row minimum, more column tiles in flight
        return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": block_k, "GROUP_M": 1, "num_warps": 4, "num_stages": 4}
    # 128 x 128 x 128 fp8 tiles, 4 stages: (128 * 128 + 128 * 128) B * 4 = 128 KiB of shared memory. Not 128 x 256:
    # the promoted partial sums double the accumulator's registers (128 x 256 spilled 64-1680 bytes per thread)
    return {"BLOCK_M": 128, "BLOCK_N": 64 if per_group else 128, "BLOCK_K": block_k, "GROUP_M": 8, "num_warps": 8,
            "num_stages": 4}


def _fit(n: int, cap: int) -> int:
    """The smallest power of two >= n, between 32 (fp8 tl.dot's K minimum; 16 for M and N suffices) and cap."""
    return max(32, min(cap, next_pow2(n)))


def _scale_strides(scale_a: torch.Tensor, scale_b: torch.Tensor, rows: int, n: int) -> tuple:
    """(sa, sb, (sa_m, sa_g, sb_g, sb_n, sb_div), per_group) of the contiguous scales viewed as [rows | 1, groups]
    and [groups, N | column blocks | 1]."""
    ga = scale_a.shape[-1]
    sa = scale_a.contiguous().reshape(-1, ga)
    sb = scale_b.contiguous()
    gk, gn = sb.shape
    strides = (ga if sa.shape[0] > 1 else 0, 1 if ga > 1 else 0, gn if gk > 1 else 0, 1 if gn > 1 else 0,
               1 if gn == n else BLOCK)
    return sa, sb, strides, ga > 1 or gk > 1


@impl(spec, "cuda")
def scaled_matmul(a_q: torch.Tensor, b_q: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, bias,
                  out_dtype: str) -> torch.Tensor:
    """Host side: a's batch dims fold into M (a reshape: a copy only for a view whose rows cannot merge); a, b
    and out are read by their strides; the scales (small) are made contiguous."""
    k, n = b_q.shape
    lead = tuple(a_q.shape[:-1])
    rows = math.prod(lead)
    a2 = a_q.reshape(rows, k)
    out = torch.empty((rows, n), dtype=getattr(torch, out_dtype), device=a_q.device)
    if out.numel() == 0:
        return out.reshape(*lead, n)
    if k == 0:  # an empty sum: zeros, plus the bias; nothing for the dot to contract
        out.zero_()
        return (out if bias is None else out.add_(bias)).reshape(*lead, n)
    sa, sb, (sa_m, sa_g, sb_g, sb_n, sb_div), per_group = _scale_strides(scale_a, scale_b, rows, n)
    mant, fbias, _ = FORMAT[str(a_q.dtype).removeprefix("torch.")]
    av, bv = (a2.view(torch.uint8), b_q.view(torch.uint8)) if INTERPRET else (a2, b_q)
    cfg = _config(rows, n, k, per_group)
    tiles = cdiv(rows, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"])
    if not INTERPRET and rows <= 64 and tiles < 0.8 * sm_count(a_q.device):
        # decode with few output tiles: 64-column tiles put more SMs to work (not in the 8-warp 128-row config,
        # where 128 x 64 spilled 628 bytes per thread on a row-major b)
        cfg["BLOCK_N"] = 64
        tiles = cdiv(rows, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"])
    bias_t, bias_s = (bias, bias.stride(0)) if bias is not None else (out, 0)
    _scaled_matmul_kernel[(tiles,)](
        av, bv, sa, sb, bias_t, out, rows, n, k, a2.stride(0), a2.stride(1), b_q.stride(0), b_q.stride(1),
        out.stride(0), out.stride(1), sa_m, sa_g, sb_g, sb_n, sb_div, bias_s,
        PER_GROUP=per_group, HAS_BIAS=bias is not None, MANT=mant, BIAS=fbias, E5M2=mant == 2,
        SUB_UNIT=2.0 ** (1 - fbias - mant), **cfg,
    )
    return out.reshape(*lead, n)
