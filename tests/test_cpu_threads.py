"""One thread budget for the cpu backend (docs/cpu.md, "Threads"): OPPORT_NUM_THREADS is shared between opport's
pool and the BLAS under the kernels. Structure only: which BLAS limit threadpoolctl sees inside a kernel, which
threads run, and that the caller's limit is back afterwards. No timings (those belong to `opport bench`)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from threadpoolctl import ThreadpoolController, threadpool_limits

import opport
import opport.backends.cpu._common as common
from opport.backends.cpu.attention import attention as attention_kernel
from opport.backends.cpu.matmul import matmul as matmul_kernel
from opport.backends.cpu.matmul import matmul_backward as matmul_backward_kernel


def blas_limit() -> int:
    """BLAS's thread limit as threadpoolctl reports it (a fresh controller: not opport's own handles)."""
    return min(lib["num_threads"] for lib in ThreadpoolController().select(user_api="blas").info())


pytestmark = pytest.mark.skipif(not ThreadpoolController().select(user_api="blas").lib_controllers,
                                reason="no BLAS that threadpoolctl can limit")


@pytest.fixture
def spy(monkeypatch):
    """Every np.matmul records (thread, BLAS limit) before it runs."""
    seen, real = [], np.matmul

    def matmul(*args, **kwargs):
        seen.append((threading.get_ident(), blas_limit()))
        return real(*args, **kwargs)

    monkeypatch.setattr(np, "matmul", matmul)
    return seen


def _ab(m=96, k=80, n=64):  # 491,520 multiply-adds: above BLAS_INLINE, the limiter runs
    rng = np.random.default_rng(0)
    return rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)


def test_sizes_used_here_reach_the_limiter():
    a, b = _ab()
    assert a.shape[0] * a.shape[1] * b.shape[1] > common.BLAS_INLINE


@pytest.mark.parametrize("budget", [1, 2])
def test_a_whole_problem_blas_kernel_gives_blas_the_budget_and_restores_the_callers_limit(monkeypatch, spy, budget):
    monkeypatch.setenv("OPPORT_NUM_THREADS", str(budget))
    a, b = _ab()
    with threadpool_limits(limits=2, user_api="blas"):  # the caller's limit, whatever this machine's default
        matmul_kernel(a, b, None)
        matmul_backward_kernel(np.ones((96, 64), np.float32), a, b, None)
        assert blas_limit() == 2  # back after each call
    assert [lim for _, lim in spy] == [budget] * 3  # forward: 1 product; backward: 2
    q = np.ones((1, 2, 128, 16), np.float64)  # 2 x 128 x 128 x 32 multiply-adds: above BLAS_INLINE, limited
    spy.clear()
    with threadpool_limits(limits=2, user_api="blas"):
        attention_kernel(q, q, q, False, None)
        assert blas_limit() == 2
    assert spy and {lim for _, lim in spy} == {budget}
    # float32: the compiled tasks, whose products call numba's BLAS (scipy's OpenBLAS, loaded when they compile)
    from opport.backends.cpu import _attn_tasks as tasks

    if not tasks._fused.enabled():
        return  # (numba absent or OPPORT_NUMBA=0: the blocks above are the whole story)
    seen, real = [], tasks.compiled
    monkeypatch.setattr(tasks, "compiled", lambda: (real(), seen.append(blas_limit()))[0])
    with threadpool_limits(limits=2, user_api="blas"):
        attention_kernel(q.astype(np.float32), q.astype(np.float32), q.astype(np.float32), False, None)
        assert blas_limit() == 2
    assert seen == [budget]


def test_the_callers_blas_limit_is_a_cap_not_raised(monkeypatch, spy):
    """A user's threadpool_limits (or OPENBLAS_NUM_THREADS) around opport calls is respected: BLAS gets
    min(budget, the limit in force), and that limit is what the caller finds afterwards."""
    monkeypatch.setenv("OPPORT_NUM_THREADS", "2")
    a, b = _ab()
    before = blas_limit()
    with threadpool_limits(limits=1, user_api="blas"):
        out = opport.matmul(a, b, backend="cpu")
        assert blas_limit() == 1
    assert blas_limit() == before
    assert [lim for _, lim in spy] == [1]
    np.testing.assert_allclose(out, a @ b, rtol=1e-5, atol=1e-5)


def test_pool_shares_run_blas_on_one_thread_set_once_per_call(monkeypatch):
    """parallel_rows(blas=True) holds BLAS to 1 thread while its shares run (the pool has the budget): one limit
    change for the call, not one per block; a uses_blas kernel called from a share does the same."""
    monkeypatch.setenv("OPPORT_NUM_THREADS", "2")
    monkeypatch.setattr(common, "PARALLEL_MIN", 0)
    monkeypatch.setattr(common, "BLOCK_ELEMS", 1)
    changes = []
    real_set = common._BlasLimit._set
    monkeypatch.setattr(common._BlasLimit, "_set", staticmethod(lambda libs, lims: (changes.append(lims),
                                                                                    real_set(libs, lims))))
    a, b = _ab()
    seen = []

    def body(rows):
        seen.append((threading.get_ident(), blas_limit(), "direct"))
        np.matmul(a, b)
        seen.append((threading.get_ident(), blas_limit(), "kernel"))
        matmul_kernel(a, b, None)

    with threadpool_limits(limits=2, user_api="blas"):
        common.parallel_rows(8, 1, body, blas=True)
        assert blas_limit() == 2
        assert len({t for t, _, _ in seen}) == 2  # the caller and one pool thread
        assert {lim for _, lim, _ in seen} == {1}
        k = len(common._blas.libs)  # the BLAS libraries loaded when opport first looked (NumPy's; SciPy's, torch's...)
        assert changes == [[1] * k, [2] * k]  # 8 blocks, 8 kernel calls inside: one change in, one back
        seen.clear()
        changes.clear()
        common.parallel_rows(8, 1, lambda rows: seen.append(blas_limit()))
        assert blas_limit() == 2
    assert seen == [2] * 8 and changes == []  # blas=False (the row kernels): the pool run leaves BLAS alone ...


def test_a_blas_kernel_called_from_a_share_uses_one_blas_thread(monkeypatch, spy):
    monkeypatch.setenv("OPPORT_NUM_THREADS", "2")
    monkeypatch.setattr(common, "PARALLEL_MIN", 0)
    monkeypatch.setattr(common, "BLOCK_ELEMS", 1)
    a, b = _ab()
    with threadpool_limits(limits=2, user_api="blas"):
        common.parallel_rows(4, 1, lambda rows: matmul_kernel(a, b, None))  # ... but a kernel inside holds it to 1
        assert blas_limit() == 2
        assert len(spy) == 4 and {lim for _, lim in spy} == {1}
        spy.clear()
        monkeypatch.setattr(common, "PARALLEL_MIN", 1 << 18)  # a call that runs inline: no pool, BLAS has the budget
        common.parallel_rows(4, 1, lambda rows: common.parallel_rows(4, 1, lambda r: matmul_kernel(a, b, None)))
        assert blas_limit() == 2
    assert len(spy) == 16 and {lim for _, lim in spy} == {2} and {t for t, _ in spy} == {threading.get_ident()}


def test_one_thread_in_all(monkeypatch, spy):
    """OPPORT_NUM_THREADS=1: no pool thread wakes and BLAS runs on one thread, in every kind of kernel."""
    monkeypatch.setenv("OPPORT_NUM_THREADS", "1")
    monkeypatch.setattr(common, "_executor", lambda workers: pytest.fail("the pool was used"))
    x = np.random.default_rng(1).standard_normal((600, 1024)).astype(np.float32)  # 2.4x PARALLEL_MIN
    assert x.size >= common.PARALLEL_MIN
    ran_on = set()
    common.parallel_rows(600, 1024, lambda rows: ran_on.add(threading.get_ident()), blas=True)
    assert ran_on == {threading.get_ident()}
    opport.rmsnorm(x, None, backend="cpu")
    opport.softmax(x, backend="cpu")
    a, b = _ab()
    q = np.ones((1, 2, 128, 16), np.float32)  # above BLAS_INLINE
    with threadpool_limits(limits=2, user_api="blas"):
        matmul_kernel(a, b, None)
        attention_kernel(q, q, q, True, None)
    assert spy and {t for t, _ in spy} == {threading.get_ident()} and {lim for _, lim in spy} == {1}


def test_small_calls_run_inline_and_leave_blas_alone(monkeypatch):
    """Below PARALLEL_MIN elements parallel_rows runs on the calling thread; a matmul of at most BLAS_INLINE
    multiply-adds does not touch BLAS's limit (OpenBLAS runs it on the calling thread anyway)."""
    monkeypatch.setenv("OPPORT_NUM_THREADS", "4")
    monkeypatch.setattr(common, "_executor", lambda workers: pytest.fail("the pool was used"))
    monkeypatch.setattr(common._blas, "enter", lambda n: pytest.fail("BLAS's limit was touched"))
    ran_on = set()
    common.parallel_rows(64, 1024, lambda rows: ran_on.add(threading.get_ident()), blas=True)  # 65536 elements
    assert ran_on == {threading.get_ident()}
    a = np.ones((64, 64), np.float32)  # 262,144 multiply-adds = BLAS_INLINE
    np.testing.assert_array_equal(opport.matmul(a, a, backend="cpu"), np.full((64, 64), 64, np.float32))
    opport.rmsnorm(np.ones((8, 64), np.float32), None, backend="cpu")
    q = np.ones((1, 4, 1, 64), np.float32)  # a decode step: 4 x 1 x 512 x 128 = 262,144 multiply-adds
    kv = np.ones((1, 2, 512, 64), np.float32)
    np.testing.assert_allclose(opport.attention(q, kv, kv, causal=True, backend="cpu"), np.ones((1, 4, 1, 64)))


