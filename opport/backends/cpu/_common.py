"""Helpers shared by the NumPy kernels: upcasting, row blocks spread over a small thread pool, and the
thread budget that pool shares with the BLAS under the kernels.

NumPy's ufuncs and most reductions release the GIL, so the kernels run their blocks on threads: each
thread takes a contiguous range of rows and walks it in blocks of about 256K elements. Smaller,
L2-sized blocks measured slower (1.3-2x at 16K-64K elements on the 2-core VM): every NumPy call costs
1-3 us of fixed overhead, held under the GIL, and a block makes ten or more. Rows never straddle
threads and each row is reduced in one NumPy call whatever the block, so results are bitwise the
same for any thread count.

One budget, `num_threads()` (OPPORT_NUM_THREADS), covers opport's pool and BLAS together (docs/cpu.md,
"Threads"): BLAS calls made in the pool's shares (`parallel_rows(..., blas=True)`, a `uses_blas` kernel
called from a share) run on 1 thread; a kernel that hands the whole problem to BLAS (`uses_blas`) lets
it use the budget. The BLAS limit in force when a call
starts is a cap (OPENBLAS_NUM_THREADS, a user's `threadpool_limits`), and it is put back when the call
returns.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import threadpoolctl

from opport.backends.cpu import _heap
from opport.dtypes import acc_of
from opport.errors import ArgumentError

BLOCK_ELEMS = 1 << 18  # elements per block: 1 MiB per float32 temporary, a few MiB per block
PARALLEL_MIN = 1 << 18  # below this many elements the hand-off to a pool thread (~60 us measured) costs
# about what it saves
GUEST_PARALLEL_MIN = 1 << 24  # PARALLEL_MIN as torch's guest (`guest`): torch's OpenMP workers spin on the other cores
# for a few ms after each torch op, so the pool's threads gained nothing below this (gelu 256 x 14336 right after a
# torch matmul, 2 threads: 3.4 ms against 3.2 inline; a tiny Llama's swiglu fwd + bwd: 1.4 against 1.2)
BLAS_INLINE = 1 << 18  # a GEMM of at most this many multiply-adds (M*N*K) runs on the calling thread in OpenBLAS
# whatever its thread limit (65536 * GEMM_MULTITHREAD_THRESHOLD, 4 by default): such calls skip the limiter

_ACC_SELF = (np.dtype(np.float32), np.dtype(np.float64))  # dtypes that compute in themselves
_heap.keep()  # once a process, when the kernels load: the temporaries' pages stay mapped (_heap.py)
_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)
# Every float16 as float32, exactly (NaN payloads too): a 256 KiB table that stays in L2. Looking it up
# is 2x NumPy's own float16 -> float32 cast here (0.8 vs 1.6 ns/element; no F16C path in that cast).
_F16_TO_F32 = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
_pool: tuple | None = None  # (pid, workers, executor): a forked child must not use its parent's dead threads
_pool_lock = threading.Lock()
class _Inside(threading.local):
    on = False  # a class default: getattr with a default on a thread-local costs 0.3 us, this 0.03
    pooled = False  # on while the share belongs to a call that split over the pool (inline calls: off)
    guest = False  # on while a kernel runs on torch's tensors with torch's pool of several threads (`guest`)


_inside = _Inside()  # on while a thread runs a share: a nested call must not wait on the pool


def upcast(a: np.ndarray) -> np.ndarray:
    """`a` in its accumulation dtype (float32 for 16-bit inputs, float64 stays float64), C-contiguous.

    Contiguous so that NumPy's pairwise sums run in the same order whatever the input's layout:
    a transposed or sliced input then gives bitwise the same result as its contiguous copy.
    """
    if a.dtype in _ACC_SELF and a.flags.c_contiguous:  # the common case, without asarray's overhead
        return a
    if a.dtype == _F16:
        return _F16_TO_F32.take(a.view(np.uint16), mode="clip")  # C-contiguous, shaped like a
    return np.asarray(a, dtype=acc_of(a.dtype), order="C")


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
    """Threads the cpu kernels use in all, opport's pool and BLAS together: `OPPORT_NUM_THREADS`, else the
    CPUs this process may run on.

    Read on every kernel call, whatever its size (a bad value must not pass for small inputs and fail for
    large ones); a value other than a positive integer is an ArgumentError naming the variable.
    """
    raw = _ENV.get(_ENV_KEY) if _ENV is not None else os.environ.get("OPPORT_NUM_THREADS")
    if raw:
        n = _parsed.get(raw)
        if n is not None:
            return n
        env = (os.environ.decodevalue(raw) if _ENV is not None else raw).strip()
        if env:
            if not env.isdigit() or int(env) < 1:
                raise ArgumentError(op="cpu", arg="OPPORT_NUM_THREADS", constraint="cpu.num_threads",
                                    expected="a positive integer (unset it to use every CPU)", got=repr(env))
            _parsed[raw] = int(env)
            return _parsed[raw]
    return _cpus()


def _cpus() -> int:
    """The CPUs this process may run on, read again at most once a second: os.sched_getaffinity is a system call
    (2-6 us on the 2-core VM, more than a decode-sized kernel), so reading it on every kernel call cost users without
    OPPORT_NUM_THREADS most of a small call's time. An affinity changed at run time (taskset, os.sched_setaffinity)
    is seen within a second; a forked child starts with its parent's count, which is its own affinity too."""
    now = _clock()
    if now - _affinity[0] >= 1.0:
        _affinity[:] = now, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return _affinity[1]


