"""An op may return integer outputs beside floating ones (a router's expert indices, group offsets): declared with
`@<op>.outputs(..., integer=(...))`, judged exactly, and without a gradient in opport.vjp, torch and JAX.

A throwaway op declared here (never registered in opport.ops): `top1(x)` -> (each row's max, its index)."""

from __future__ import annotations

import numpy as np
import pytest

from opport import accuracy
from opport.autodiff import vjp
from opport.conformance.execute import poisoned
from opport.dispatch import impl
from opport.dtypes import np_dtype
from opport.public import function
from opport.spec import BASE_TOLERANCE, Case, Tolerance, op


@op(arrays=("x",))
def top1(x):
    """(each row's max, its index)."""


@top1.outputs(("value", "index"), integer=("index",))
def _outputs(x):
    return [((x.shape[0],), x.dtype), ((x.shape[0],), "int32")]


@top1.reference
def _reference(x):
    i = np.argmax(x, axis=1)
    return x[np.arange(x.shape[0]), i], i


@top1.backward(wrt=("x",))
def top1_backward(grad_value, x, index):
    """Saves x and the index output (integer: saved, never differentiated)."""


@top1_backward.reference
def _backward_reference(grad_value, x, index):
    d = np.zeros_like(x)
    d[np.arange(x.shape[0]), index.astype(np.int64)] = grad_value
    return (d,)


@impl(top1, "cpu")
def _top1_cpu(x):
    i = np.empty(x.shape[0], np.int32)  # np.empty: the conformance poison reaches integer buffers too
    i[:] = np.argmax(x, axis=1)
    return x[np.arange(x.shape[0]), i], i


@impl(top1.backward_op, "cpu")
def _top1_backward_cpu(grad_value, x, index):
    d = np.zeros_like(x)
    d[np.arange(x.shape[0]), index] = grad_value
    return (d,)


X = np.array([[0.5, 2.0, -1.0], [3.0, 1.0, 0.0]], np.float32)
WEIGHT = np.array([1.0, 2.0], np.float32)
EXPECTED = np.array([[0, 1, 0], [2, 0, 0]], np.float32)


def test_the_backward_takes_gradients_of_the_floating_outputs_only():
    assert top1.grad_outputs == ("value",)
    assert top1_backward.grads == ("grad_value",)
    assert top1_backward.params == ("grad_value", "x", "index")
    case = top1_backward.from_forward(Case("c", (X,)), "float32")
    assert case.args[0].shape == (2,) and case.args[2].dtype == np.int32  # the saved index, cast exactly


def test_integer_outputs_must_be_declared_among_the_outputs():
    with pytest.raises(TypeError, match="integer outputs"):
        top1.outputs(("value", "index"), integer=("idx",))(_outputs)
    with pytest.raises(TypeError, match="integer outputs"):
        top1.outputs(("index", "value"), integer=("index",))(_outputs)


def test_integer_outputs_are_judged_exactly():
    tol = BASE_TOLERANCE["float32"]
    assert accuracy.compare(np.array([2, 0], np.int32), np.array([2.0, 0.0]), tol, "int32").ok
    v = accuracy.compare(np.array([2, 1], np.int32), np.array([2.0, 0.0]), tol, "int32")
    assert not v.ok and v.worst["index"] == (1,) and "integer elements differ" in v.message
    # fp8 codes are no integers: judged by their tolerance (a regression caught by the gate once)
    q = np.array([448.0, 0.5]).astype(np_dtype("float8_e4m3fn"))
    assert accuracy.compare(q, np.array([447.0, 0.5]), Tolerance(0.01, 0.0), "float8_e4m3fn").ok


def test_the_poison_reaches_integer_buffers():
    with poisoned(np.nan):
        a = np.empty(3, np.int32)
    with poisoned(1234.5):
        b = np.empty(3, np.int32)
    assert (a == -1).all() and (b == 77).all()


def test_opport_vjp_pullback_takes_the_floating_gradient():
    (value, index), pullback = vjp(top1, top1.bind(X))
    assert index.dtype == np.int32 and index.tolist() == [1, 0]
    (dx,) = pullback(WEIGHT)
    np.testing.assert_array_equal(dx, EXPECTED)


def test_torch_autograd_sees_the_index_as_not_differentiable():
    torch = pytest.importorskip("torch")
    x = torch.tensor(X, requires_grad=True)
    value, index = function(top1)(x)
    assert index.dtype == torch.int32 and not index.requires_grad
    (value * torch.tensor(WEIGHT)).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), EXPECTED)


def test_jax_grad_through_an_op_with_an_integer_output():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy

    def loss(a):
        value, index = function(top1)(a)
        return (value * jnp.asarray(WEIGHT)).sum() + 0 * index.sum()

    np.testing.assert_array_equal(np.asarray(jax.grad(loss)(jnp.asarray(X))), EXPECTED)
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(X))), EXPECTED)
