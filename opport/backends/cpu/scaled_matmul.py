"""scaled_matmul on NumPy: fp8 codes decoded and scaled to float32 panel by panel, then float32 BLAS."""

import math

import numpy as np

from opport.arraymath import expand_a, expand_b
from opport.backends.cpu._common import upcast, uses_blas
from opport.backends.cpu.dequantize_fp8 import decode_table
from opport.dispatch import impl
from opport.dtypes import np_dtype
from opport.ops.scaled_matmul import scaled_matmul as spec

PANEL_ELEMS = 1 << 24  # float32 elements of one dequantised panel of b (64 MiB; 16 MiB panels measured 2x slower)
ROW_ELEMS = 1 << 20  # float32 elements of one dequantised chunk of a's rows (4 MiB)


@impl(spec, "cpu")
@uses_blas()
def scaled_matmul(a_q, b_q, scale_a, scale_b, bias, out_dtype):
    """out = (a_q * scale_a) @ (b_q * scale_b) + bias, rounded once to out_dtype.

    Notes: the codes widen to float32 exactly through dequantize_fp8's lookup table and are multiplied by
    their group's scale in float32 (one rounding, 2^-24 relative, far below the float32 accumulation's
    error); the product is one float32 BLAS call per [row chunk, column panel]. b is dequantised one
    column panel of at most PANEL_ELEMS elements at a time and a one row chunk of ROW_ELEMS: the float32
    temporaries stay under ~70 MiB whatever the shape (an LLM-sized b is never widened whole).
    """
    k, n = b_q.shape
    lead = a_q.shape[:-1]
    rows = math.prod(lead)
    out = np.empty((rows, n), np_dtype(out_dtype))
    if out.size == 0:
        return out.reshape(*lead, n)
    a2 = a_q.reshape(rows, k)
    sa = expand_a(scale_a, k).reshape(-1, scale_a.shape[-1] if scale_a.shape[-1] == 1 else k)  # [1 or rows, 1 or K]
    sb = expand_b(scale_b, k, n)  # [1 or K, 1 or N]
    ta, c = decode_table(a_q.dtype.name), None if bias is None else upcast(bias)
    panel = max(1, PANEL_ELEMS // max(1, k))
    chunk = max(1, ROW_ELEMS // max(1, k))
    with np.errstate(invalid="ignore", over="ignore"):
        for n0 in range(0, n, panel):
            cols = slice(n0, min(n, n0 + panel))
            b = np.take(ta, b_q[:, cols].view(np.uint8)) * sb[:, cols if sb.shape[1] > 1 else slice(None)]
            for r0 in range(0, rows, chunk):
                r = slice(r0, min(rows, r0 + chunk))
                a = np.take(ta, a2[r].view(np.uint8)) * sa[r if sa.shape[0] > 1 else slice(None)]
                y = a @ b
                if c is not None:
                    y += c[cols]
                out[r, cols] = y
    return out.reshape(*lead, n)
