"""kv_cache_write_fp8 on NumPy: the live tokens' rows quantised (quantize_fp8's conversion) and scattered to their
slots."""

import numpy as np

from opport.arraymath import PAD, per_token_scales
from opport.backends.cpu.kv_cache_write import _scatter
from opport.backends.cpu.quantize_fp8 import quantize_fp8
from opport.dispatch import impl
from opport.ops.kv_cache_write_fp8 import kv_cache_write_fp8 as spec


@impl(spec, "cpu")
def kv_cache_write_fp8(key: np.ndarray, value: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                       slot_mapping: np.ndarray, k_scale: np.ndarray, v_scale: np.ndarray) -> None:
    """k_cache[s // bs, s % bs] = fp8(key[t] / scale) and v_cache likewise for every token t with s = slot_mapping[t]
    != -1; per-token scales (amax / fp8_max per row and head) are written to k_scale[s // bs, s % bs].

    Dimensions: key [T, Hkv, D], value [T, Hkv, Dv], caches [num_blocks, bs, Hkv, D/Dv], scales [1] or
    [num_blocks, bs, Hkv] (any strides).
    Notes: the rows go through the cpu quantize_fp8 kernel (per token: granularity "token" over each row and head;
    per tensor: its static scale), so the conversion is that kernel's: 16-bit and float32 rows in float32, float64 in
    float64, one correctly rounded division, clamped, rounded to nearest even.
    """
    slots = np.asarray(slot_mapping)
    keep = slots != PAD
    if not keep.all():
        key, value, slots = key[keep], value[keep], slots[keep]
    if not slots.size:
        return None
    fmt = str(k_cache.dtype)
    for rows, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        token = per_token_scales(scale)
        static = None if token else float(np.asarray(scale, np.float32).reshape(-1)[0])
        codes, s = quantize_fp8(rows, "token" if token else "tensor", 128, fmt, static)
        _scatter(cache, slots, codes)
        if token:
            _scatter(scale, slots, s[..., 0])
    return None
