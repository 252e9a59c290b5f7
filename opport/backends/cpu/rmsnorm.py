"""rmsnorm on NumPy: float32 statistics for 16-bit inputs, one pass over row blocks."""

import numpy as np

from opport.backends.cpu._common import rows_in_blocks, upcast
from opport.ops.rmsnorm import rmsnorm as spec


@spec.impl("cpu")
def rmsnorm(x: np.ndarray, weight, eps: float) -> np.ndarray:
    out = np.empty(x.shape, x.dtype)
    n = x.shape[-1]
    x2, o2 = x.reshape(-1, n), out.reshape(-1, n)  # reshape copies a non-contiguous x, never writes it
    w = upcast(weight) if weight is not None else None
    for rows in rows_in_blocks(x2.shape[0], 4 * n):
        xf = upcast(x2[rows])
        inv = 1.0 / np.sqrt(np.mean(np.square(xf), axis=-1, keepdims=True, dtype=xf.dtype) + xf.dtype.type(eps))
        y = xf * inv
        if w is not None:
            y *= w
        o2[rows] = y
    return out