def test_a_bad_budget_fails_small_matmuls_too(monkeypatch):
    monkeypatch.setenv("OPPORT_NUM_THREADS", "0")
    with pytest.raises(ValueError, match="OPPORT_NUM_THREADS"):
        opport.matmul(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32), backend="cpu")


def test_the_pool_wakes_at_most_one_thread_per_block(monkeypatch):
    monkeypatch.setenv("OPPORT_NUM_THREADS", "8")
    workers = []
    real = common._executor
    monkeypatch.setattr(common, "_executor", lambda n: (workers.append(n), real(n))[1])
    common.parallel_rows(3 * common.BLOCK_ELEMS // 1024, 1024, lambda rows: None)  # 3 blocks
    assert workers == [2]


def test_nested_and_concurrent_calls_put_the_callers_limit_back(monkeypatch):
    """Calls from several user threads at once (and nested ones) take turns on the process-wide limit: BLAS gets
    the smallest limit asked for, and the caller's is back once the last call returns. Results match a serial run."""
    monkeypatch.setenv("OPPORT_NUM_THREADS", "1")
    a, b = _ab()
    with threadpool_limits(limits=2, user_api="blas"):
        common._blas.enter(2)
        assert blas_limit() == 2
        common._blas.enter(1)
        assert blas_limit() == 1
        common._blas.exit(1)
        assert blas_limit() == 2
        common._blas.exit(2)
        assert blas_limit() == 2
        serial = matmul_kernel(a, b, None)
        errors, barrier = [], threading.Barrier(4)

        def worker():
            try:
                barrier.wait()
                for _ in range(50):
                    np.testing.assert_array_equal(matmul_kernel(a, b, None), serial)
            except Exception as e:  # asserted below
                errors.append(e)

        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[:2]
        assert blas_limit() == 2
        assert common._blas.wants == [] and common._blas.saved is None


def _report_limit(q):
    q.put(blas_limit())


@pytest.mark.timeout(120)
def test_a_child_forked_during_a_limited_call_starts_with_the_callers_limit():
    import multiprocessing

    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork on this platform")
    ctx = multiprocessing.get_context("fork")
    with threadpool_limits(limits=2, user_api="blas"):
        common._blas.enter(1)  # as a kernel in another thread would be, at the moment of the fork
        try:
            assert blas_limit() == 1
            q = ctx.Queue()
            p = ctx.Process(target=_report_limit, args=(q,))
            p.start()
            got = q.get(timeout=60)
            p.join(60)
        finally:
            common._blas.exit(1)
        assert p.exitcode == 0 and got == 2
        assert blas_limit() == 2


def test_torch_tensors_run_blas_on_one_thread_while_torchs_pool_has_several(monkeypatch, spy):
    """On torch tensors a BLAS kernel holds BLAS to 1 thread while torch's intra-op pool has several (their busy-waiting
    workers fight for the same cores: docs/cpu.md, Threads); with torch on one thread BLAS gets the budget."""
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("OPPORT_NUM_THREADS", "2")
    a, b = (torch.from_numpy(m) for m in _ab())
    before = torch.get_num_threads()
    try:
        with threadpool_limits(limits=2, user_api="blas"):
            for torch_threads, want in ((2, 1), (1, 2)):
                torch.set_num_threads(torch_threads)
                spy.clear()
                out = opport.matmul(a, b, backend="cpu")
                assert [lim for _, lim in spy] == [want]
                assert blas_limit() == 2
    finally:
        torch.set_num_threads(before)
    np.testing.assert_allclose(out.numpy(), a.numpy() @ b.numpy(), rtol=1e-5, atol=1e-5)


def test_without_a_budget_the_affinity_is_read_at_most_once_a_second(monkeypatch):
    """os.sched_getaffinity is a system call: num_threads() reuses its count for a second, then sees a change."""
    monkeypatch.delenv("OPPORT_NUM_THREADS", raising=False)
    cpus, reads, now = [{0, 1, 2}], [], [1000.0]

    def affinity(pid):
        reads.append(pid)
        return cpus[0]

    monkeypatch.setattr(common.os, "sched_getaffinity", affinity, raising=False)
    monkeypatch.setattr(common, "_clock", lambda: now[0])
    monkeypatch.setattr(common, "_affinity", [float("-inf"), 1])
    assert common.num_threads() == 3 and len(reads) == 1
    cpus[0] = {0}
    now[0] += 0.5
    assert common.num_threads() == 3 and len(reads) == 1, "read again within the second"
    now[0] += 0.6
    assert common.num_threads() == 1 and len(reads) == 2, "a changed affinity not seen after a second"
    monkeypatch.setenv("OPPORT_NUM_THREADS", "2")
    assert common.num_threads() == 2 and len(reads) == 2, "the budget decides where it is set"


def test_a_guests_large_products_run_on_torchs_pool(monkeypatch, spy):
    """As torch's guest (torch's pool has several threads) with a budget of several, a product whose matrices take at
    least GUEST_GEMM_MIN multiply-adds each is torch.matmul on the same memory (torch's pool, all its threads: BLAS is
    held to one there); smaller products, batches of small matrices, a budget of 1, torch on one thread and NumPy's
    arrays stay with np.matmul."""
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("OPPORT_NUM_THREADS", "2")
    rng = np.random.default_rng(1)
    big = [rng.standard_normal(s).astype(np.float32) for s in ((256, 128), (128, 64))]  # 2M multiply-adds
    small = list(_ab())
    assert 256 * 128 * 64 >= common.GUEST_GEMM_MIN > 96 * 80 * 64
    seen, real = [], torch.matmul

    def torch_matmul(x, y):
        seen.append(tuple(x.shape))
        return real(x, y)

    monkeypatch.setattr(torch, "matmul", torch_matmul)
    before = torch.get_num_threads()
    try:
        for torch_threads, budget, arrays, on_torch in ((2, "2", big, True), (2, "2", small, False),
                                                        (2, "1", big, False), (1, "2", big, False)):
            torch.set_num_threads(torch_threads)
            monkeypatch.setenv("OPPORT_NUM_THREADS", budget)
            seen.clear(), spy.clear()
            out = opport.matmul(*(torch.from_numpy(m) for m in arrays), backend="cpu")
            assert (seen, len(spy)) == (([(256, 128)], 0) if on_torch else ([], 1)), (torch_threads, budget)
            np.testing.assert_allclose(out.numpy(), arrays[0] @ arrays[1], rtol=1e-5, atol=1e-4)
        torch.set_num_threads(2)
        monkeypatch.setenv("OPPORT_NUM_THREADS", "2")
        seen.clear(), spy.clear()
        batch = [rng.standard_normal(s).astype(np.float32) for s in ((8, 64, 64), (8, 64, 128))]  # 0.5M a matrix
        opport.matmul(*(torch.from_numpy(m) for m in batch), backend="cpu")
        assert (seen, len(spy)) == ([], 1)  # a batch of small matrices: torch's threads do not pay
        opport.matmul(*big, backend="cpu")  # NumPy's arrays: no guest
        assert seen == []
    finally:
        torch.set_num_threads(before)


def test_a_guests_product_of_arrays_torch_cannot_view_stays_with_numpy(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(common._inside, "guest", True)
    monkeypatch.setenv("OPPORT_NUM_THREADS", "2")
    common._torch[:] = [torch]
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((256, 128)).astype(np.float32), rng.standard_normal((128, 64)).astype(np.float32)
    ro = a.copy()
    ro.flags.writeable = False
    for x, y in ((ro, b), (a[::-1], b), (a, b.astype(np.float64))):  # read-only, negative strides, mixed dtypes
        np.testing.assert_array_equal(common.gemm(x, y), np.matmul(x, y))
    assert isinstance(common.gemm(a, b), np.ndarray)


@pytest.mark.parametrize("guest", [True, False])
def test_a_guests_accumulating_product_adds_in_place(monkeypatch, guest):
    """gemm_add: out += a @ b, as torch's guest one addmm_ into out's own memory (no temporary), else out += gemm;
    either way out holds the sum (within float32 rounding of the float64 one) and stays the same array."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(common._inside, "guest", guest)
    monkeypatch.setenv("OPPORT_NUM_THREADS", "2")
    common._torch[:] = [torch]
    addmm, real = [], torch.Tensor.addmm_
    monkeypatch.setattr(torch.Tensor, "addmm_", lambda t, x, y: addmm.append(1) or real(t, x, y))
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((128, 256)).astype(np.float32), rng.standard_normal((256, 64)).astype(np.float32)
    out = rng.standard_normal((512, 64)).astype(np.float32)
    want = out[100:228].astype(np.float64) + a.astype(np.float64) @ b.astype(np.float64)
    view = out[100:228]
    common.gemm_add(view, a.T.copy().T, b)  # (a transposed twice: a view torch reads with its strides)
    np.testing.assert_allclose(out[100:228], want, rtol=1e-5, atol=1e-4)
    assert addmm == ([1] if guest else [])


def test_a_guests_row_kernels_run_inline_below_the_guest_threshold(monkeypatch):
    """torch's OpenMP workers spin on the other cores for a few ms after each torch op: as its guest, a row kernel
    wakes opport's pool only from GUEST_PARALLEL_MIN elements (NumPy's arrays: from PARALLEL_MIN)."""
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("OPPORT_NUM_THREADS", "2")
    woken, real = [], common._executor

    def executor(workers):
        woken.append(workers)
        return real(workers)

    monkeypatch.setattr(common, "_executor", executor)
    x = np.random.default_rng(3).standard_normal((512, 1024)).astype(np.float32)  # 512K elements: above PARALLEL_MIN
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        out = opport.gelu(torch.from_numpy(x), backend="cpu")
        assert woken == []
        monkeypatch.setattr(common, "GUEST_PARALLEL_MIN", common.PARALLEL_MIN)
        np.testing.assert_array_equal(opport.gelu(torch.from_numpy(x), backend="cpu").numpy(), out.numpy())
        assert woken == [1]
        woken.clear()
        monkeypatch.setattr(common, "GUEST_PARALLEL_MIN", 1 << 24)
        np.testing.assert_array_equal(opport.gelu(x, backend="cpu"), out.numpy())  # NumPy's arrays: the pool
        assert woken == [1]
    finally:
        torch.set_num_threads(before)
