"""cross_entropy: the cpu kernel against the float64 reference and torch, exact semantics, and its memory bound."""

import tracemalloc
from functools import partial

import numpy as np
import pytest

import opport
import opport.backends.cpu._common as cpu_common
import opport.backends.cpu.cross_entropy as cpu_ce
from opport.backends.cpu.cross_entropy import cross_entropy as kernel
from opport.casegen import cast
from opport.dispatch.adapters import NumpyAdapter
from opport.ops.cross_entropy import cross_entropy as spec
from tests.ops import _check

DTYPES = ("float32", "float16", "bfloat16", "float64")


assert_matches = partial(_check.assert_matches, spec)


def run(case):
    return kernel(*spec.bind(*case.args, **case.kwargs))


def ce(x, t, **kw):
    return kernel(*spec.bind(x, t, **kw))


test_fixed_cases = _check.fixed_cases_test(spec, signed_zero=False)
test_hypothesis_cases = _check.hypothesis_test(spec, signed_zero=False)


@pytest.mark.parametrize("reduction", ("none", "sum", "mean"))
@pytest.mark.parametrize("smoothing", (0.0, 0.2))
@pytest.mark.parametrize("ignore_index", (-100, 4))
def test_matches_torch(reduction, smoothing, ignore_index):
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(0)
    x = rng.standard_normal((9, 37)) * 3
    t = rng.integers(0, 37, 9)
    t[[1, 6]] = ignore_index
    t[2] = 4  # ignored when ignore_index == 4 (a valid class id)
    ref = F.cross_entropy(torch.from_numpy(x), torch.from_numpy(t), ignore_index=ignore_index, reduction=reduction,
                          label_smoothing=smoothing).numpy()
    out = ce(x.astype(np.float32), t, ignore_index=ignore_index, reduction=reduction, label_smoothing=smoothing)
    assert out.dtype == np.float32 and out.shape == ref.shape
    assert np.allclose(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduction_shapes_and_float32_output(dtype):
    x, t = cast(np.zeros((3, 5)), dtype), np.array([0, 1, 2])
    for reduction, shape in (("none", (3,)), ("sum", ()), ("mean", ())):
        out = ce(x, t, reduction=reduction)
        assert isinstance(out, np.ndarray) and out.shape == shape and out.dtype == np.float32
        assert np.allclose(out, np.log(5) * (3 if reduction == "sum" else 1))


def test_ignored_rows_count_zero_and_leave_the_mean():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 10)).astype(np.float32)
    t = np.array([1, -100, 3, -100])
    x[1] = np.nan  # an ignored row is 0 whatever its logits hold
    per_row = ce(x, t, reduction="none")
    assert per_row[1] == 0 and per_row[3] == 0 and np.isfinite(per_row).all()
    assert np.isclose(ce(x, t), (per_row[0] + per_row[2]) / 2, rtol=1e-6)
    assert np.isclose(ce(x, t, reduction="sum"), per_row[0] + per_row[2], rtol=1e-6)


def test_all_ignored():
    x, t = np.ones((3, 4), np.float32), np.full(3, -100)
    assert np.isnan(ce(x, t, reduction="mean"))
    assert ce(x, t, reduction="sum") == 0
    assert np.array_equal(ce(x, t, reduction="none"), np.zeros(3, np.float32))
    assert np.isnan(ce(np.ones((0, 4), np.float32), np.zeros(0, np.int64)))  # empty batch: mean of nothing


@pytest.mark.parametrize("tdtype", (np.int64, np.int32, np.uint8))
def test_out_of_range_target_poisons_its_row(tdtype):
    x = np.zeros((4, 10), np.float32)
    t = np.array([1, 10, 200, 3]).astype(tdtype)
    per_row = ce(x, t, reduction="none")
    assert np.isnan(per_row[1:3]).all() and np.isfinite(per_row[[0, 3]]).all()
    assert np.isnan(ce(x, t)) and np.isnan(ce(x, t, reduction="sum"))
    assert np.isnan(ce(x, np.array([0, -1, 2, 3]), reduction="none")[1])  # negative, not ignore_index
    # a positive ignore_index that is also out of range is still ignored, not NaN
    assert ce(x, np.array([0, 10, 2, 3]), ignore_index=10, reduction="none")[1] == 0


