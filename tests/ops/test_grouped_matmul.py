"""grouped_matmul: the cpu kernel against the reference and per-expert matmuls, the offsets value check (typed errors
on every call, before any kernel, any array kind), the cost of the experts used, unused experts never read, and the
neuron kernels' HBM traffic."""

import numpy as np
import pytest

import opport
from opport.arraymath import cu
from opport.backends.cpu.grouped_matmul import grouped_matmul as kernel
from opport.backends.cpu.grouped_matmul import grouped_matmul_backward as backward_kernel
from opport.dispatch import backends, call, strict
from opport.dispatch.adapters import NumpyAdapter
from opport.errors import ArgumentError
from opport.ops.grouped_matmul import grouped_matmul as spec
from tests.ops import _check

BWD = spec.backward_op
# the llm case (64 rows, a slice of two 1024 x 512 experts) is past 2^20 elements; emulated backends skip it by size
test_fixed_cases = _check.fixed_cases_test(spec, min_cases=12, max_elements=1 << 21)
test_hypothesis_cases = _check.hypothesis_test(spec)
BACKENDS = [name for name in ("cpu", "cuda", "neuron") if name in backends() and not backends()[name].unavailable()]


def grouped(sizes, k=8, n=6, trans_w=False, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((sum(sizes), k)).astype(dtype)
    w = rng.standard_normal((len(sizes), n, k) if trans_w else (len(sizes), k, n)).astype(dtype)
    return x, w, cu(sizes)


@pytest.mark.parametrize("trans_w", [False, True])
def test_each_group_is_its_experts_matmul(trans_w):
    x, w, o = grouped([5, 0, 9, 1], trans_w=trans_w)
    out = kernel(x, w, o, trans_w)
    for e in range(4):
        rows = slice(o[e], o[e + 1])
        assert np.array_equal(out[rows], x[rows] @ (w[e].T if trans_w else w[e]))
    dx, dw = backward_kernel(np.ones_like(out), x, w, o, trans_w)
    assert not dw[1].any() and dx.shape == x.shape  # expert 1 has no rows: dw = 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_unused_experts_are_never_read(backend):
    """NaN and inf in an empty expert's weights reach neither the output nor dx; its dw is exactly 0, on every
    backend here (the kernels skip it, they do not multiply it by nothing)."""
    x, w, o = grouped([7, 0, 20, 0], k=16, n=12)
    w[1], w[3] = np.nan, np.inf
    g = np.random.default_rng(1).standard_normal((27, 12)).astype(np.float32)
    with strict():
        out = call(spec, spec.bind(x, w, o), backend)
        dx, dw = call(BWD, BWD.bind(g, x, w, o), backend)
    out, dx, dw = (np.asarray(a) for a in (out, dx, dw))
    assert np.isfinite(out).all() and np.isfinite(dx).all()
    assert not dw[1].any() and not dw[3].any() and np.isfinite(dw).all()


@pytest.mark.parametrize("bad", [
    np.array([1, 6, 12], np.int32),  # does not start at 0
    np.array([0, 7, 6], np.int32),  # decreasing
    np.array([0, 6, 11], np.int64),  # ends before M
])
def test_bad_offsets_are_refused_on_every_call_not_only_the_first(bad):
    """The selection cache keys on shapes: a valid call first must not let a later bad one through; the backward
    checks them again."""
    x, w, o = grouped([6, 6])
    call(spec, spec.bind(x, w, o), "cpu")
    with pytest.raises(ArgumentError) as info:
        call(spec, spec.bind(x, w, bad), "cpu")
    assert (info.value.constraint, info.value.arg) == ("grouped_matmul.offsets_values", "offsets")
    with pytest.raises(ArgumentError) as info:
        call(BWD, BWD.bind(np.ones((12, 6), np.float32), x, w, bad), "cpu")
    assert info.value.constraint == "grouped_matmul_backward.offsets_values"


def test_bad_offsets_in_torch_tensors_are_refused():
    torch = pytest.importorskip("torch")
    x, w, o = grouped([6, 6])
    with pytest.raises(ArgumentError, match="offsets_values"):
        opport.grouped_matmul(torch.from_numpy(x), torch.from_numpy(w), torch.tensor([0, 7, 6]), backend="cpu")
    good = opport.grouped_matmul(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(o), backend="cpu")
    assert np.array_equal(good.numpy(), kernel(x, w, o, False))


def test_cost_counts_the_weights_of_experts_with_rows():
    x, w, o = grouped([4, 0, 2, 0], k=8, n=6)
    cost = spec.get_cost(x, w, o)
    assert cost.flops == 2 * 6 * 8 * 6
    assert cost.bytes == (6 * 8 + 2 * 8 * 6 + 6 * 6) * 4 + 5 * 4  # x, experts 0 and 2, out, offsets
    metas = [NumpyAdapter.meta(a) for a in (x, w, o)]
    assert spec.get_cost(*metas).bytes == cost.bytes + 2 * 8 * 6 * 4  # without values: every expert, an upper bound


# --------------------------------------------------------------------------- neuron: HBM traffic


def _neuron_traffic(sp, args):
    from opport.backends.neuron import nki_compat

    if not nki_compat.EMULATED:
        pytest.skip("DMA counters are collected by the emulator")
    with nki_compat.collect_stats() as stats, strict():
        call(sp, sp.bind(*args), "neuron")
    return stats, sp.get_cost(*args).bytes  # with the offsets' values: the used experts' weights only


@pytest.mark.parametrize("trans_w", [False, True])
def test_neuron_moves_the_minimum_bytes(trans_w):
    """Forward: x once, each used expert's weights once (one row block per group here), out once; backward: grad, x
    and the used weights once (the group's rows stay in SBUF for both passes), dx and every dw[e] written once. The
    offsets never move: they are compile-time values (the cost model counts their bytes)."""
    pytest.importorskip("opport.backends.neuron.nki_compat")
    x, w, o = grouped([130, 0, 70, 9], k=160, n=96, trans_w=trans_w)
    offsets_bytes = o.nbytes
    fwd, least = _neuron_traffic(spec, (x, w, o, trans_w))
    assert fwd.hbm_bytes == least - offsets_bytes, (fwd.hbm_bytes, least)
    g = np.random.default_rng(2).standard_normal((209, 96)).astype(np.float32)
    bwd, least = _neuron_traffic(BWD, (g, x, w, o, trans_w))
    assert bwd.hbm_bytes == least - offsets_bytes, (bwd.hbm_bytes, least)


@pytest.mark.parametrize("trans_w", [False, True])
def test_neuron_streamed_backward_matches_resident(trans_w, monkeypatch):
    """With the SBUF residency budget at 0 the backward re-reads each row tile where it uses it (the path for groups
    too large to keep): the same gradients as the resident path, bit for bit."""
    if "neuron" not in BACKENDS:
        pytest.skip("no neuron backend here")
    from opport.backends.neuron import grouped_matmul as module

    x, w, o = grouped([130, 0, 70, 9], k=160, n=96, trans_w=trans_w)
    g = np.random.default_rng(4).standard_normal((209, 96)).astype(np.float32)
    with strict():
        resident = call(BWD, BWD.bind(g, x, w, o, trans_w), "neuron")
        monkeypatch.setattr(module, "ROWS_BUDGET", 0)
        streamed = call(BWD, BWD.bind(g, x, w, o, trans_w), "neuron")
    for r, s in zip(resident, streamed):
        assert np.array_equal(np.asarray(r), np.asarray(s))