_affinity = [float("-inf"), 1]  # [when read (_clock), count]; one slice assignment replaces both
_clock = time.monotonic
# num_threads runs on every kernel call: os.environ.get of an unset variable costs 1.1 us (two KeyErrors inside),
# a look-up in os.environ's own dict 0.03 us (CPython keeps it in sync with os.environ; plain get elsewhere)
_ENV = getattr(os.environ, "_data", None) if hasattr(os.environ, "encodekey") and hasattr(os.environ, "decodevalue") else None
_ENV_KEY = os.environ.encodekey("OPPORT_NUM_THREADS") if _ENV is not None else None
_parsed: dict = {}  # raw OPPORT_NUM_THREADS values already validated -> thread count


class _BlasLimit:
    """opport's hold on the BLAS thread limit, through threadpoolctl.

    OpenBLAS's limit (pthreads build, NumPy's wheels) is one process-wide setting, so every kernel call that
    limits it goes through here: the calls inside at once (threads, nesting) each ask for a limit and BLAS
    gets the smallest, capped by the limits in force when the first of them started (OPENBLAS_NUM_THREADS,
    a user's `threadpool_limits`); the last to leave puts those back. Only changes touch the library:
    an enter/exit pair costs about 1.7 us when the limit stays, 3.3 us when it changes and changes back.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.libs = None  # found on first use: NumPy's BLAS is loaded by then
        self.wants, self.saved, self.applied = [], None, None

    def _find(self) -> None:
        with self.lock:
            if self.libs is None:
                self.libs = [lib for lib in threadpoolctl.ThreadpoolController().select(user_api="blas").lib_controllers
                             if lib.num_threads is not None]

    def found_more(self) -> None:
        """Take in the BLAS libraries loaded since `_find` (scipy's OpenBLAS, which numba's products call, loads when
        they first compile): a call in progress applies its limit to them at once."""
        libs = [lib for lib in threadpoolctl.ThreadpoolController().select(user_api="blas").lib_controllers
                if lib.num_threads is not None]
        with self.lock:
            known = {lib.filepath for lib in self.libs or ()}
            new = [lib for lib in libs if lib.filepath not in known]
            if self.libs is None or not new:
                return
            self.libs = self.libs + new
            if self.wants:
                limits = [lib.num_threads for lib in new]
                self.saved, self.applied = self.saved + limits, self.applied + limits
                self._apply()

    def forked(self) -> None:
        """In a child forked while a call held BLAS's limit (possibly in another thread, which the child lacks):
        a fresh lock, and the user's limits back."""
        self.lock = threading.Lock()
        if self.saved is not None:
            self._set(self.libs, self.saved)
        self.wants, self.saved, self.applied = [], None, None

    @staticmethod
    def _set(libs, limits) -> None:
        for lib, n in zip(libs, limits):
            # threadpoolctl 3.8's set_num_threads lets one Python thread at a time change pthreads OpenBLAS's
            # shared limit and silently ignores the others; opport's calls already take turns under self.lock
            # and the last one out must be able to restore, so they use the setter under it (0.35 us, not 1.1
            # with the ownership bookkeeping). Older threadpoolctl: set_num_threads is that setter.
            getattr(lib, "_real_set_num_threads", lib.set_num_threads)(n)

    def enter(self, n: int) -> None:
        if self.libs is None:
            self._find()
        with self.lock:
            if not self.wants:
                self.saved = self.applied = [lib.num_threads for lib in self.libs]
            self.wants.append(n)
            try:
                self._apply()
            except BaseException:
                self.wants.remove(n)
                raise

    def exit(self, n: int) -> None:
        with self.lock:
            self.wants.remove(n)
            self._apply()
            if not self.wants:
                self.saved = self.applied = None

    def _apply(self) -> None:
        want = min(self.wants) if self.wants else None
        target = [s if want is None else min(s, want) for s in self.saved]
        if target != self.applied:
            self._set(self.libs, target)
            self.applied = target


