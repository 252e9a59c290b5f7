"""kv_cache_write_fp8 in Triton: each program quantises the K and V rows (all heads) of a few tokens to fp8 and stores
them at their slots, with their per-(token, head) scales or against the per-tensor ones.

The conversion is quantize_fp8's: in the interpreter the codes are made by exact bit arithmetic (`fp8_bits`,
round-to-nearest-even) and stored through uint8 views of the caches; compiled kernels clamp, then use the hardware
cvt (round-to-nearest-even). docs/cuda.md lists both.
"""

import torch

from opport.arraymath import FP8_MAX, per_token_scales
from opport.backends.cuda._launch import INTERPRET, INTERPRETED, cdiv, f32, is_finite, tl, triton
from opport.backends.cuda.kv_cache_write import _supports as float_supports
from opport.backends.cuda.kv_cache_write import row_tiles
from opport.backends.cuda.quantize_fp8 import FORMAT, SCALE_MIN, fp8_bits
from opport.dispatch import impl
from opport.ops.kv_cache_write_fp8 import kv_cache_write_fp8 as spec


@triton.jit
def _quantise_rows(x_ptr, c_ptr, s_ptr, tt, blk, off, live, h, c, hkv, d,
                   x_st, x_sh, x_sd, c_sb, c_so, c_sh, c_sd, s_sb, s_so, s_sh, fmax,
                   PER_TOKEN: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, NAN_CODE: tl.constexpr,
                   SUB_SCALE: tl.constexpr):
    """One cache's rows for the program's tokens: x [BLOCK_T, BLOCK_H, BLOCK_D] to codes at (blk, off, h).

    PER_TOKEN: s = max(amax / fmax, 2^-126) per (token, head), amax over the row's finite |x|, stored at
    s_ptr + blk * s_sb + off * s_so + h * s_sh; else s = s_ptr[0] (read). code = fp8(clamp(x / s, ±fmax)),
    NaN kept (tl.where: minimum/maximum would drop it), ±inf saturated."""
    m = live & (h < hkv) & (c < d)
    x = f32(tl.load(x_ptr + tt * x_st + h * x_sh + c * x_sd, mask=m, other=0.0))
    if PER_TOKEN:
        amax = tl.max(tl.where(is_finite(x), tl.abs(x), 0.0), 2)
        s = tl.maximum(amax / fmax, SCALE_MIN)[:, :, None]
        tl.store(s_ptr + blk * s_sb + off * s_so + h * s_sh, s, mask=live & (h < hkv))
    else:
        s = tl.load(s_ptr)
    v = x / s
    v = tl.where(v != v, v, tl.minimum(tl.maximum(v, -fmax), fmax))
    at = c_ptr + blk * c_sb + off * c_so + h * c_sh + c * c_sd
    if INTERPRETED:
        tl.store(at, fp8_bits(v, MANT, BIAS, NAN_CODE, SUB_SCALE), mask=m)
    else:
        tl.store(at, v.to(c_ptr.dtype.element_ty), mask=m)


