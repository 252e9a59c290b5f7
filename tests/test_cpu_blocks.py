"""The cpu backend's blocks and threads: results independent of the thread count and block size, the
activations' fast paths right over the whole float range, and the thread pool usable after a fork."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest

import opport
import opport.backends.cpu._common as common
from opport.ops import get_op
from tests.ops._check import assert_matches, cpu_kernel

ROW_OPS = ("rmsnorm", "layernorm", "softmax", "rope", "cross_entropy")
ELEMENTWISE = ("silu", "swiglu", "gelu")


def _large_inputs(op: str, rng) -> tuple:
    """Inputs of about 600K elements (above PARALLEL_MIN), with some NaN, inf and deep-tail values."""
    x = (rng.standard_normal((300, 2048)) * 4).astype(np.float32)
    x[7, 5], x[100, 9], x[250, 3], x[260, 1] = np.nan, -np.inf, np.inf, -120.0
    w = rng.standard_normal(2048).astype(np.float32)
    if op == "rmsnorm":
        return (x, w, 1e-6), {}
    if op == "layernorm":
        return (x, w, w, 1e-5), {}
    if op == "softmax":
        return (x, -1), {}
    if op == "rope":  # per-batch tables: blocks cover runs of whole batches and parts of one
        ang = rng.uniform(-10, 10, (4, 16, 64))
        return (x.reshape(4, 75, 16, 128), np.cos(ang), np.sin(ang), False), {}
    if op == "cross_entropy":
        return (x, rng.integers(0, 2048, 300), -100, "mean", 0.1), {}
    if op == "swiglu":
        return (x, (rng.standard_normal(x.shape) * 3).astype(np.float32)), {}
    if op == "gelu":
        return (x, "none"), {}
    return (x,), {}


def _with_threads(monkeypatch, op, args, threads: int, block: int):
    monkeypatch.setenv("OPPORT_NUM_THREADS", str(threads))
    monkeypatch.setattr(common, "BLOCK_ELEMS", block)
    return cpu_kernel(get_op(op))(*args)


@pytest.mark.parametrize("op", ROW_OPS + ELEMENTWISE)
def test_thread_count_and_block_size_do_not_change_a_bit(monkeypatch, op):
    args, _ = _large_inputs(op, np.random.default_rng(0))
    serial = _with_threads(monkeypatch, op, args, 1, 1 << 30)  # one block, the calling thread only
    for threads, block in ((2, common.BLOCK_ELEMS), (3, 5000)):
        out = _with_threads(monkeypatch, op, args, threads, block)
        np.testing.assert_array_equal(out, serial, err_msg=f"{op}: {threads} threads, blocks of {block}")


@pytest.mark.parametrize("op", ("silu", "swiglu", "gelu"))
@pytest.mark.parametrize("dtype", ("float32", "float64", "bfloat16"))
def test_fast_and_careful_blocks_mixed_match_reference(monkeypatch, op, dtype):
    """Blocks of 64 elements over the op's fixed cases: some blocks take the fast path, their
    neighbours (holding NaN, -inf or deep tails) the careful one; every case still matches."""
    monkeypatch.setattr(common, "BLOCK_ELEMS", 64)
    monkeypatch.setattr(common, "PARALLEL_MIN", 0)
    spec = get_op(op)
    for case in spec.get_cases(dtype):
        out = cpu_kernel(spec)(*spec.bind(*case.args, **case.kwargs))
        assert_matches(spec, case, dtype, out, signed_zero=True)


@pytest.mark.parametrize("dtype", ("float32", "float64"))
@pytest.mark.parametrize("op", ("silu", "swiglu", "gelu_tanh"))
def test_fast_path_over_the_finite_range(op, dtype):
    """2^18 finite values, log-uniform magnitudes from 1e-30 to 1e4 of both signs, no NaN or inf: the
    blocks that stay on the fast path (exp(-x) finite) must meet the op's tolerance everywhere."""
    rng = np.random.default_rng(5)
    mag = np.exp(rng.uniform(np.log(1e-30), np.log(1e4), 1 << 18))
    x = (mag * rng.choice([-1.0, 1.0], mag.size)).astype(dtype)
    x[np.abs(x) > 80] = 80.0  # keep exp(-x) finite so that every block is a fast-path block
    name, kwargs = ("gelu", {"approximate": "tanh"}) if op == "gelu_tanh" else (op, {})
    if op == "gelu_tanh":
        x[x < -9] = -9.0  # exp(-2u) must stay finite too
    args = (x, (rng.standard_normal(x.size) * 1e3).astype(dtype)) if op == "swiglu" else (x,)
    spec = get_op(name)
    case = opport.spec.Case("finite-range", args, kwargs)
    out = cpu_kernel(spec)(*spec.bind(*args, **kwargs))
    assert_matches(spec, case, dtype, out, signed_zero=True)