_blas = _BlasLimit()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_blas.forked)


def blas_loaded() -> None:
    """A BLAS library may have loaded since the first kernel call: put it under opport's limit too."""
    _blas.found_more()


def blas_limit() -> int | None:
    """The BLAS thread limit in force now (the smallest over NumPy's BLAS libraries), None where threadpoolctl
    finds none it can control; `opport bench` records it."""
    if _blas.libs is None:
        _blas._find()
    return min((lib.num_threads for lib in _blas.libs), default=None)


class blas_threads:
    """`with blas_threads(n):` BLAS calls made inside use at most n threads (and at most the limit in force
    when the outermost opport call started); the limits are put back on the way out. n = 0: no limit."""

    __slots__ = ("n",)

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        if self.n:
            _blas.enter(self.n)
        return self

    def __exit__(self, *exc):
        if self.n:
            _blas.exit(self.n)


def uses_blas(work=None):
    """Decorator for a kernel that calls BLAS on the whole problem (not split over opport's pool): BLAS gets
    the budget, `num_threads()`, for the call, or 1 thread when called from a share of `parallel_rows` (the
    pool has the budget). `work(*args)` (optional) counts the call's multiply-adds: at most BLAS_INLINE and
    the limiter is skipped (OpenBLAS runs such a GEMM on the calling thread anyway).
    """

    def wrap(fn):
        @functools.wraps(fn)
        def kernel(*args, **kwargs):
            n = num_threads()  # validated on every call, small ones too
            if work is not None and work(*args, **kwargs) <= BLAS_INLINE:
                return fn(*args, **kwargs)
            if _inside.pooled or _inside.guest:
                n = 1
            _blas.enter(n)
            try:
                return fn(*args, **kwargs)
            finally:
                _blas.exit(n)

        return kernel

    return wrap


def guest(kind: str):
    """The cpu backend's `Backend.guest`: for kernels called on torch tensors, a wrapper that holds BLAS to 1 thread
    while torch's intra-op pool has several (docs/cpu.md, Threads). torch's OpenMP workers busy-wait for a while
    after each of torch's ops and OpenBLAS's after each of its calls (about 0.1 s), each set on the cores the other
    needs next: with both at 2 threads a tiny Llama's training step took 140 ms against 59 ms with BLAS at 1."""
    if kind != "torch":
        return None
    import torch

    torch_threads = torch.get_num_threads
    _torch[:] = [torch]

    def wrap(fn):
        @functools.wraps(fn)
        def run(*args):
            if _inside.guest or torch_threads() <= 1:
                return fn(*args)
            _inside.guest = True
            try:
                return fn(*args)
            finally:
                _inside.guest = False

        return run

    return wrap


_torch: list = []  # [the torch module] once the dispatcher has wrapped a kernel for torch's tensors (`guest`)
# [a function returning the native extension's run_tasks, or None]: set by opport.integrations.torch at import
POOL_TASKS: list = []


def pool_tasks():
    """`run_tasks(fn, n, ints, floats)` of the native extension (tasks spread over torch's intra-op pool), for a
    kernel running as torch's guest with a budget of several threads; else None (the caller runs its tasks itself)."""
    if not (_inside.guest and POOL_TASKS and num_threads() > 1):
        return None
    return POOL_TASKS[0]()
GUEST_GEMM_MIN = 1 << 20  # multiply-adds per matrix from which a guest's product goes to torch's pool


def gemm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """np.matmul(a, b) for same-dtype float operands. In a kernel running as torch's guest (torch's intra-op pool
    has several threads: `guest`) with a budget of several threads, a product whose matrices take at least
    GUEST_GEMM_MIN multiply-adds each runs as torch.matmul on the same memory, on torch's pool: BLAS is held to one
    thread there so as not to fight that pool for the cores, and torch's GEMM uses all of them (the tiny Llama's
    LM-head loss, fwd + bwd 512 x 256 x 2048 at 2 threads, a torch op before each call: 20.6 -> 12.9 ms). Batches
    of small matrices stay with NumPy: torch's threads did not pay there ([8, 64, 64] @ [8, 64, 128] fwd + bwd: 1.77
    against 1.84 ms; attention's blocks are such batches, and opport.attention ran slower with them in a model,
    q [4, 4, 128, 64] 7.1 against 5.9 ms, so attention keeps np.matmul), nor do operands torch cannot view
    (read-only, negative strides). Bits: those of another GEMM, as BLAS's own thread count may change them."""
    if _guest_gemm(a, b):
        torch = _torch[0]
        return torch.matmul(torch.from_numpy(a), torch.from_numpy(b)).numpy()
    return np.matmul(a, b)