@triton.jit
def _kv_cache_write_fp8_kernel(
    # pointers
    key_ptr, value_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr,
    # shapes, strides
    n_tokens, n_slots, block_size, hkv, d, dv, slot_s,
    key_st, key_sh, key_sd, val_st, val_sh, val_sd,
    kc_sb, kc_so, kc_sh, kc_sd, vc_sb, vc_so, vc_sh, vc_sd,
    ks_sb, ks_so, ks_sh, vs_sb, vs_so, vs_sh, fmax,
    # meta-parameters
    PER_TOKEN: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, NAN_CODE: tl.constexpr, SUB_SCALE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Quantise BLOCK_T tokens' key and value rows into k_cache and v_cache at slots s = slot_mapping[t] (-1: skipped).

    Dimensions: key [T, Hkv, D], value [T, Hkv, Dv], caches [num_blocks, block_size, Hkv, D/Dv] fp8 (uint8 views in
    the interpreter), scales [num_blocks, block_size, Hkv] float32 (PER_TOKEN) or [1]; all strided.
    Args: slot_ptr: int32 or int64 slots, checked (in range, distinct) before the launch on host arrays; on a GPU
        only under OPPORT_CHECK_VALUES=1 (a host read would break CUDA-graph capture), so the kernel itself skips
        a slot outside [0, n_slots) as it skips -1: nothing outside the caches and scales is ever written.
        PER_TOKEN: scales computed and written (else read); fmax: the format's largest finite value; MANT, BIAS,
        NAN_CODE, SUB_SCALE: the format, for the interpreter's exact conversion (`fp8_bits`).
    Returns: nothing; the caches (and per-token scales) are written in place.
    Notes: one read of each row (in registers for its amax and its quotients), one byte per element written, one
    float32 per (token, head) and cache with PER_TOKEN. A padding token's rows are masked off, neither read nor
    stored. Slots are distinct, so programs never conflict. x / s is float32 (quantize_fp8's conversion: plain `/`,
    approximate on a GPU, docs/numerics.md 3.7); the clamp keeps NaN, then round-to-nearest-even to fp8.
    Pseudocode: for t in the program's tokens: sl = slot[t]; if 0 <= sl < n_slots: for key (k_cache, k_scale) and
                value (v_cache, v_scale): s = max(amax_finite(x[t, h]) / fmax, 2^-126) (PER_TOKEN, stored at
                scale[sl // bs, sl % bs, h]) or scale[0]; cache[sl // bs, sl % bs, h] = fp8(clamp(x[t, h] / s))
    """
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    slot = tl.load(slot_ptr + t * slot_s, mask=t < n_tokens, other=-1).to(tl.int64)
    live = ((slot >= 0) & (slot < n_slots))[:, None, None]
    blk = (slot // block_size)[:, None, None]
    off = (slot % block_size)[:, None, None]
    tt = t[:, None, None]
    h = tl.arange(0, BLOCK_H)[None, :, None]
    c = tl.arange(0, BLOCK_D)[None, None, :]
    _quantise_rows(key_ptr, kc_ptr, ks_ptr, tt, blk, off, live, h, c, hkv, d, key_st, key_sh, key_sd,
                   kc_sb, kc_so, kc_sh, kc_sd, ks_sb, ks_so, ks_sh, fmax, PER_TOKEN, MANT, BIAS, NAN_CODE, SUB_SCALE)
    _quantise_rows(value_ptr, vc_ptr, vs_ptr, tt, blk, off, live, h, c, hkv, dv, val_st, val_sh, val_sd,
                   vc_sb, vc_so, vc_sh, vc_sd, vs_sb, vs_so, vs_sh, fmax, PER_TOKEN, MANT, BIAS, NAN_CODE, SUB_SCALE)


def _supports(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    return float_supports(key, value, k_cache, v_cache, slot_mapping)  # the same rows in one program's tile


@impl(spec, "cuda", supports=_supports)
def kv_cache_write_fp8(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    t, hkv, d = key.shape
    dv = value.shape[2]
    if t == 0:
        return None
    fmt = str(k_cache.dtype).removeprefix("torch.")
    mant, bias, nan_code = FORMAT[fmt]
    token = per_token_scales(k_scale)
    kc, vc = (k_cache.view(torch.uint8), v_cache.view(torch.uint8)) if INTERPRET else (k_cache, v_cache)
    ks_strides = k_scale.stride() if token else (0, 0, 0)
    vs_strides = v_scale.stride() if token else (0, 0, 0)
    block_t, block_h, block_d, warps = row_tiles(t, hkv, max(d, dv))
    _kv_cache_write_fp8_kernel[(cdiv(t, block_t),)](
        key, value, kc, vc, slot_mapping, k_scale, v_scale, t, k_cache.shape[0] * k_cache.shape[1], k_cache.shape[1],
        hkv, d, dv, slot_mapping.stride(0),
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(), *ks_strides, *vs_strides,
        FP8_MAX[fmt],
        PER_TOKEN=token, MANT=mant, BIAS=bias, NAN_CODE=nan_code, SUB_SCALE=2.0 ** (bias - 1 + mant),
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=warps)
    return None
