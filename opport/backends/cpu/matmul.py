"""matmul on NumPy: BLAS in float32 for 16-bit inputs (float32 accumulation), float64 stays float64."""

import numpy as np

from opport.backends.cpu._common import upcast
from opport.dispatch import impl
from opport.ops.matmul import matmul as spec


@impl(spec, "cpu")
def matmul(a: np.ndarray, b: np.ndarray, bias) -> np.ndarray:
    """a [..., M, K] @ b ([K, N] or [..., K, N]) (+ bias [N]), returned in a's dtype.

    Notes: 16-bit operands are upcast to float32 copies (2x their bytes) because NumPy has no
    float32-accumulating half/bfloat16 GEMM; np.matmul takes strided views as they are and
    returns zeros when K = 0.
    """
    with np.errstate(invalid="ignore", over="ignore"):
        out = np.matmul(upcast(a), upcast(b))
        if bias is not None:
            out += upcast(bias)
        return out.astype(a.dtype, copy=False)  # beyond the dtype's range -> inf, as the exact result rounds
