"""C entry points of the fused loops (numba `cfunc`s): what a native caller (opport/integrations/torch_native.cpp,
torch's autograd nodes for small float32 calls) runs without Python in between. Each wraps its op's loop over
raw float32 buffers, exactly as the op file's small-call path calls it (the same loop, the same arguments), and
returns what the loop returns: the count of elements or rows it left, which the caller then hands to the op's
NumPy kernel whole (the kernel reruns the loop and the careful formula on what it left: the same bits).

Scratch (flags, partial sums) is the caller's, as in the op files; the row tasks (cross_entropy's loops over a range
of rows, run on torch's pool) take their lane sums from numba's allocator (`_fused._scratch`). `addresses()`
compiles them once (_cfunc_defs.py; cached on disk) and returns {name: C function address}; None where numba is
absent.
"""

from __future__ import annotations

import numpy as np

from opport.backends.cpu import _common, _fused

_ADDRESSES: dict | None = None


def addresses() -> dict | None:
    global _ADDRESSES
    if _ADDRESSES is None and _fused.numba is not None:
        _ADDRESSES = {name: fn.address for name, fn in _compile().items()}
    return _ADDRESSES


def _compile() -> dict:
    from opport.backends.cpu import _cfunc_defs  # (compiles, or loads from numba's cache, on first use)

    return _cfunc_defs.ENTRIES


POOL_ROWS_MIN = 1 << 18  # elements from which cross_entropy's row loops split over torch's pool (as its guest)
ROW_TASKS = 16  # tasks a call splits into (rows are independent: the split changes no bit)


def row_tasks(name: str, arrays: tuple, ints: tuple = (), scalar: float = 0.0) -> int | None:
    """The rows of arrays[0] [rows, V] in ROW_TASKS tasks of the entry point `name` on torch's pool (the native
    extension's run_tasks, for a kernel running as torch's guest): how many tasks left rows to NumPy. None, having run
    nothing, for a call below POOL_ROWS_MIN elements, arrays that are not C-contiguous, or no pool."""
    if arrays[0].size < POOL_ROWS_MIN or not all(a.flags.c_contiguous for a in arrays):
        return None
    pool = _common.pool_tasks()
    entries = addresses() if pool is not None else None
    if entries is None:
        return None
    rows, v = arrays[0].shape
    per = -(-rows // ROW_TASKS)
    iv = np.array([a.ctypes.data for a in arrays] + [rows, v, *ints, per], np.int64)
    fv = np.array([scalar], np.float64)
    return pool(entries[name], -(-rows // per), iv.ctypes.data, fv.ctypes.data)
