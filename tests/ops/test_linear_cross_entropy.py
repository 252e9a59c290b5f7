"""linear_cross_entropy: the cpu kernels against torch's F.cross_entropy on explicit logits (values and gradients),
chunk boundaries, the cross_entropy semantics it shares, autograd through opport.vjp, and the memory bound."""

import tracemalloc
from functools import partial

import numpy as np
import pytest

import opport
import opport.backends.cpu.linear_cross_entropy as cpu_lce
from opport.backends.cpu.linear_cross_entropy import linear_cross_entropy as kernel
from opport.backends.cpu.linear_cross_entropy import linear_cross_entropy_backward as bwd_kernel
from opport.backends.cpu.linear_cross_entropy import linear_cross_entropy_forward as train_kernel
from opport.backends.cpu.linear_cross_entropy import linear_cross_entropy_value_and_grad as vag_kernel
from opport.casegen import cast
from opport.ops.cross_entropy import cross_entropy as ce_spec
from opport.ops.linear_cross_entropy import linear_cross_entropy as spec
from tests.ops import _check

BWD = spec.backward_op
assert_matches = partial(_check.assert_matches, spec)

test_fixed_cases = _check.fixed_cases_test(spec, signed_zero=False)
test_hypothesis_cases = _check.hypothesis_test(spec, signed_zero=False)


def _inputs(n, h, v, seed=0, bias=True, scale=2.0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, h))
    w = rng.standard_normal((v, h)) * scale / np.sqrt(h)
    b = rng.standard_normal(v) if bias else None
    t = rng.integers(0, v, n)
    return x, w, t, b


def _torch_loss_and_grads(x, w, t, b, g, reduction, smoothing, softcap, ignore_index=-100):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    bt = None if b is None else torch.tensor(b, requires_grad=True)
    z = xt @ wt.T + (0 if bt is None else bt)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    loss = F.cross_entropy(z, torch.tensor(t), ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=smoothing)
    loss.backward(torch.tensor(g))
    return loss.detach().numpy(), xt.grad.numpy(), wt.grad.numpy(), None if bt is None else bt.grad.numpy()


@pytest.mark.parametrize("reduction", ("none", "sum", "mean"))
@pytest.mark.parametrize("smoothing,softcap,bias", ((0.0, None, False), (0.2, None, True), (0.1, 5.0, True)))
def test_matches_torch_on_explicit_logits(reduction, smoothing, softcap, bias):
    """float64 inputs: loss and all three gradients equal torch's on hidden @ weight.T (+ bias), softcapped."""
    x, w, t, b = _inputs(11, 24, 301, seed=1, bias=bias)
    t[[2, 7]] = -100
    t[0], t[1] = 0, 300  # the vocabulary's first and last entries
    g = np.random.default_rng(2).standard_normal(() if reduction != "none" else (11,))
    want = _torch_loss_and_grads(x, w, t, b, g, reduction, smoothing, softcap)
    kw = {"reduction": reduction, "label_smoothing": smoothing, "softcap": softcap}
    loss, lse = train_kernel(*spec.bind(x, w, t, b, **kw))
    assert np.allclose(loss, want[0], rtol=1e-6, atol=1e-9) and np.allclose(kernel(*spec.bind(x, w, t, b, **kw)), loss)
    got = bwd_kernel(*BWD.bind(np.asarray(g, np.float32), x, w, t, lse, b, **kw))
    for name, d, r in zip(("dhidden", "dweight", "dbias"), got, want[1:]):
        if r is None:
            assert d is None
            continue
        # grad is float32 (the loss's dtype): the gradients agree to its rounding
        assert np.allclose(d, r, rtol=1e-6, atol=1e-7 * np.abs(r).max()), name


def test_matches_torch_in_float32_with_ignore_index_positive():
    x, w, t, b = _inputs(16, 32, 200, seed=3)
    t[[1, 5]] = 7
    want = _torch_loss_and_grads(x, w, t, b, np.float64(1.0), "mean", 0.0, None, ignore_index=7)
    x32, w32, b32 = (a.astype(np.float32) for a in (x, w, b))
    loss, lse = train_kernel(*spec.bind(x32, w32, t, b32, ignore_index=7))
    assert np.allclose(loss, want[0], rtol=1e-5)
    for d, r in zip(bwd_kernel(*BWD.bind(np.ones((), np.float32), x32, w32, t, lse, b32, ignore_index=7)), want[1:]):
        assert np.abs(d - r).max() <= 1e-5 * np.abs(r).max()


