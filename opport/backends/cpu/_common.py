"""Helpers shared by the NumPy kernels."""

from __future__ import annotations

import numpy as np

from opport.dtypes import acc_dtype


def upcast(a: np.ndarray) -> np.ndarray:
    """`a` in its accumulation dtype (float32 for 16-bit inputs, float64 stays float64), C-contiguous.

    Contiguous so that NumPy's pairwise sums run in the same order whatever the input's layout:
    a transposed or sliced input then gives bitwise the same result as its contiguous copy.
    """
    return np.asarray(a, dtype=acc_dtype(a.dtype.name), order="C")


def rows_in_blocks(n_rows: int, row_bytes: int, budget: int = 64 << 20):
    """Slices over rows so that one block's float32 temporaries stay within `budget` bytes."""
    step = max(1, budget // max(row_bytes, 1))
    for start in range(0, n_rows, step):
        yield slice(start, min(start + step, n_rows))
