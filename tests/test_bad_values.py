"""Bad values and the forms users pass (issue 26, items 6 and 7): out-of-range class labels are a typed error before
any kernel on host arrays (NumPy, CPU tensors, CPU JAX arrays), NaN rows on device arrays unless OPPORT_CHECK_VALUES=1;
a NumPy array beside traced JAX arrays gets an error naming it; per-tensor fp8 scales may be 0-d."""

from __future__ import annotations

import numpy as np
import pytest

import opport
from opport.dispatch import backends, clear_cache, get_backend, impl, kernels, remove_kernel
from opport.dispatch import core as dispatch_core
from opport.dtypes import np_dtype
from opport.ops import get_op

torch = pytest.importorskip("torch")
BACKENDS = [name for name, b in backends().items() if not b.unavailable() and name in ("cpu", "cuda", "neuron")]
CE_OPS = ("cross_entropy", "linear_cross_entropy")


def _logits(n=4, v=10, seed=0):
    return np.random.default_rng(seed).standard_normal((n, v)).astype(np.float32)


def _ce_args(op: str, target, v=10):
    """(args) for cross_entropy (logits, target) or linear_cross_entropy (hidden, weight, target)."""
    n = len(target)
    if op == "cross_entropy":
        return (_logits(n, v), np.asarray(target))
    rng = np.random.default_rng(1)
    return (rng.standard_normal((n, 8)).astype(np.float32), rng.standard_normal((v, 8)).astype(np.float32),
            np.asarray(target))


@pytest.fixture
def spy():
    """A top-priority cpu kernel on the cross-entropy ops and their derived ops, recording whether it ran."""
    calls, specs = [], []
    for name in CE_OPS:
        spec = get_op(name)
        specs += [s for s in (spec, spec.backward_op, spec.train_forward, spec.value_and_grad_op) if s is not None]
    for s in specs:
        impl(s, "cpu", priority=1000, name="cpu.spy")(lambda *a, _n=s.name: calls.append(_n))
    yield calls
    for s in specs:
        remove_kernel(s, "cpu", "cpu.spy")


# --------------------------------------------------------------------------- class labels


@pytest.mark.parametrize("op", CE_OPS)
@pytest.mark.parametrize("target, kwargs", [
    ([0, 10, 1, 2], {}),  # V itself
    ([0, -1, 1, 2], {}),  # negative, not ignore_index
    ([3, -100, 2**40, 1], {"reduction": "sum"}),
    ([0, 1, 10, 2], {"ignore_index": 7, "label_smoothing": 0.1}),
])
@pytest.mark.parametrize("kind", ("numpy", "torch", "jax"))
def test_out_of_range_labels_on_the_host_raise_before_any_kernel(op, target, kwargs, kind, spy):
    args = _ce_args(op, target)
    if kind == "torch":
        args = tuple(torch.from_numpy(a) for a in args)
    elif kind == "jax":
        jnp = pytest.importorskip("jax.numpy")
        if max(abs(t) for t in target) >= 2**31:
            pytest.skip("JAX keeps int32 labels unless x64 is enabled")
        args = tuple(jnp.asarray(a) for a in args)
    with pytest.raises(opport.ArgumentError) as e:
        getattr(opport, op)(*args, **kwargs)
    assert (e.value.op, e.value.arg, e.value.constraint) == (op, "target", f"{op}.target_range")
    bad = next(t for t in target if t != kwargs.get("ignore_index", -100) and not 0 <= t < 10)
    assert f"got {bad} at row {target.index(bad)}" in str(e.value)
    assert spy == []


