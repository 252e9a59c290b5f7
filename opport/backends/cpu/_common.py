"""Helpers shared by the NumPy kernels: upcasting, and row blocks spread over a small thread pool.

NumPy's ufuncs and most reductions release the GIL, so the kernels run their blocks on threads: each
thread takes a contiguous range of rows and walks it in blocks of about 256K elements. Smaller,
L2-sized blocks measured slower (1.3-2x at 16K-64K elements on the 2-core VM): every NumPy call costs
1-3 us of fixed overhead, held under the GIL, and a block makes ten or more. Rows never straddle
threads and each row is reduced in one NumPy call whatever the block, so results are bitwise the
same for any thread count.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from opport.dtypes import acc_dtype
from opport.errors import ArgumentError

BLOCK_ELEMS = 1 << 18  # elements per block: 1 MiB per float32 temporary, a few MiB per block
PARALLEL_MIN = 1 << 18  # below this many elements the hand-off to a pool thread (~60 us measured) costs
# about what it saves

_ACC_SELF = (np.dtype(np.float32), np.dtype(np.float64))  # dtypes that compute in themselves
_F16 = np.dtype(np.float16)
# Every float16 as float32, exactly (NaN payloads too): a 256 KiB table that stays in L2. Looking it up
# is 2x NumPy's own float16 -> float32 cast here (0.8 vs 1.6 ns/element; no F16C path in that cast).
_F16_TO_F32 = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
_pool: tuple | None = None  # (pid, workers, executor): a forked child must not use its parent's dead threads
_pool_lock = threading.Lock()
_inside = threading.local()  # set while a thread runs a share: a nested call must not wait on the pool


def upcast(a: np.ndarray) -> np.ndarray:
    """`a` in its accumulation dtype (float32 for 16-bit inputs, float64 stays float64), C-contiguous.

    Contiguous so that NumPy's pairwise sums run in the same order whatever the input's layout:
    a transposed or sliced input then gives bitwise the same result as its contiguous copy.
    """
    if a.dtype in _ACC_SELF and a.flags.c_contiguous:  # the common case, without asarray's overhead
        return a
    if a.dtype == _F16:
        return _F16_TO_F32.take(a.view(np.uint16), mode="clip")  # C-contiguous, shaped like a
    return np.asarray(a, dtype=acc_dtype(a.dtype.name), order="C")


def f16_bits(y: np.ndarray) -> np.ndarray:
    """float32 -> float16 bit patterns, rounded to nearest even exactly as NumPy's astype (NaN -> 0x7e00).

    Integer arithmetic on the float32 bits, 2x NumPy's own cast here (1.2 vs 2.4 ns/element): normal
    results rebias the exponent and round at bit 13 (ties to even: add 0xfff plus the result's lowest
    bit); subnormal results (|y| < 2^-14) come from one float add of 0.5, which rounds them in hardware;
    |y| >= 65536 is inf, or NaN.
    """
    b = y.view(np.uint32)
    a = b & np.uint32(0x7FFFFFFF)
    h = (a >> np.uint32(13)) & np.uint32(1)
    h += a
    h += np.uint32((((15 - 127) << 23) + 0xFFF) & 0xFFFFFFFF)  # wraps for tiny a: replaced below
    h >>= np.uint32(13)
    small = a < np.uint32(113 << 23)
    if small.any():  # blended in without fancy indexing: softmax outputs can be mostly tiny
        s = (a.view(np.float32) + np.float32(0.5)).view(np.uint32)
        s -= np.uint32(0x3F000000)
        s -= h  # modulo 2^32: h + small * (s - h) is s where small, h elsewhere
        s *= small
        h += s
    big = a >= np.uint32(143 << 23)
    if big.any():
        h[big] = np.where(a[big] > np.uint32(0x7F800000), np.uint32(0x7E00), np.uint32(0x7C00))
    h |= (b >> np.uint32(16)) & np.uint32(0x8000)
    return h.astype(np.uint16)


def row_mean(a: np.ndarray) -> np.ndarray:
    """np.mean(a, axis=-1, keepdims=True), bitwise (a pairwise sum, then one division), at a third of
    its fixed cost: np.mean's Python wrapper costs ~5 us a call, which tiny rows feel."""
    m = np.add.reduce(a, axis=-1, keepdims=True)
    m /= a.shape[-1]
    return m


