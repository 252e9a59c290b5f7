"""dequantize_fp8 on NumPy: fp8 codes widened to float32, times their group's scale, rounded once."""

import functools

import numpy as np

from opport.arraymath import grouped
from opport.backends.cpu.quantize_fp8 import _chunks
from opport.dispatch import impl
from opport.dtypes import np_dtype
from opport.ops.dequantize_fp8 import dequantize_fp8 as spec


@functools.cache
def decode_table(dtype: str) -> np.ndarray:
    """float32 value of each of the 256 codes: a gather is ~7x faster than ml_dtypes' cast, and exact."""
    return np.arange(256, dtype=np.uint8).view(np_dtype(dtype)).astype(np.float32)


@impl(spec, "cpu")
def dequantize_fp8(q, scales, granularity, block, out_dtype):
    """out = float32(q) * scale per group (float64 for a float64 out_dtype), in chunks of about `BLOCK_ELEMS`; the
    codes widen through `decode_table`."""
    acc = np.float64 if out_dtype == "float64" else np.float32
    g = grouped(q, granularity, block)
    n_groups, length = int(np.prod(g.shape[:-1])), g.shape[-1]
    g2, s = g.reshape(n_groups, length), scales.reshape(n_groups).astype(acc)
    out = np.empty((n_groups, length), np_dtype(out_dtype))
    table = decode_table(q.dtype.name).astype(acc)
    with np.errstate(invalid="ignore", over="ignore"):
        for rows, cols in _chunks(n_groups, length):
            out[rows, cols] = (np.take(table, g2[rows, cols].view(np.uint8)) * s[rows, None]).astype(np_dtype(out_dtype))
    return out.reshape(q.shape)
