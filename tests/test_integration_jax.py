"""opport ops on JAX arrays, eager and inside jax.jit / vmap: same values, dtype, shape and device."""

from __future__ import annotations

import numpy as np
import pytest

import opport
from opport.dispatch import impl
from opport.dispatch.adapters import metas_of
from opport.errors import ArgumentError, ShapeError
from opport.integrations import small_cases
from opport.public import function
from tests.conftest import fake_backend

jax = pytest.importorskip("jax")
jnp = jax.numpy

OPS = sorted(n for n in opport.all_ops() if not opport.get_op(n).writes)  # JAX arrays are immutable: no in-place ops


def _jax_args(case) -> tuple:
    return tuple(jnp.asarray(a) if isinstance(a, np.ndarray) else a for a in case.args)


def _split(args):
    """Array positions (traced) and the rest (static), so jit sees only arrays as arguments."""
    slots = [i for i, a in enumerate(args) if isinstance(a, jax.Array)]
    return slots, [args[i] for i in slots]


def _jitted(spec, args, kwargs):
    slots, arrays = _split(args)

    def f(*arrays):
        full = list(args)
        for i, a in zip(slots, arrays):
            full[i] = a
        return function(spec)(*full, **kwargs)

    return jax.jit(f), arrays


def _bits(a):
    return np.atleast_1d(np.asarray(a)).view(np.uint8)


def _assert_same(got, want):
    __tracebackhide__ = True
    if isinstance(want, tuple):  # ops with several outputs (quantize_fp8, add_rmsnorm)
        assert isinstance(got, tuple) and len(got) == len(want)
        for g, w in zip(got, want):
            _assert_same(g, w)
        return
    assert isinstance(got, jax.Array) and isinstance(want, jax.Array)
    assert got.dtype == want.dtype and got.shape == want.shape and got.devices() == want.devices()
    np.testing.assert_array_equal(_bits(got), _bits(want))  # the same kernel ran


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", OPS)
def test_jit_matches_eager(name, dtype):
    spec = opport.get_op(name)
    case = small_cases(spec, dtype, limit=1)[0]
    args = _jax_args(case)
    eager = function(spec)(*args, **case.kwargs)
    f, arrays = _jitted(spec, args, case.kwargs)
    _assert_same(f(*arrays), eager)
    ran = opport.explain(spec, *args, **case.kwargs).backend  # the jax backend's kernel where it has one (its bits)
    plain = function(spec)(*case.args, backend=ran, **case.kwargs)
    for e, p in zip(*((eager, plain) if isinstance(eager, tuple) else ((eager,), (plain,)))):
        np.testing.assert_array_equal(_bits(e), _bits(p))


def test_jit_output_feeds_jax_ops_and_traces_to_one_callback():
    x, w = jnp.linspace(-2, 2, 24, dtype=jnp.float32).reshape(3, 8), jnp.linspace(0.5, 1.5, 8, dtype=jnp.float32)
    f = jax.jit(lambda x, w: opport.silu(opport.rmsnorm(x * 2, w)) + 1)
    with opport.use_backend("cpu"):  # the callback path (by default the jnp kernels are traced in, and fused)
        _assert_same(f(x, w), opport.silu(opport.rmsnorm(x * 2, w)) + 1)
        (eqn,) = jax.make_jaxpr(lambda x, w: opport.rmsnorm(x, w))(x, w).eqns  # one custom-VJP call
    assert eqn.primitive.name == "custom_vjp_call"
    inner = eqn.params["call_jaxpr"].jaxpr
    assert [e.primitive.name for e in inner.eqns] == ["pure_callback"]  # ... around one host callback
    xla = jax.jit(lambda x, w: opport.silu(opport.rmsnorm(x * 2, w)) + 1)(x, w)  # traced afresh: the jax backend
    np.testing.assert_allclose(np.asarray(xla), np.asarray(opport.silu(opport.rmsnorm(x * 2, w)) + 1), rtol=1e-6)


def test_numpy_constants_mix_with_tracers():
    w = np.linspace(0.5, 1.5, 8, dtype=np.float32)
    x = jnp.ones((2, 8), jnp.float32)
    _assert_same(jax.jit(lambda x: opport.rmsnorm(x, w))(x), opport.rmsnorm(x, jnp.asarray(w)))


def test_vmap_runs_each_item_through_the_op():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 3, 8)), jnp.float32)
    batched = jax.jit(jax.vmap(lambda row: opport.softmax(row)))(x)
    _assert_same(batched, opport.softmax(x))


def test_bad_input_raises_the_typed_error_at_trace_time():
    x = jnp.ones((2, 8), jnp.float32)
    with pytest.raises(ArgumentError) as info:
        jax.jit(lambda x: opport.rmsnorm(x, eps=0.0))(x)
    assert info.value.constraint == "rmsnorm.eps"
    with pytest.raises(ShapeError) as info:
        jax.jit(lambda x, w: opport.rmsnorm(x, w))(x, jnp.ones(7, jnp.float32))
    assert info.value.constraint == "rmsnorm.weight_shape"


def test_backend_choice_is_fixed_when_the_function_is_traced():
    x = jnp.ones((2, 8), jnp.float32)

    def marker(value):
        return lambda x, weight, eps, offset: np.full(x.shape, value, x.dtype)

    with fake_backend("t_jax_ctx"), fake_backend("t_jax_named"):
        impl(opport.rmsnorm.spec, "t_jax_ctx")(marker(7.0))
        impl(opport.rmsnorm.spec, "t_jax_named")(marker(9.0))
        assert (jax.jit(lambda x: opport.rmsnorm(x, backend="t_jax_named"))(x) == 9.0).all()
        in_ctx = jax.jit(lambda x: opport.rmsnorm(x))
        with opport.use_backend("t_jax_ctx"):
            assert (in_ctx(x) == 7.0).all()
        assert (in_ctx(x) == 7.0).all()  # the cached trace keeps its backend
        _assert_same(jax.jit(lambda x: opport.rmsnorm(x))(x), opport.rmsnorm(x))


@pytest.mark.parametrize("name", OPS)
def test_declared_output_shape_and_dtype_match_the_cpu_kernel(name):
    """The rule jit (and torch's fake kernels) rely on, checked on the op's conformance cases."""
    spec = opport.get_op(name)
    cases = small_cases(spec, "float32", limit=50, max_elements=1 << 16)
    assert cases
    for case in cases:
        bound = spec.bind(*case.args, **case.kwargs)
        metas = metas_of(spec, bound)
        out = function(spec)(*bound)
        outs = out if isinstance(out, tuple) else (out,)  # quantize_fp8 returns (q, scales)
        assert [(o.shape, o.dtype.name) for o in outs] == spec.out_metas(metas), case.name