def _child(q):
    x = np.random.default_rng(1).standard_normal((400, 1024)).astype(np.float32)
    q.put(opport.rmsnorm(x, None, backend="cpu").sum())


@pytest.mark.timeout(120)
def test_pool_works_in_a_forked_child(monkeypatch):
    """A child forked after the pool started must build its own (the parent's threads do not exist there)."""
    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork on this platform")
    monkeypatch.setenv("OPPORT_NUM_THREADS", "2")
    x = np.random.default_rng(1).standard_normal((400, 1024)).astype(np.float32)
    expected = opport.rmsnorm(x, None, backend="cpu").sum()  # starts the pool here
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    got = q.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0 and got == expected


@pytest.mark.timeout(60)
def test_nested_parallel_rows_runs_inline(monkeypatch):
    """A body that itself calls parallel_rows (e.g. a kernel calling another) must not wait on the pool
    it is running on: the inner call runs in its own thread."""
    monkeypatch.setenv("OPPORT_NUM_THREADS", "2")
    monkeypatch.setattr(common, "PARALLEL_MIN", 0)
    monkeypatch.setattr(common, "BLOCK_ELEMS", 1)
    seen = np.zeros((4, 4), int)

    def outer(rows):
        def inner(cols):
            seen[rows, cols] += 1
        common.parallel_rows(4, 1, inner)

    common.parallel_rows(4, 1, outer)
    assert (seen == 1).all()


def test_bad_thread_count_is_a_clear_error(monkeypatch):
    for bad in ("0", "-2", "auto"):
        monkeypatch.setenv("OPPORT_NUM_THREADS", bad)
        with pytest.raises(ValueError, match="OPPORT_NUM_THREADS"):
            common.num_threads()
    monkeypatch.setenv("OPPORT_NUM_THREADS", "3")
    assert common.num_threads() == 3


def test_float16_conversions_are_numpys_bit_for_bit():
    """upcast's table lookup and f16_bits' integer rounding against NumPy's own float16 casts: every
    float16, 2^20 random float32 bit patterns, and the rounding boundaries (the whole float32 range was
    checked once, 2026-11-29: 0 mismatches). NaN only has to stay NaN."""
    every = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    assert np.array_equal(common.upcast(every).view(np.uint32), every.astype(np.float32).view(np.uint32))
    t = every.reshape(256, 256).T  # a strided view: C-contiguous out, same bits
    assert np.array_equal(common.upcast(t).view(np.uint32), t.astype(np.float32).view(np.uint32))
    assert common.upcast(t).flags.c_contiguous
    bits = np.random.default_rng(7).integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    edges = np.array([65504, 65519.996, 65520, 65535, 65536, 2.0**-14, 2.0**-24, 2.0**-25, 1.5 * 2.0**-25,
                      2.0**-26, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 0.0, np.inf], np.float32)
    edges = np.concatenate([edges, np.nextafter(edges, np.float32(np.inf)), np.nextafter(edges, np.float32(0))])
    x = np.concatenate([bits.view(np.float32), edges, -edges])
    with np.errstate(all="ignore"):
        want = x.astype(np.float16).view(np.uint16)
        got = common.f16_bits(x)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], want[~nan])
    assert np.isnan(got[nan].view(np.float16)).all()


@pytest.mark.parametrize("op", [n for n in ROW_OPS + ELEMENTWISE if get_op(n).backward_op is not None])
def test_backward_thread_count_does_not_change_a_bit(monkeypatch, op):
    """Backward kernels: the same bits for 1, 2 or 3 threads (row-summed gradients add one partial per block,
    on a grid that does not move with the thread count)."""
    from opport.dispatch import get_backend, kernels

    spec = get_op(op)
    args, _ = _large_inputs(op, np.random.default_rng(1))
    bound = spec.bind(*args)
    case = spec.backward_op.from_forward(opport.spec.Case("large", bound), "float32")
    kernel = kernels(spec.backward_op, get_backend("cpu"))[0].fn
    runs = []
    for threads in (1, 2, 3):
        monkeypatch.setenv("OPPORT_NUM_THREADS", str(threads))
        runs.append(kernel(*case.args))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            if a is not None:
                np.testing.assert_array_equal(a, b, err_msg=f"{op} backward: thread count changed the result")
