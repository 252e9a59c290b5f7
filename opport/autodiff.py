"""Reverse mode through opport ops without a framework (`opport.vjp`), and what torch and JAX build on.

A differentiable op declares its backward beside its forward (`@<op>.backward`, opport/spec.py): an op
of its own, `<op>_backward`, dispatched like any op (explain() shows its choice, fallback to cpu warns
once, strict mode refuses). What the forward keeps for it is decided per op and named by the backward's
parameters (`saved_values`); ops that keep statistics (attention's and cross_entropy's log-sum-exp) run
their training forward, `<op>_forward`, which returns them beside the output.

    out, pullback = opport.vjp("rmsnorm", x, w)      # NumPy, torch or JAX arrays
    dx, dw = pullback(dy)                           # one gradient per differentiable input (None if absent)
"""

from __future__ import annotations

from collections.abc import Callable

from opport import errors
from opport.dispatch import call


def require_backward(spec):
    """The op's BackwardSpec, or UnsupportedError when it declares none."""
    if spec.backward_op is None:
        raise errors.UnsupportedError(op=spec.name, arg=None, constraint=f"{spec.name}.differentiable",
                                      expected="an op that declares a backward", got="no backward",
                                      message=f"{spec.name}: not differentiable (it declares no backward)")
    return spec.backward_op


def training_forward(spec, bound: tuple, backend: str | None):
    """(out, stats): the op's output and the statistics its backward needs (empty for most ops)."""
    require_backward(spec)
    if spec.train_forward is None:
        return call(spec, bound, backend), ()
    out, *stats = call(spec.train_forward, bound, backend)
    return out, tuple(stats)


def saved_values(spec, bound: tuple, out, stats: tuple) -> tuple:
    """What the backward receives after `grad`, in its parameter order: forward arguments by name, `out`,
    statistics; everything else the forward had is dropped (and can be freed)."""
    bwd = spec.backward_op
    by_name = dict(zip(spec.params, bound))
    by_name["out"] = out
    if spec.train_forward is not None:
        by_name.update(zip(spec.train_forward.stats, stats))
    return tuple(by_name[p] for p in bwd.params[1:])


def backward(spec, grad, saved: tuple, backend: str | None) -> tuple:
    """One gradient per name in the op's `wrt` (None where that input was None)."""
    return call(spec.backward_op, (grad, *saved), backend)


def vjp(spec, bound: tuple, backend: str | None = None) -> tuple[object, Callable]:
    """(out, pullback): the op's output and `pullback(grad) -> gradients of its differentiable inputs`."""
    out, stats = training_forward(spec, bound, backend)
    saved = saved_values(spec, bound, out, stats)

    def pullback(grad):
        return backward(spec, grad, saved, backend)

    return out, pullback
