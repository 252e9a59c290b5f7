"""Reverse mode through opport ops without a framework (`opport.vjp`), and what torch and JAX build on.

A differentiable op declares its backward beside its forward (`@<op>.backward`, opport/spec.py): an op
of its own, `<op>_backward`, dispatched like any op (explain() shows its choice, fallback to cpu warns
once, strict mode refuses). What the forward keeps for it is decided per op and named by the backward's
parameters (`saved_values`); ops that keep statistics (attention's and cross_entropy's log-sum-exp) run
their training forward, `<op>_forward`, which returns them beside the output.

An op that declares a fused value-and-grad (`@<op>.value_and_grad`: cross_entropy) runs it instead, where the
backend selected for the call has a kernel for it (`fused_op`: kernel presence in the registry, never a backend
name): the forward then also returns the gradients for a unit upstream gradient, and the backward is only
`scale_unit_grads`, upstream * gradient, skipped where the upstream is exactly 1. Elsewhere (a backend without
such a kernel, a plugin's) the training forward and the backward op run as above: nothing falls back.

    out, pullback = opport.vjp("rmsnorm", x, w)      # NumPy, torch or JAX arrays
    dx, dw = pullback(dy)                           # one gradient per differentiable input (None if absent)

An op with several outputs (add_rmsnorm's normed and sum) returns them as a tuple, and its pullback takes a
tuple of upstream gradients, one per output: `pullback((dnormed, dsum))`. Integer outputs (topk_router's
indices) take none: topk_router's pullback takes `dweights` alone.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np

from opport import errors
from opport.dispatch import call, takes
from opport.dispatch.adapters import meta_of
from opport.spec import check_grad


def require_backward(spec):
    """The op's BackwardSpec, or UnsupportedError when it declares none."""
    if spec.backward_op is None:
        raise errors.UnsupportedError(op=spec.name, arg=None, constraint=f"{spec.name}.differentiable",
                                      expected="an op that declares a backward", got="no backward",
                                      message=f"{spec.name}: not differentiable (it declares no backward)")
    return spec.backward_op


def training_forward(spec, bound: tuple, backend: str | None):
    """(out, stats): the op's output (a tuple of them for an op with several) and the statistics its backward
    needs (empty for most ops)."""
    require_backward(spec)
    if spec.train_forward is None:
        return call(spec, bound, backend), ()
    outs = call(spec.train_forward, bound, backend)
    if spec.n_outputs == 1:
        return outs[0], tuple(outs[1:])
    return tuple(outs[:spec.n_outputs]), tuple(outs[spec.n_outputs:])


def saved_values(spec, bound: tuple, out, stats: tuple) -> tuple:
    """What the backward receives after `grad`, in its parameter order: forward arguments by name, `out`,
    statistics; everything else the forward had is dropped (and can be freed). Where each comes from is worked
    out once per op (`_sources`): this runs on every training call, a decode step's included."""
    sources = _SOURCES.get(spec) or _sources(spec)
    picked = (bound, out, stats)
    return tuple(out if i is None else picked[k][i] for k, i in sources)


_SOURCES: dict = {}


def _sources(spec) -> tuple:
    """Per saved backward argument, (0, argument position), (1, output index; None for a single output) or (2,
    statistic index): by name, a statistic first, then an output ("out", or a saved output's name), then an argument."""
    bwd = spec.backward_op
    stats = spec.train_forward.stats if spec.train_forward is not None else ()
    outputs = ("out",) if spec.n_outputs == 1 else bwd.saved_outputs
    found = []
    for p in bwd.params[len(bwd.grads):]:
        if p in stats:
            found.append((2, stats.index(p)))
        elif p in outputs:
            found.append((1, None if spec.n_outputs == 1 else outputs.index(p)))
        else:
            found.append((0, spec.params.index(p)))
    _SOURCES[spec] = found = tuple(found)
    return found


def floating_grads(spec, grads: tuple) -> tuple:
    """Of one upstream gradient per output (what torch and JAX hand a backward rule), those of the floating
    outputs: an integer output (a router's indices) has no gradient."""
    return tuple(g for o, g in zip(spec.output_labels, grads) if o not in spec.integer_outputs)