def result_block(dst: np.ndarray, like: np.ndarray) -> np.ndarray:
    """Where a block's result is computed: the output rows `dst` themselves when they have the compute
    dtype of `like` (float32/float64 results land in place), else a scratch block for `store`."""
    return dst if dst.dtype == like.dtype else np.empty_like(like)


def store(dst: np.ndarray, y: np.ndarray) -> None:
    """Round a scratch block into the output rows (nothing to do when it was computed in place)."""
    if y is dst:
        return
    if dst.dtype == _F16 and y.dtype == np.float32:
        dst.view(np.uint16)[...] = f16_bits(np.ascontiguousarray(y))
    else:
        dst[...] = y


def num_threads() -> int:
    """Threads the cpu kernels use: `OPPORT_NUM_THREADS`, else the CPUs this process may run on.

    Read on every kernel call, whatever its size (a bad value must not pass for small inputs and fail for
    large ones); a value other than a positive integer is an ArgumentError naming the variable.
    """
    env = os.environ.get("OPPORT_NUM_THREADS", "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ArgumentError(op="cpu", arg="OPPORT_NUM_THREADS", constraint="cpu.num_threads",
                                expected="a positive integer (unset it to use every CPU)", got=repr(env))
        return int(env)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _executor(workers: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid() or _pool[1] < workers:
            if _pool is not None and _pool[0] == os.getpid():
                _pool[2].shutdown(wait=False)  # more threads asked for: its idle threads exit; queued work still runs
            _pool = (os.getpid(), workers, ThreadPoolExecutor(workers, thread_name_prefix="opport-cpu"))
        return _pool[2]


def block_rows(row_elems: int) -> int:
    """Rows per block of `parallel_rows`."""
    return max(1, BLOCK_ELEMS // max(row_elems, 1))


def parallel_rows(n_rows: int, row_elems: int, body) -> None:
    """Call `body(rows)` for row slices covering [0, n_rows), in blocks of `block_rows(row_elems)` rows.

    Large inputs are split into one contiguous range of rows per thread (the caller's thread takes the
    first); `body` must only write the output rows it is given. The blocks lie on a fixed grid (block i
    is rows [i * step, (i + 1) * step)) whatever the thread count, so a kernel that reduces over rows can
    keep one partial result per block (index rows.start // step) and sum them in order: bitwise the same
    for any thread count. NumPy floating-point warnings are off inside: the kernels define their
    overflow, inf and NaN results themselves.
    """
    step = block_rows(row_elems)
    nested = getattr(_inside, "on", False)
    wanted = num_threads()  # validated on every call, small ones too
    threads = 1 if nested or n_rows * row_elems < PARALLEL_MIN else min(wanted, n_rows)

    def run(lo: int, hi: int) -> None:
        _inside.on = True
        try:
            with np.errstate(all="ignore"):  # per thread: NumPy's error state is thread-local
                for start in range(lo, hi, step):
                    body(slice(start, min(start + step, hi)))
        finally:
            _inside.on = nested

    if threads <= 1:
        return run(0, n_rows)
    bounds = [min(n_rows, -(-(n_rows * i // threads) // step) * step) for i in range(threads + 1)]  # on the grid
    pool = _executor(threads - 1)
    futures = [pool.submit(run, bounds[i], bounds[i + 1]) for i in range(1, threads)]
    try:
        run(bounds[0], bounds[1])
    finally:
        for f in futures:
            f.result()  # re-raises a worker's exception; waits for all before the output is used