def _guest_gemm(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether `gemm` runs this product on torch's pool (its docstring says when)."""
    return (_inside.guest and a.dtype == b.dtype and a.shape[-2] * a.shape[-1] * b.shape[-1] >= GUEST_GEMM_MIN
            and num_threads() > 1 and a.flags.writeable and b.flags.writeable
            and min(a.strides + b.strides, default=0) >= 0)


def gemm_add(out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """out += a @ b, where `gemm` would send the product to torch's pool as one addmm_ into out's memory (BLAS adds
    out in its kernel: no temporary, no second pass over out); else out += gemm(a, b)."""
    if _guest_gemm(a, b) and out.dtype == a.dtype and out.flags.c_contiguous and out.flags.writeable:
        torch = _torch[0]
        torch.from_numpy(out).addmm_(torch.from_numpy(a), torch.from_numpy(b))
    else:
        out += gemm(a, b)


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


def one_block(x2: np.ndarray) -> bool:
    """Whether `parallel_rows` would run the float32 rows `x2` as one block on the calling thread: a kernel's fused
    loop may then run on them directly, the same call on the same rows (the budget validated as parallel_rows does).
    Saves the block machinery's fixed cost, most of a decode step's time (layernorm 1 x 4096: about 7 of 13 us
    backward; rmsnorm 1 x 256: about 9 of 12 us forward)."""
    rows, n = x2.shape
    if x2.dtype != _F32 or not x2.flags.c_contiguous or x2.size >= PARALLEL_MIN or rows > block_rows(n):
        return False
    num_threads()
    return True


def parallel_rows(n_rows: int, row_elems: int, body, blas: bool = False) -> None:
    """Call `body(rows)` for row slices covering [0, n_rows), in blocks of `block_rows(row_elems)` rows.

    Inputs of at least PARALLEL_MIN elements (GUEST_PARALLEL_MIN as torch's guest) are split into one contiguous
    range of rows per thread, at most
    `num_threads()` threads and one per block (the caller's thread takes the first range); smaller ones, and a
    call from inside a share, run inline on the calling thread without touching the pool or BLAS's limit.
    `blas=True` says that `body` calls BLAS itself: while the pool runs, BLAS is then held to 1 thread, once
    for the call (the budget is spent on the pool); a `uses_blas` kernel called from a share does that itself.
    `body` must only write the output rows it is given. The blocks lie on a fixed grid (block i
    is rows [i * step, (i + 1) * step)) whatever the thread count, so a kernel that reduces over rows can
    keep one partial result per block (index rows.start // step) and sum them in order: bitwise the same
    for any thread count. NumPy floating-point warnings are off inside: the kernels define their
    overflow, inf and NaN results themselves.
    """
    step = block_rows(row_elems)
    nested = _inside.on
    wanted = num_threads()  # validated on every call, small ones too
    least = GUEST_PARALLEL_MIN if _inside.guest else PARALLEL_MIN
    threads = 1 if nested or n_rows * row_elems < least else min(wanted, -(-n_rows // step))
    outer = (nested, _inside.pooled)  # the workers run only when not nested, and their state is outer's then
    pooled = outer[1] or threads > 1

    def run(lo: int, hi: int) -> None:
        _inside.on, _inside.pooled = True, pooled
        try:
            with np.errstate(all="ignore"):  # per thread: NumPy's error state is thread-local
                for start in range(lo, hi, step):
                    body(slice(start, min(start + step, hi)))
        finally:
            _inside.on, _inside.pooled = outer

    if threads <= 1:
        return run(0, n_rows)
    bounds = [min(n_rows, -(-(n_rows * i // threads) // step) * step) for i in range(threads + 1)]  # on the grid
    pool = _executor(threads - 1)
    with blas_threads(1 if blas else 0):  # once per call, not per block: BLAS in the shares on the share's thread
        futures = [pool.submit(run, bounds[i], bounds[i + 1]) for i in range(1, threads) if bounds[i] < bounds[i + 1]]
        try:
            run(bounds[0], bounds[1])
        finally:
            for f in futures:
                f.result()  # re-raises a worker's exception; waits for all before the output is used
