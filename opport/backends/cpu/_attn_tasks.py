"""attention's float32 forward and backward as numba tasks: each task one KV head's share of the work, the whole of it
compiled (its products through BLAS, numba's np.dot; its score blocks through _fused's loops), so that tasks run on
any thread without Python: one after another on the calling thread (`_run`), or spread over torch's intra-op pool by
the native extension (opport/integrations/torch_native.cpp, `run_tasks`) when the kernel runs as torch's guest.

A task's arithmetic depends on its own inputs only, and the split into tasks on the shapes only, so the results are
bitwise the same whichever thread runs which task and however many there are.

Forward task t: KV head h = t // nqb and query block ib = t % nqb; its g query heads' rows of the block are stacked
[g bq, D] (as the NumPy kernel's blocks: one product per key block for the g heads that share the KV head), then the
online softmax over key blocks of bk keys. Backward task h: all of KV head h (its g query heads, every query block),
so dK and dV accumulate in the task and no two tasks write the same memory. The arithmetic is the NumPy kernel's
(attention.py): P recomputed from the saved lse, dP - D formed in float64, dS in float32.

Covered: float32 q, k, v, causal (bottom-right) or no mask, no soft cap, no sliding window. A task returns 1 (the
caller then runs the NumPy kernel on the whole call) where a score block holds a non-finite score, a row saw no key
(lse -inf), a forward's partly masked block meets a non-finite value, or a backward task's q, k or dO holds one
(0 * NaN would cross the mask).
"""

from __future__ import annotations

import importlib.util

import numpy as np

from opport.backends.cpu import _common, _fused

_F32 = np.dtype(np.float32)
_BLAS = importlib.util.find_spec("scipy") is not None  # numba's np.dot calls scipy's BLAS (cython_blas)

_COMPILED: dict = {}


def compiled() -> dict:
    if not _COMPILED:
        from opport.backends.cpu import _attn_loops  # (compiles, or loads from numba's cache, on first use)

        _COMPILED.update(_attn_loops.ENTRIES)
        _common.blas_loaded()  # numba's products call scipy's OpenBLAS, loaded now: its threads under opport's limit
    return _COMPILED


def covers(q, k, v, softcap, window) -> bool:
    """Whether the tasks take this call: float32 arrays (`is`: one dtype object), no soft cap, no window, the fused
    loops on and scipy installed, more than one query row (a decode step has its own loop)."""
    return (q.dtype is k.dtype is v.dtype is _F32 and softcap is None and window is None and q.shape[2] > 1
            and _BLAS and _fused.enabled(_F32))


def forward(q, k, v, causal: bool, scale, bq: int, bk: int, out, lse) -> bool:
    """out [B, Hq, Sq, Dv] and lse [B, Hq, Sq] (fresh, contiguous) by the forward tasks; False (the caller runs the
    NumPy kernel) where a task declined."""
    b, hq, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    n = b * hkv * -(-sq // bq)
    dims = (b * hkv, hq // hkv, sq, sk, d, dv, bq, bk, int(causal))
    return _run("forward", n, _merged((q, k, v, out, lse)), dims, scale)


def backward(grad, q, k, v, out, lse, causal: bool, scale, bq: int, bk: int, dq, dk, dv) -> bool:
    """dq, dk, dv (fresh, contiguous) by the backward tasks, one per KV head; False where a task declined."""
    b, hq, sq, d = q.shape
    hkv, sk, dvn = k.shape[1], k.shape[2], v.shape[3]
    dims = (b * hkv, hq // hkv, sq, sk, d, dvn, bq, bk, int(causal))
    return _run("backward", b * hkv, _merged((q, k, v, out, lse, grad, dq, dk, dv)), dims, scale)


def _merged(arrays) -> tuple:
    """[B, H, ...] arrays as contiguous [B*H, ...] ones (copies of the views; the fresh outputs are already)."""
    return tuple(np.ascontiguousarray(a).reshape(a.shape[0] * a.shape[1], *a.shape[2:]) for a in arrays)


def _run(kind: str, n: int, arrays: tuple, dims: tuple, scale) -> bool:
    c = compiled()
    pool = _common.pool_tasks()
    if pool is not None:  # torch's pool (the GIL released; arrays stay referenced here until it returns)
        ints = np.array([a.ctypes.data for a in arrays] + [0] * (9 - len(arrays)) + list(dims), np.int64)
        floats = np.array([scale], np.float64)
        return pool(c[f"{kind}_entry"], n, ints.ctypes.data, floats.ctypes.data) == 0
    g, bq, bk, causal = dims[1], dims[6], dims[7], bool(dims[8])
    return c[f"{kind}_all"](n, *arrays, g, bq, bk, causal, np.float32(scale)) == 0
