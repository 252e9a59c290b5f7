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

from opport.backends.cpu import _fused

_ADDRESSES: dict | None = None


def addresses() -> dict | None:
    global _ADDRESSES
    if _ADDRESSES is None and _fused.numba is not None:
        _ADDRESSES = {name: fn.address for name, fn in _compile().items()}
    return _ADDRESSES


def _compile() -> dict:
    from opport.backends.cpu import _cfunc_defs  # (compiles, or loads from numba's cache, on first use)

    return _cfunc_defs.ENTRIES
