"""kv_cache_write_fp8 on NumPy: the live tokens' rows quantised (quantize_fp8's conversion) and scattered to their
slots."""

import numpy as np

from opport.arraymath import FP8_MAX, PAD, SCALE_FLOOR, per_token_scales
from opport.backends.cpu.kv_cache_write import _scatter
from opport.backends.cpu.quantize_fp8 import encode
from opport.dispatch import impl
from opport.dtypes import np_dtype
from opport.ops.kv_cache_write_fp8 import kv_cache_write_fp8 as spec


@impl(spec, "cpu")
def kv_cache_write_fp8(key: np.ndarray, value: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                       slot_mapping: np.ndarray, k_scale: np.ndarray, v_scale: np.ndarray) -> None:
    """k_cache[s // bs, s % bs] = fp8(key[t] / scale) and v_cache likewise for every token t with s = slot_mapping[t]
    != -1; per-token scales (amax / fp8_max per row and head) are written to k_scale[s // bs, s % bs].

    Dimensions: key [T, Hkv, D], value [T, Hkv, Dv], caches [num_blocks, bs, Hkv, D/Dv], scales [1] or
    [num_blocks, bs, Hkv] (any strides).
    Notes: 16-bit and float32 rows compute in float32, float64 in float64; the quotient is one correctly rounded
    division, clamped (±inf saturates, NaN stays), rounded to nearest even by quantize_fp8's `encode`.
    """
    slots = np.asarray(slot_mapping)
    keep = slots != PAD
    if not keep.all():
        key, value, slots = key[keep], value[keep], slots[keep]
    if not slots.size:
        return None
    fmt = str(k_cache.dtype)
    for rows, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        codes, s = quantise(rows, scale, fmt)
        _scatter(cache, slots, codes)
        if per_token_scales(scale):
            _scatter(scale, slots, s)
    return None


def quantise(rows: np.ndarray, scale: np.ndarray, fmt: str) -> tuple:
    """(codes [T, H, D] in fmt, float32 scales [T, H] or the static [1])."""
    acc = np.float64 if rows.dtype == np.float64 else np.float32
    fmax = FP8_MAX[fmt]
    v = rows.astype(acc)
    with np.errstate(invalid="ignore", over="ignore"):
        if per_token_scales(scale):
            amax = np.where(np.isfinite(v), np.abs(v), acc(0)).max(axis=-1, initial=acc(0))
            s = np.maximum((amax / acc(fmax)).astype(np.float32), np.float32(SCALE_FLOOR))
            v /= s[..., None].astype(acc)
        else:
            s = np.asarray(scale, np.float32).reshape(())
            v /= s.astype(acc)
        np.clip(v, -fmax, fmax, out=v)
    codes = encode(np.ascontiguousarray(v), fmt) if acc is np.float32 else v.astype(np_dtype(fmt))
    return codes, s
