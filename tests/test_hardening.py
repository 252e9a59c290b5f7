"""Inputs a new user (or an adversary) passes that used to give wrong answers or untyped errors (issue 15):
each either computes what the plain array would give, on every backend alike, or raises the op's typed
error naming the argument and a declared constraint, before any kernel runs."""

from __future__ import annotations

import numpy as np
import pytest

import opport
from opport.dispatch import backends, impl
from tests.conftest import fake_backend

torch = pytest.importorskip("torch")
BACKENDS = [name for name, b in backends().items() if not b.unavailable()]
# a call that no kernel of the backend takes runs on cpu, with a warning (docs/adding-a-backend.md): these
# tests judge the values and errors every backend gives, whichever kernel computes them
FALLBACK_ALLOWED = pytest.mark.filterwarnings("ignore::opport.FallbackWarning")
X = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)


def _same(got, want):
    __tracebackhide__ = True
    got = got.numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@FALLBACK_ALLOWED
def test_negative_bit_views_compute_their_values(backend):
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    x = torch.complex(a, b).conj().imag  # a view with the negative bit set: its values are -b
    assert x.is_neg()
    for op, args in (("softmax", (x,)), ("rmsnorm", (x, torch.ones(8))), ("matmul", (x, x.T.resolve_neg()))):
        want = getattr(opport, op)(*[t.resolve_neg() if isinstance(t, torch.Tensor) else t for t in args], backend="cpu")
        _same(getattr(opport, op)(*args, backend=backend), want.numpy())


@pytest.mark.parametrize("backend", BACKENDS)
@FALLBACK_ALLOWED
def test_masked_arrays_are_refused_everywhere(backend):
    m = np.ma.masked_array(X, mask=X > 1)
    for op, args in (("softmax", (m,)), ("matmul", (m, X.T)), ("attention", (m[None, None], X[None, None], X[None, None]))):
        with pytest.raises(opport.DTypeError) as info:
            getattr(opport, op)(*args, backend=backend)
        assert info.value.constraint == f"{op}.array_type" and "mask" in str(info.value)


@pytest.mark.parametrize("backend", BACKENDS)
@FALLBACK_ALLOWED
def test_ndarray_subclasses_and_unusual_layouts_compute_as_plain_arrays(backend):
    want = opport.softmax(X, backend="cpu")
    big_endian = X.astype(">f4")
    records = np.zeros(X.shape, dtype=[("a", "i1"), ("x", "<f4")])  # a field view: byte strides of 5, not 4
    records["x"] = X
    for x in (np.asmatrix(X), big_endian, records["x"]):
        out = opport.softmax(x, backend=backend)
        assert type(out) is np.ndarray
        _same(out, want)
    _same(opport.matmul(np.asmatrix(X), np.asmatrix(X.T), backend=backend), opport.matmul(X, X.T))


@pytest.mark.parametrize("backend", BACKENDS)
@FALLBACK_ALLOWED
def test_none_for_a_required_array_is_a_typed_error(backend):
    for op, args in (("softmax", (None,)), ("rmsnorm", (None,)), ("matmul", (X, None)), ("swiglu", (X, None))):
        with pytest.raises(opport.DTypeError) as info:
            getattr(opport, op)(*args, backend=backend)
        assert info.value.constraint == f"{op}.array_type" and info.value.got == "NoneType"
    with pytest.raises(opport.DTypeError):
        opport.explain("softmax", None)


def test_sparse_tensors_are_refused_before_any_kernel():
    sparse = torch.eye(4).to_sparse()
    for backend in BACKENDS:
        with pytest.raises(opport.DTypeError) as info:
            opport.softmax(sparse, backend=backend)
        assert info.value.arg == "x" and "sparse" in str(info.value)


@pytest.mark.parametrize("backend", BACKENDS)
@FALLBACK_ALLOWED
def test_numpy_scalars_and_0d_arrays_are_scalars(backend):
    q = np.random.default_rng(1).standard_normal((1, 2, 4, 8)).astype(np.float32)
    cos, sin = np.cos(q[0, 0, :, :4]), np.sin(q[0, 0, :, :4])
    t = np.array([1, 2, 0, 3])
    pairs = [
        (lambda e: opport.rmsnorm(X, eps=e, backend=backend), 1e-6, (np.float32(1e-6), np.array(1e-6))),
        (lambda a: opport.softmax(X, axis=a, backend=backend), 0, (np.int64(0), np.array(0))),
        (lambda c: opport.attention(q, q, q, causal=c, backend=backend), True, (np.bool_(True),)),
        (lambda i: opport.rope(q, cos, sin, interleaved=i, backend=backend), True, (np.bool_(True),)),
        (lambda s: opport.cross_entropy(X, t, label_smoothing=s, backend=backend), 0.25, (np.float32(0.25),)),
    ]
    for fn, plain, numpys in pairs:
        want = fn(plain)
        for v in numpys:
            np.testing.assert_array_equal(fn(v), want)


def test_errors_name_the_offending_array_and_a_declared_constraint():
    x, w = torch.randn(4, 8), torch.ones(8, device="meta")
    with pytest.raises(opport.DeviceError) as info:
        opport.rmsnorm(x, w)
    assert info.value.arg == "weight"  # the array on the unusable device, not the last array
    with pytest.raises(opport.BackendUnavailableError) as info:
        opport.softmax(X, backend="")  # an empty name is an unknown name, not "choose for me"
    assert info.value.constraint == "softmax.backend" and info.value.constraint in opport.get_op("softmax").constraints
    with fake_backend("picky"):
        impl(opport.softmax.spec, "picky", supports=lambda x, axis: "rows of 128 only")(lambda x, axis: x)
        with pytest.raises(opport.UnsupportedError) as info, opport.strict():
            opport.softmax(X, backend="picky")
    assert info.value.arg == "backend" and info.value.constraint in opport.get_op("softmax").constraints


def test_bad_thread_count_fails_small_calls_too(monkeypatch):
    monkeypatch.setenv("OPPORT_NUM_THREADS", "many")
    with pytest.raises(opport.ArgumentError) as info:
        opport.softmax(X[:1, :2], backend="cpu")
    assert info.value.arg == "OPPORT_NUM_THREADS"


def test_jax_jit_checks_the_backend_at_trace_time():
    jax = pytest.importorskip("jax")
    with pytest.raises(opport.BackendUnavailableError):
        jax.jit(lambda x: opport.softmax(x, backend="no-such-backend"))(jax.numpy.ones(3))
