"""Row-invariant products for `opport.batch_invariant()` on the cpu backend.

OpenBLAS gives a row of a @ b different bits depending on the rows around it: its position in the matrix, the
matrix's height, even the values of the other rows in a zero-padded block of fixed shape (measured with OpenBLAS
0.3.31, Haswell kernels, one thread and two). So under the mode the GEMMs whose rows are a batch's rows (matmul,
the LM-head losses, the MoE experts) run `rows_matmul`: every output element accumulates a[i, k] b[k, j] for
k = 0, 1, ..., K - 1 in that fixed order (chunks of KC, the chunks added in order), in the accumulation dtype,
whatever i is and whoever its neighbours are. Blocks of rows share each loaded row of b (cache reuse), numba's
threads (as many as opport's thread budget, OPPORT_NUM_THREADS) take whole row blocks: neither changes an
element's order of operations. Compiled with numba (cached on disk); without numba, the same order in NumPy
(exact, much slower).
"""

from __future__ import annotations

import numpy as np

from opport.backends.cpu._common import gemm, num_threads
from opport.dispatch import is_batch_invariant

try:
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; the NumPy loop keeps the mode correct without it
    numba = None

ROWS, COLS, KC = 16, 256, 64  # a row block's tiles: 16 x 256 float32 = 16 KiB each (L1/L2); k in chunks of 64


def active() -> bool:
    """Whether kernels must give batch-invariant rows now (opport.batch_invariant() or OPPORT_BATCH_INVARIANT)."""
    return is_batch_invariant()


def dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a [M, K] @ b [K, N]: BLAS, or `rows_matmul` under the batch-invariant mode (rows are a batch's rows)."""
    return rows_matmul(a, b) if active() else gemm(a, b)


def rows_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a [M, K] @ b [K, N] in a's dtype (float32 or float64; callers upcast 16-bit), each element summed over k in
    order: row i's bits depend on a[i] and b only."""
    m, n = a.shape[0], b.shape[1]
    out = np.zeros((m, n), np.result_type(a.dtype, b.dtype))
    if m == 0 or n == 0 or a.shape[1] == 0:
        return out
    a = np.ascontiguousarray(a, out.dtype)
    b = np.ascontiguousarray(b, out.dtype)
    if numba is None:  # the kernel's order of additions, in NumPy
        for k0 in range(0, a.shape[1], KC):
            part = np.zeros_like(out)
            for k in range(k0, min(k0 + KC, a.shape[1])):
                part += a[:, k:k + 1] * b[k]
            out += part
        return out
    kernel = _kernel()
    # numba's threads within opport's thread budget (docs/cpu.md), never more than numba started with
    numba.set_num_threads(max(1, min(num_threads(), numba.config.NUMBA_NUM_THREADS)))
    scratch = np.zeros((numba.get_num_threads(), 2, ROWS, COLS), out.dtype)  # per thread: acc, part
    kernel(a, b, out, scratch)
    return out


_COMPILED = []


def _kernel():
    """The numba kernel, compiled on first use (and cached on disk)."""
    if not _COMPILED:
        _COMPILED.append(numba.njit(parallel=True, cache=True, fastmath=False)(_rows_matmul))
    return _COMPILED[0]


def _rows_matmul(a, b, out, scratch):  # pragma: no cover - compiled by numba
    """Row blocks in parallel; per block and column chunk, k in chunks of KC summed into a partial tile, the partial
    tiles added in k order: each element's additions are the same sequence for every row (two levels: the
    error grows with sqrt(K / KC) + KC, not K). The tiles are the thread's scratch (allocated by the caller: no
    allocation here, where conformance's poisoned np.empty would reach numba's np.zeros)."""
    m, kk = a.shape
    n = b.shape[1]
    for blk in numba.prange((m + ROWS - 1) // ROWS):
        i0 = blk * ROWS
        rows = min(ROWS, m - i0)
        acc = scratch[numba.get_thread_id(), 0]
        part = scratch[numba.get_thread_id(), 1]
        for j0 in range(0, n, COLS):
            cols = min(COLS, n - j0)
            acc[:] = 0
            for k0 in range(0, kk, KC):
                part[:] = 0
                for k in range(k0, min(k0 + KC, kk)):
                    for i in range(rows):
                        aik = a[i0 + i, k]
                        for j in range(cols):
                            part[i, j] += aik * b[k, j0 + j]
                for i in range(rows):
                    for j in range(cols):
                        acc[i, j] += part[i, j]
            for i in range(rows):
                for j in range(cols):
                    out[i0 + i, j0 + j] = acc[i, j]