@pytest.mark.parametrize("dtype", ("float32", "bfloat16", "float64"))
def test_same_loss_as_cross_entropy_on_the_logits(dtype):
    """The fused op is cross_entropy on the logits: both kernels against each other, every reduction and smoothing."""
    x, w, t, _ = _inputs(9, 16, 77, seed=4)
    x, w = cast(x, dtype), cast(w, dtype)
    t[3] = -100
    logits = x.astype(np.float64) @ w.astype(np.float64).T
    for reduction in ("none", "sum", "mean"):
        for eps in (0.0, 0.3):
            a = kernel(*spec.bind(x, w, t, reduction=reduction, label_smoothing=eps))
            b = ce_spec.run_reference(logits, t, reduction=reduction, label_smoothing=eps)
            assert np.allclose(a, b, rtol=1e-5, atol=1e-5), (reduction, eps)


def test_all_ignored_and_bad_targets():
    x, w, t, b = _inputs(4, 8, 20, seed=5)
    assert np.isnan(kernel(*spec.bind(x, w, np.full(4, -100), b)))  # mean of no rows, as torch
    assert kernel(*spec.bind(x, w, np.full(4, -100), b, reduction="sum")) == 0
    loss, lse = train_kernel(*spec.bind(x, w, np.full(4, -100), b))
    dh, dw, db = bwd_kernel(*BWD.bind(np.ones((), np.float32), x, w, np.full(4, -100), lse, b))
    assert not dh.any() and not dw.any() and not db.any()  # every row ignored: zero gradients, not NaN
    out = kernel(*spec.bind(x, w, np.array([20, -1, 3, -100]), b, reduction="none"))
    assert np.isnan(out[:2]).all() and np.isfinite(out[2]) and out[3] == 0


@pytest.mark.parametrize("rows,chunk", ((1, 7), (5, 20), (256, 4096)))
def test_chunk_boundaries_give_the_same_result(monkeypatch, rows, chunk):
    """Tiles smaller than N and V, and not dividing them, give the loss and gradients of one whole tile."""
    x, w, t, b = _inputs(13, 10, 45, seed=6)
    t[4] = -100
    kw = {"reduction": "sum", "label_smoothing": 0.1, "softcap": 3.0}
    g = np.float32(0.5)

    def run():
        loss, lse = train_kernel(*spec.bind(x, w, t, b, **kw))
        return (loss, *bwd_kernel(*BWD.bind(np.asarray(g), x, w, t, lse, b, **kw)))

    whole = run()
    monkeypatch.setattr(cpu_lce, "ROW_BLOCK", rows)
    monkeypatch.setattr(cpu_lce, "VOCAB_CHUNK", chunk)
    for a, c in zip(run(), whole):
        assert np.allclose(a, c, rtol=1e-12, atol=1e-12)


def test_vjp_through_opport():
    """The differentiable op runs through opport.vjp without special-casing: three gradients, None for no bias."""
    x, w, t, _ = _inputs(6, 8, 30, seed=7)
    x, w = x.astype(np.float32), w.astype(np.float32)
    out, pullback = opport.vjp("linear_cross_entropy", x, w, t, backend="cpu")
    dx, dw, db = pullback(np.asarray(2.0, np.float32))
    assert db is None and dx.shape == x.shape and dw.shape == w.shape
    # a scalar loss on cpu: the fused value-and-grad, its unit gradients doubled (exact)
    assert opport.dispatch.takes(spec.value_and_grad_op, spec.bind(x, w, t), "cpu")
    loss, udx, udw, _ = vag_kernel(*spec.bind(x, w, t))
    assert np.array_equal(out, loss) and np.array_equal(dx, udx * 2) and np.array_equal(dw, udw * 2)


