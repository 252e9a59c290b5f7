"""JAX arrays through the jax backend (issue 32 item 4): the op's jnp formulation chosen by the dispatcher, traced
into jax.jit / jax.grad with no host callback, its values and gradients within the op's tolerances of the float64
reference, checked by conformance; the callback path when asked for; a fallback from it warns, strict refuses."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import opport
from opport import accuracy
from opport.conformance import Options, run
from opport.conformance.execute import _cancel_allowance
from opport.dispatch import impl
from tests.conftest import fake_backend

jax = pytest.importorskip("jax")
jnp = jax.numpy
RMS = opport.get_op("rmsnorm")
RNG = np.random.default_rng(0)
X = RNG.standard_normal((8, 96)).astype(np.float32)
W = RNG.uniform(0.5, 1.5, 96).astype(np.float32)
G = RNG.standard_normal((8, 96)).astype(np.float32)


def _loss(x, w):
    return jnp.sum(opport.rmsnorm(x, w, offset=0.5) * jnp.asarray(G))


def _callbacks(fn, *args) -> int:
    """How many host callbacks the traced computation holds (nested jaxprs included)."""
    text = str(jax.make_jaxpr(fn)(*args))
    return text.count("pure_callback") + text.count("io_callback")


def _within(spec, dtype, index, got, want, bound) -> None:
    __tracebackhide__ = True
    tol = spec.tolerance_for(dtype, index)
    verdict = accuracy.compare(np.asarray(got), want, tol, dtype, False, _cancel_allowance(spec, bound, dtype, index))
    assert verdict.ok, verdict.message


def test_jax_arrays_select_the_jax_backend_and_trace_without_callbacks():
    x, w = jnp.asarray(X), jnp.asarray(W)
    d = opport.explain(RMS, x, w)
    assert (d.backend, d.kernel, d.fallback) == ("jax", "jax.rmsnorm", None)
    assert opport.explain(RMS.backward_op, x, x, w).kernel == "jax.rmsnorm_backward"
    assert opport.explain(RMS, X, W).backend == "cpu"  # NumPy arrays: the cpu backend, as before
    grad = jax.jit(jax.grad(_loss, argnums=(0, 1)))
    assert _callbacks(grad, x, w) == 0 and _callbacks(lambda x, w: opport.rmsnorm(x, w), x, w) == 0


def test_values_and_gradients_within_the_op_tolerance_of_the_float64_reference():
    x, w = jnp.asarray(X), jnp.asarray(W)
    out = jax.jit(lambda x, w: opport.rmsnorm(x, w, offset=0.5))(x, w)
    x64, w64, g64 = X.astype(np.float64), W.astype(np.float64), G.astype(np.float64)
    _within(RMS, "float32", 0, out, RMS.run_reference(x64, w64, 1e-6, 0.5), (X, W, 1e-6, 0.5))
    dx, dw = jax.jit(jax.grad(_loss, argnums=(0, 1)))(x, w)
    ref = RMS.backward_op.run_reference(g64, x64, w64, 1e-6, 0.5)
    bound = (G, X, W, 1e-6, 0.5)
    _within(RMS.backward_op, "float32", 0, dx, ref[0], bound)
    _within(RMS.backward_op, "float32", 1, dw, ref[1], bound)


def test_the_callback_path_when_the_cpu_backend_is_asked_for(monkeypatch):
    x, w = jnp.asarray(X), jnp.asarray(W)
    with opport.use_backend("cpu"):
        assert _callbacks(jax.grad(_loss, argnums=(0, 1)), x, w) == 2  # forward and backward on the host
        via_cpu = jax.jit(jax.grad(_loss, argnums=(0, 1)))(x, w)
    monkeypatch.setenv("OPPORT_BACKEND", "cpu")
    assert _callbacks(lambda x, w: opport.rmsnorm(x, w, backend=None), x, w) == 1
    monkeypatch.delenv("OPPORT_BACKEND")
    xla = jax.jit(jax.grad(_loss, argnums=(0, 1)))(x, w)
    for a, b in zip(xla, via_cpu):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)


def test_vmap_batches_the_jnp_formulation_and_jvp_is_refused_on_both_paths():
    x = jnp.asarray(X.reshape(2, 4, 96))
    f = jax.vmap(lambda rows: opport.rmsnorm(rows, jnp.asarray(W)))
    assert _callbacks(f, x) == 0  # vmap of the jnp kernels: batched by XLA, not an item at a time
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(x)), np.asarray(opport.rmsnorm(x, jnp.asarray(W))))
    for backend in ("jax", "cpu"):
        with pytest.raises(TypeError, match="custom_vjp"):
            jax.jvp(lambda x, b=backend: opport.rmsnorm(x, backend=b), (x,), (jnp.ones_like(x),))


def test_bad_input_is_the_typed_error_at_trace_time():
    x = jnp.asarray(X)
    with pytest.raises(opport.ShapeError) as info:
        jax.jit(jax.grad(lambda x: jnp.sum(opport.rmsnorm(x, jnp.ones(7, jnp.float32)))))(x)
    assert info.value.constraint == "rmsnorm.weight_shape"


def test_a_fallback_from_a_jax_kind_backend_warns_and_strict_refuses():
    """A backend of JAX kernels that declines a call: the cpu kernel runs (through a callback) with the dispatcher's
    FallbackWarning, and strict mode refuses at trace time; a call it takes is traced in."""
    spec = opport.get_op("matmul")  # an op the jax backend has no kernels for

    with fake_backend("t_xla", device_types=("cpu",), array_kind="jax"):
        impl(spec, "t_xla", supports=lambda a, b, bias: None if a.shape[-1] % 2 == 0 else "odd K")(
            lambda a, b, bias: a @ b + (0 if bias is None else bias))
        even, odd = jnp.ones((3, 4), jnp.float32), jnp.ones((3, 5), jnp.float32)
        f = jax.jit(lambda a, b: opport.matmul(a, b))
        assert _callbacks(f, even, even.T) == 0
        np.testing.assert_array_equal(np.asarray(f(even, even.T)), np.full((3, 3), 4.0, np.float32))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert _callbacks(lambda a, b: opport.matmul(a, b), odd, odd.T) == 1
        assert any(issubclass(w.category, opport.FallbackWarning) and "t_xla" in str(w.message) for w in caught)
        with opport.strict(), pytest.raises(opport.UnsupportedError) as info:
            jax.jit(lambda a, b: opport.matmul(a, b))(odd, odd.T)
        assert "odd K" in str(info.value)


def test_conformance_runs_the_jax_kernels():
    report = run(Options(backends=("jax",), ops=("rmsnorm",), dtypes=("float32",), tier="smoke", workers=0,
                         cases=("row-12*", "offset-gemma", "large", "specials"), layouts=False, errors=False))
    kernels = {c["kernel"] for c in report.cases if c["status"] == "pass"}
    assert kernels == {"jax.rmsnorm", "jax.rmsnorm_backward"}, report.failures()
    assert report.exit_code == 0 and not report.failures()
