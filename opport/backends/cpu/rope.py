"""rope on NumPy: float32 arithmetic for 16-bit and float32 x, one pass over (batch, head) blocks."""

import numpy as np

from opport.backends.cpu._common import rows_in_blocks
from opport.dtypes import acc_dtype
from opport.ops.rope import pair_views
from opport.ops.rope import rope as spec


@spec.impl("cpu")
def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """Rotate feature pairs of x [B, H, S, D] by the angles whose cos/sin are [S, D/2] or [B, S, D/2].

    Notes: the tables are cast once to the compute dtype (float32, or float64 for float64 x), so a
    float64 table is rounded to float32 before use, as a GPU kernel would. Heads are processed in
    blocks so the float32 temporaries stay bounded; strided x is read through views, never copied whole.
    """
    acc = acc_dtype(x.dtype.name)
    b, h, s, d = x.shape
    out = np.empty(x.shape, x.dtype)
    c, sn = cos.astype(acc, copy=False), sin.astype(acc, copy=False)
    per_batch = c.ndim == 3
    for bi in range(b):
        cb, sb = (c[bi], sn[bi]) if per_batch else (c, sn)  # [S, D/2], broadcast over heads
        for heads in rows_in_blocks(h, 4 * s * d * acc.itemsize):
            x1, x2 = pair_views(x[bi, heads].astype(acc, copy=False), interleaved)
            o1, o2 = pair_views(out[bi, heads], interleaved)
            with np.errstate(invalid="ignore", over="ignore"):
                o1[...] = x1 * cb - x2 * sb
                o2[...] = x2 * cb + x1 * sb
    return out