def test_value_and_grad_is_the_forward_and_backward_kernels_at_unit_grad():
    """The fused kernel against the training forward + backward kernels (logits formed twice) at grad = 1: the same
    loss and gradients to float32's rounding, whatever the blocks (rows per block from FUSED_LOGITS, vocabulary
    tiles, the target entries of every tile); where the one-pass layout does not pay it runs those kernels itself."""
    x, w, t, b = _inputs(13, 10, 45, seed=6)
    t[4] = -100
    x, w, b = x.astype(np.float32), w.astype(np.float32), b.astype(np.float32)
    kw = {"reduction": "mean", "label_smoothing": 0.1, "softcap": 3.0}
    loss, lse = train_kernel(*spec.bind(x, w, t, b, **kw))
    two_pass = (loss, *bwd_kernel(*BWD.bind(np.ones((), np.float32), x, w, t, lse, b, **kw)))
    for logits, chunk in ((1 << 23, 4096), (45 * 4, 7), (45, 20)):  # one block; 4 rows, 7-wide tiles; 1 row
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cpu_lce, "FUSED_LOGITS", logits)
            mp.setattr(cpu_lce, "FUSED_ROWS_MIN", 1)
            mp.setattr(cpu_lce, "VOCAB_CHUNK", chunk)
            fused = vag_kernel(*spec.bind(x, w, t, b, **kw))
        for f, u in zip(fused, two_pass):
            np.testing.assert_allclose(f, u, rtol=2e-6, atol=1e-7)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_lce, "FUSED_ROWS_MIN", 1 << 30)  # no block layout pays: the two kernels, bit for bit
        for f, u in zip(vag_kernel(*spec.bind(x, w, t, b, **kw)), two_pass):
            np.testing.assert_array_equal(f, u)


def test_value_and_grad_declines_a_per_row_loss():
    """reduction "none": the per-row upstream would have to enter dweight's sum, so the fused kernel declines and
    autograd runs the training forward and backward (the choice is data: opport.dispatch.takes)."""
    x, w, t, _ = _inputs(6, 8, 30, seed=7)
    x, w = x.astype(np.float32), w.astype(np.float32)
    assert not opport.dispatch.takes(spec.value_and_grad_op, spec.bind(x, w, t, reduction="none"), "cpu")
    assert opport.dispatch.takes(spec.value_and_grad_op, spec.bind(x, w, t, reduction="sum"), "cpu")


def test_peak_memory_is_bounded_by_the_tiles(monkeypatch):
    """No N x V temporary: the forward and backward peak stays far below the logits' bytes (float32 here)."""
    monkeypatch.setattr(cpu_lce, "ROW_BLOCK", 64)
    monkeypatch.setattr(cpu_lce, "VOCAB_CHUNK", 512)
    n, h, v = 512, 16, 16384
    x, w, t, b = (a if a.dtype.kind == "i" else a.astype(np.float32) for a in _inputs(n, h, v, seed=8))
    logits_bytes = n * v * 4  # 32 MiB
    tracemalloc.start()
    try:
        loss, lse = train_kernel(*spec.bind(x, w, t, b, label_smoothing=0.1))
        _, fwd_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        dh, dw, db = bwd_kernel(*BWD.bind(np.ones((), np.float32), x, w, t, lse, b, label_smoothing=0.1))
        _, bwd_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    tile = 64 * 512 * 4
    assert fwd_peak < 8 * tile + 4 * n * 8, f"forward peak {fwd_peak} bytes"
    outputs = dh.nbytes + dw.nbytes + db.nbytes
    assert bwd_peak < outputs + 8 * tile + 512 * h * 8, f"backward peak {bwd_peak} bytes beside {outputs} of outputs"
    assert max(fwd_peak, bwd_peak) < logits_bytes / 8


def test_cost_has_no_logits_traffic():
    x, w, t, _ = _inputs(4, 8, 10)
    meta = spec.bind(x.astype(np.float32), w.astype(np.float32), t)
    cost = spec.get_cost(*meta)
    assert cost.flops == 2 * 4 * 10 * 8 and cost.bytes == (32 + 80) * 4 + 4 * 8 + 4
    bcost = BWD.get_cost(np.ones((), np.float32), meta[0], meta[1], t, np.zeros(4, np.float32))
    assert bcost.flops == 4 * 4 * 10 * 8