def test_positive_ignore_index_is_a_class_id_that_is_skipped():
    x = np.random.default_rng(2).standard_normal((3, 8)).astype(np.float32)
    t = np.array([0, 5, 0])
    assert np.array_equal(ce(x, t, ignore_index=0, reduction="none")[[0, 2]], np.zeros(2, np.float32))
    assert ce(x, t, ignore_index=0, reduction="none")[1] > 0


@pytest.mark.parametrize("smoothing", (0.0, 0.3))
def test_online_logsumexp_across_many_chunks(monkeypatch, smoothing):
    """A 7-column chunk: many merges, a first chunk that is all -inf, the max in the last chunk, V % chunk != 0."""
    monkeypatch.setattr(cpu_ce, "VOCAB_CHUNK", 7)
    monkeypatch.setattr(cpu_common, "BLOCK_ELEMS", 1)  # one row per block
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 50)) * 4
    x[:, :7] = -np.inf
    x[0, 49] = 40.0
    t = np.array([49, 8, 20, 30, -100])
    case = opport.spec.Case("chunks", (x.astype(np.float32), t), {"reduction": "none", "label_smoothing": 0.0})
    assert_matches(case, "float32", run(case))
    if smoothing:  # -inf logits make the smoothing term inf, as in the reference and torch
        assert np.isposinf(ce(x.astype(np.float32), t, reduction="none", label_smoothing=smoothing)[:4]).all()


def test_large_logits_keep_relative_accuracy():
    # logsumexp - x_t at |x| ~ 1e4 would lose ~1e-3 absolute in float32; (m - x_t) + log(s) does not
    x = np.array([[10000.0, 10000.5, 9999.25]], np.float32)
    ref = np.logaddexp.reduce(x.astype(np.float64), axis=1) - 10000.0
    assert np.isclose(ce(x, np.array([0]), reduction="none")[0], ref[0], rtol=1e-6, atol=0)


def test_memory_stays_bounded_at_large_vocabularies(monkeypatch):
    """The temporaries are (rows per block) x VOCAB_CHUNK per thread: independent of N and V.

    Measured on one thread first (with two, the peak depends on whether the threads' blocks overlap
    in time), then on two: at most one set of block temporaries per thread.
    """
    v = 262144

    def peak(n: int, threads: int) -> int:
        monkeypatch.setenv("OPPORT_NUM_THREADS", str(threads))
        x = np.random.default_rng(4).standard_normal((n, v), np.float32)
        tracemalloc.start()
        try:
            out = ce(x, np.arange(n), reduction="none", label_smoothing=0.1)
            _, p = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert np.isfinite(out).all()
        return p

    one16, one64, two64 = peak(16, 1), peak(64, 1), peak(64, 2)
    nbytes = 64 * v * 4
    assert one64 < 1.5 * one16, f"peak grows with N: {one16} -> {one64} bytes"
    assert two64 < 2.5 * one64 and two64 < nbytes / 8, f"2 threads: {two64} bytes (1 thread: {one64}, input {nbytes})"


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_strided_inputs_match_contiguous_and_are_not_mutated(dtype):
    rng = np.random.default_rng(5)
    xt = cast(rng.standard_normal((300, 6)), dtype).T  # [N, V] as a transposed view
    t = np.array([0, 299, 5, -100, 17, 42, 7, 100, 3, 1, 2, 4])[::2]
    before = (xt.copy(), t.copy())
    out = ce(xt, t, reduction="none", label_smoothing=0.1)
    assert np.array_equal(out, ce(np.ascontiguousarray(xt), t.copy(), reduction="none", label_smoothing=0.1))
    assert np.array_equal(xt, before[0]) and np.array_equal(t, before[1])


def test_dispatch_reaches_cpu_kernel():
    x, t = np.zeros((2, 3), np.float16), np.array([0, 2])
    assert opport.explain("cross_entropy", x, t, backend="cpu").kernel == "cpu.cross_entropy"
    out = opport.cross_entropy(x, t, backend="cpu")
    assert out.dtype == np.float32 and np.isclose(out, np.log(3))




def test_cost():
    metas = [NumpyAdapter.meta(a) for a in (np.ones((4, 100), np.float16), np.zeros(4, np.int64))]
    c = spec.get_cost(*metas)
    assert c.bytes == 4 * 100 * 2 + 4 * 8 + 4 and c.flops == 4 * 400