@pytest.mark.parametrize("op", CE_OPS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ignore_index_stays_allowed_on_every_backend(op, backend):
    """ignore_index may be any int, in [0, V) or not: its rows are 0, and no error."""
    for ignore in (-100, 10, 3):
        args = _ce_args(op, [0, ignore, 9, ignore])
        out = getattr(opport, op)(*args, ignore_index=ignore, reduction="none", backend=backend)
        out = np.asarray(out)
        assert out[1] == 0 and out[3] == 0 and np.isfinite(out).all()


def test_training_paths_check_the_labels_too(spy):
    """autograd (torch: the fused value-and-grad or the training forward), opport.vjp, the backward itself."""
    x = torch.from_numpy(_logits()).requires_grad_()
    bad = torch.tensor([0, 10, 1, 2])
    with pytest.raises(opport.ArgumentError, match="cross_entropy.target_range"):
        opport.cross_entropy(x, bad)
    with pytest.raises(opport.ArgumentError, match="cross_entropy.target_range"):
        opport.vjp("cross_entropy", _logits(), bad.numpy())
    h, w, t = _ce_args("linear_cross_entropy", [0, 1, -3, 2])
    with pytest.raises(opport.ArgumentError, match="linear_cross_entropy.target_range"):
        opport.linear_cross_entropy(torch.from_numpy(h).requires_grad_(), torch.from_numpy(w), torch.from_numpy(t))
    bwd = get_op("cross_entropy").backward_op
    with pytest.raises(opport.ArgumentError) as e:
        dispatch_core.call(bwd, bwd.bind(np.ones((), np.float32), _logits(), bad.numpy(), np.zeros(4, np.float32)), None)
    assert e.value.constraint == "cross_entropy_backward.target_range"
    assert spy == []


def test_device_arrays_are_not_read_unless_asked(monkeypatch, spy):
    """On a device array the labels are not read back (a synchronisation per call): the kernel runs and gives the
    documented NaN row; OPPORT_CHECK_VALUES=1 reads them and raises. No GPU here: the plan is told the target lives
    on a device."""
    remove_kernel(get_op("cross_entropy"), "cpu", "cpu.spy")  # the real kernel computes
    monkeypatch.setattr(dispatch_core, "_on_host", lambda a: False)
    clear_cache()
    x, t = _logits(), np.array([0, 10, 1, 2])
    try:
        monkeypatch.delenv("OPPORT_CHECK_VALUES", raising=False)
        out = opport.cross_entropy(x, t, reduction="none")
        assert np.isnan(out[1]) and np.isfinite(out[[0, 2, 3]]).all()
        monkeypatch.setenv("OPPORT_CHECK_VALUES", "1")  # read per call: the cached plan obeys at once
        with pytest.raises(opport.ArgumentError, match="cross_entropy.target_range"):
            opport.cross_entropy(x, t, reduction="none")
        monkeypatch.setenv("OPPORT_CHECK_VALUES", "0")
        assert np.isnan(opport.cross_entropy(x, t, reduction="none")[1])
    finally:
        monkeypatch.undo()
        clear_cache()
    with pytest.raises(opport.ArgumentError):  # the host plan again
        opport.cross_entropy(x, t, reduction="none")


def test_scale_checks_still_read_device_arrays(monkeypatch):
    """A check not marked `on_device = False` (fp8 scales) runs on every call whatever the device."""
    monkeypatch.setattr(dispatch_core, "_on_host", lambda a: False)
    clear_cache()
    try:
        q = np.zeros((2, 256), np_dtype("float8_e5m2"))
        with pytest.raises(opport.ArgumentError, match="dequantize_fp8.scale_values"):
            opport.dequantize_fp8(q, np.zeros((1, 1), np.float32))
    finally:
        monkeypatch.undo()
        clear_cache()


def _native(backend: str, arrays):
    """NumPy arrays as the backend's kernels take them (torch tensors for cuda)."""
    if get_backend(backend).array_kind == "torch":
        dev = get_backend(backend).torch_device()
        return [torch.from_numpy(a).to(dev) if isinstance(a, np.ndarray) else a for a in arrays]
    return list(arrays)


def _host(a):
    return np.asarray(a.detach().cpu() if isinstance(a, torch.Tensor) else a, np.float64)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernels_give_nan_rows_for_labels_nobody_read(backend):
    """What a device array gets without OPPORT_CHECK_VALUES: each kernel (called directly, as the dispatcher does
    after skipping the check) makes the row of an out-of-range label NaN, ignored rows 0, the others finite."""
    spec = get_op("cross_entropy")
    t = np.array([0, 10, -1, -100, 5])
    x = _logits(5, 10)
    for s in (spec, spec.train_forward, spec.value_and_grad_op):
        k = kernels(s, get_backend(backend))[0]
        out = k.fn(*_native(backend, spec.bind(x, t, reduction="none")))
        loss = _host(out[0] if isinstance(out, tuple) else out)
        assert np.isnan(loss[[1, 2]]).all() and loss[3] == 0 and np.isfinite(loss[[0, 4]]).all(), (s.name, loss)
        if s is spec.value_and_grad_op:
            d = _host(out[1])
            assert np.isnan(d[[1, 2]]).all() and (d[3] == 0).all() and np.isfinite(d[[0, 4]]).all()
    bwd = spec.backward_op
    lse = np.log(np.exp(x.astype(np.float64)).sum(1)).astype(np.float32)
    (d,) = kernels(bwd, get_backend(backend))[0].fn(*_native(backend, bwd.bind(np.ones(5, np.float32), x, t, lse,
                                                                                  reduction="none")))
    d = _host(d)
    assert np.isnan(d[[1, 2]]).all() and (d[3] == 0).all() and np.isfinite(d[[0, 4]]).all()
    lce = get_op("linear_cross_entropy")
    h, w, _ = _ce_args("linear_cross_entropy", t)
    out = _host(kernels(lce, get_backend(backend))[0].fn(*_native(backend, lce.bind(h, w, t, reduction="none"))))
    assert np.isnan(out[[1, 2]]).all() and out[3] == 0 and np.isfinite(out[[0, 4]]).all()


# --------------------------------------------------------------------------- NumPy beside traced JAX arrays


def test_numpy_first_argument_beside_traced_jax_arrays_is_named():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    x = np.ones((2, 4), np.float32)
    with pytest.raises(opport.DTypeError) as e:
        jax.jit(lambda w: opport.rmsnorm(x, w))(jnp.ones(4, jnp.float32))
    assert (e.value.arg, e.value.constraint) == ("x", "rmsnorm.array_type")
    assert "'weight' is a traced one" in str(e.value) and "jnp.asarray(x)" in str(e.value)
    with pytest.raises(opport.DTypeError) as e:  # the first array present names the call: logits
        jax.jit(lambda t: opport.cross_entropy(_logits(), t))(jnp.zeros(4, jnp.int32))
    assert e.value.arg == "logits" and "'target' is a traced one" in str(e.value)
    # NumPy after a traced first argument is fine (a constant of the callback), as docs/integration.md says
    y = jax.jit(lambda x: opport.rmsnorm(x, np.full(4, 2.0, np.float32)))(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(y), np.full((2, 4), 2.0), rtol=1e-6)
    # and the fix the message gives works
    y = jax.jit(lambda w: opport.rmsnorm(jnp.asarray(x), w))(jnp.ones(4, jnp.float32))
    np.testing.assert_allclose(np.asarray(y), np.ones((2, 4)), rtol=1e-6)


def test_a_traced_array_for_an_in_place_op_is_named_itself():
    jax = pytest.importorskip("jax")
    spec = get_op("kv_cache_write")
    case = next(iter(spec.get_cases("float32")))
    args = list(case.args)
    pos = spec.params.index("slot_mapping")

    def f(slots):
        args[pos] = slots
        return opport.kv_cache_write(*args, **case.kwargs)

    with pytest.raises(opport.DTypeError) as e:
        jax.jit(f)(jax.numpy.asarray(case.args[pos]))
    assert e.value.arg == "slot_mapping" and "immutable" in str(e.value)


# --------------------------------------------------------------------------- 0-d per-tensor scales


def _fp8_operands(fp8="float8_e5m2", shape=(9, 256), n=40):
    from opport.ops.scaled_matmul import quantize_a, quantize_b

    rng = np.random.default_rng(4)
    a_q, sa = quantize_a(rng.standard_normal(shape), "tensor", fp8)
    b_q, sb = quantize_b(rng.standard_normal((shape[-1], n)) / 16, "tensor", fp8)
    return a_q, b_q, sa, sb


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", ((9, 256), (2, 3, 64)))
def test_scaled_matmul_takes_0d_per_tensor_scales_on_every_backend(backend, shape):
    a_q, b_q, sa, sb = _fp8_operands(shape=shape)
    want = opport.scaled_matmul(a_q, b_q, sa, sb, out_dtype="float32", backend=backend)
    assert sa.shape == (1,) * len(shape) and sb.shape == (1, 1)
    for s_a, s_b in ((sa.reshape(()), sb.reshape(())), (sa.reshape(()), sb), (sa, sb.reshape(()))):
        got = opport.scaled_matmul(a_q, b_q, s_a, s_b, out_dtype="float32", backend=backend)
        np.testing.assert_array_equal(got, want)  # the same kernel on the same (1, ..., 1) view: bit for bit
        t = [torch.from_numpy(np.array(v)) for v in (s_a, s_b)]  # 0-d tensors too
        got_t = opport.scaled_matmul(*[torch.from_numpy(a.view(np.uint8)).view(getattr(torch, a.dtype.name))
                                       for a in (a_q, b_q)], *t, out_dtype="float32", backend=backend)
        np.testing.assert_array_equal(got_t.numpy(), want)
    with pytest.raises(opport.ShapeError, match="scaled_matmul.scale_a_shape"):  # 1-d is not a per-tensor form
        opport.scaled_matmul(a_q, b_q, sa.reshape(1), sb, backend=backend)
    with pytest.raises(opport.ArgumentError, match="scaled_matmul.scale_values"):  # 0-d scales are checked too
        opport.scaled_matmul(a_q, b_q, np.zeros((), np.float32), sb, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dequantize_fp8_takes_a_0d_per_tensor_scale(backend):
    from opport.ops.dequantize_fp8 import quantized

    q, s = quantized(np.random.default_rng(5).standard_normal((3, 64)), "tensor", 128, "float8_e5m2")
    want = opport.dequantize_fp8(q, s, backend=backend)
    np.testing.assert_array_equal(opport.dequantize_fp8(q, s.reshape(()), backend=backend), want)
    with pytest.raises(opport.ShapeError, match="dequantize_fp8.scales_shape"):
        opport.dequantize_fp8(q, s.reshape(()), granularity="token", backend=backend)


def test_kernel_args_hand_kernels_the_views():
    from opport.dispatch import kernel_args

    spec = get_op("scaled_matmul")
    a_q, b_q, sa, sb = _fp8_operands()
    bound = spec.bind(a_q, b_q, sa.reshape(()), sb.reshape(()))
    got = kernel_args(spec, bound)
    assert got[2].shape == (1, 1) and got[3].shape == (1, 1) and np.shares_memory(got[2], bound[2])
    assert kernel_args(spec, spec.bind(a_q, b_q, sa, sb))[2] is sa