def backward(spec, grad, saved: tuple, backend: str | None) -> tuple:
    """One gradient per name in the op's `wrt` (None where that input was None). `grad`: the upstream gradient,
    a tuple of them (one per floating output) for an op with several."""
    names = spec.backward_op.grads
    if len(names) > 1 and not (isinstance(grad, (tuple, list)) and len(grad) == len(names)):
        raise errors.ArgumentError(op=spec.backward_op.name, arg="grad", constraint=f"{spec.backward_op.name}.grad_shape",
                                   expected=f"a tuple of {len(names)} upstream gradients ({', '.join(names)})",
                                   got=type(grad).__name__)
    grads = (grad,) if len(names) == 1 else tuple(grad)
    return call(spec.backward_op, (*grads, *saved), backend)


def fused_op(spec, bound: tuple, backend: str | None):
    """The op's fused value-and-grad spec when it declares one and the backend this call selects has a kernel
    that takes it (no fallback), else None (the training forward and backward op run instead)."""
    vag = spec.value_and_grad_op
    return vag if vag is not None and takes(vag, bound, backend) else None


def fused_forward(spec, bound: tuple, backend: str | None) -> tuple:
    """(out, unit gradients): the fused value-and-grad's outputs, one gradient per name in `wrt` (None where absent)."""
    out, *grads = call(spec.value_and_grad_op, bound, backend)
    return out, tuple(grads)


def check_upstream(spec, grad, out) -> None:
    """The upstream gradient has the output's shape and dtype (the backward op's own check and constraint ids)."""
    g, o = meta_of(spec.backward_op, "grad", grad), meta_of(spec.backward_op, "grad", out)
    check_grad(spec.backward_op.name, g, o.shape, o.dtype)


def scale_unit_grads(grads: tuple, grad, in_place: bool) -> tuple:
    """Each unit gradient times the upstream `grad` (broadcast over its trailing dimensions: the output's shape is
    a prefix of the input's, as a per-row or scalar loss), rounded once to the gradient's dtype; returned as they
    are where `grad` is exactly 1 everywhere (one device sync for a GPU tensor). `in_place`: written into the
    gradients' own buffers (opport's, never the caller's arrays); else new arrays. NumPy and torch arrays."""
    if _all_ones(grad):
        return grads
    return tuple(None if g is None else _scaled(g, grad, in_place) for g in grads)


def _all_ones(grad) -> bool:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(grad, torch.Tensor):
        return bool((grad == 1).all())
    return bool(np.all(np.asarray(grad) == 1))


def _scaled(g, grad, in_place: bool):
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(g, torch.Tensor):
        acc = torch.float64 if g.dtype == torch.float64 else torch.float32
        u = grad.to(device=g.device, dtype=acc).reshape(tuple(grad.shape) + (1,) * (g.dim() - grad.dim()))
        if u.dim() == 0:  # a 0-d tensor does not promote a 16-bit one: give it a dimension so the product is in `acc`
            u = u.reshape((1,) * max(g.dim(), 1))
        return torch.mul(g, u, out=g) if in_place else torch.mul(g, u).to(g.dtype)
    acc = np.float64 if g.dtype == np.float64 else np.float32
    u = np.asarray(grad, acc).reshape(np.shape(grad) + (1,) * (g.ndim - np.ndim(grad)))
    with np.errstate(over="ignore", invalid="ignore"):
        if in_place:
            np.multiply(g.astype(acc), u, out=g, casting="unsafe")
            return g
        return (g.astype(acc) * u).astype(g.dtype)


def vjp(spec, bound: tuple, backend: str | None = None) -> tuple[object, Callable]:
    """(out, pullback): the op's output and `pullback(grad) -> gradients of its differentiable inputs`. Through
    the fused value-and-grad where it runs (the pullback then scales its gradients: new arrays each call, so
    it can be called again)."""
    if fused_op(spec, bound, backend) is not None:
        out, grads = fused_forward(spec, bound, backend)

        def scale(grad):
            check_upstream(spec, grad, out)
            return scale_unit_grads(grads, grad, in_place=False)

        return out, scale
    out, stats = training_forward(spec, bound, backend)
    saved = saved_values(spec, bound, out, stats)

    def pullback(grad):
        return backward(spec, grad, saved, backend)

    return out, pullback
