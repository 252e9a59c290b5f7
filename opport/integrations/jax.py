"""opport ops inside `jax.jit`, `vmap`, `jax.grad` and `jax.vjp`: the op's JAX formulation traced in where the
dispatcher selects one, else host callbacks into the dispatcher.

Eager JAX arrays need nothing from here (the dispatcher's JAX adapter takes them). When an argument is
a tracer, the call is validated at trace time on its metadata (typed opport errors, as eagerly) and each op it
runs (the forward, the training forward, the backward) is selected then, as the dispatcher selects for any call
(`opport.dispatch.select`: strict mode refuses, a fallback warns). Where the kernel selected takes JAX arrays
itself (a backend whose `array_kind` is "jax": opport/backends/jax, chosen for JAX arrays by default), it is called
on the tracers: its jnp code becomes part of the caller's XLA computation, nothing leaves it. Otherwise the
computation becomes a `jax.pure_callback` that hands NumPy arrays to opport's dispatcher when the compiled
function runs: the cpu backend, or the backend named by `backend=` / `opport.use_backend` / `OPPORT_BACKEND`.
Differentiable ops are a `jax.custom_vjp` either way: the forward rule runs the op's training forward and keeps
what its backward needs, the backward rule runs `<op>_backward` (traced in or through a callback). Forward-mode
`jax.jvp` is not available (JAX's own error for custom_vjp functions); a second derivative, or a gradient with
respect to a constant input (rope's tables), raises UnsupportedError at trace time.

The backend name and strict mode in force when the function is traced are fixed into the computation (a jitted
function does not re-read Python state on later calls). On a GPU the callback still goes through host memory;
reaching the Triton kernels directly (DLPack, no host copy) is future work.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from opport import errors
from opport.autodiff import floating_grads, saved_values
from opport.dispatch import backends, call, context, decide, kernel_args, select, strict
from opport.dispatch.adapters import meta_of, python_scalars
from opport.dtypes import np_dtype
from opport.spec import Meta


def traced_call(spec, bound: tuple, backend: str | None):
    """`opport.<op>(...)` with JAX tracers among the arrays: a pure callback with the declared output, and a
    custom VJP into opport's backward for differentiable ops. Everything a call is checked on eagerly
    (validation, the backend's name and availability, strict mode's kernel choice) is checked now, at
    trace time, so the typed error surfaces from `jax.jit(...)(...)` itself, not from the callback."""
    bound = python_scalars(spec, bound)
    metas, slots = list(bound), []
    for i in spec.array_pos:
        if bound[i] is not None:
            metas[i] = _meta(spec, spec.params[i], bound[i])
            slots.append(i)
    chosen = backend if backend is not None else context.context_backend()
    template = tuple(None if i in slots else v for i, v in enumerate(bound))  # scalars only: no tracer kept
    run = _Runner(template, tuple(slots), chosen, context.context_strict(), backend is not None)
    run.kernel(spec, metas)  # validation, the backend's name and availability, strict mode: raised now
    operands = [bound[i] for i in slots]
    if spec.backward_op is None:
        outs = run.apply(spec, metas, operands)
        return outs[0] if spec.n_outputs == 1 else tuple(outs)  # quantize_fp8: (q, scales)
    vag = spec.value_and_grad_op  # the fused value-and-grad where the chosen backend has a kernel for it
    if vag is not None and decide(vag, metas, context.requested_backend(chosen), True, chosen is not None)[1]:
        return _fused(spec, metas, run)(*operands)
    return _differentiable(spec, metas, run)(*operands)


class _Runner:
    """Runs an op under the trace-time backend and strict mode: its JAX kernel traced in, or its dispatcher on the
    host through a callback."""

    def __init__(self, template: tuple, slots: tuple, backend: str | None, strict_now: bool | None, by_keyword: bool):
        self.template, self.slots, self.backend, self.strict = template, slots, backend, strict_now
        self.name, self.strict_now = context.requested_backend(backend), context.is_strict()
        self.by_keyword = by_keyword

    def kernel(self, spec, metas):
        """The kernel the dispatcher selects for `spec` on these metadata, as a call would (its typed errors, strict
        mode's refusal, the fallback warning); the decision is the same when the callback's call makes it again."""
        return select(spec, metas, self.name, self.strict_now, self.by_keyword)[1]

    def apply(self, spec, metas, operands, bound_of=None) -> list:
        """`spec` on `operands`, its outputs (those not None) as a list: the selected kernel itself where it takes
        JAX arrays (traced into the caller's computation), else a host callback."""
        bound_of = bound_of or self.bound
        k = self.kernel(spec, metas)
        if backends()[k.backend].array_kind != "jax":
            return self.callback(spec, metas, operands, bound_of)
        out = k.fn(*kernel_args(spec, bound_of(operands)))
        return [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]

    def bound(self, operands) -> tuple:
        args = list(self.template)
        for i, a in zip(self.slots, operands):
            args[i] = a
        return tuple(args)

    def callback(self, spec, metas, operands, bound_of=None) -> list:
        """`spec` on `operands` through jax.pure_callback; its outputs (those not None) as a list."""
        shapes = [jax.ShapeDtypeStruct(m[0], np_dtype(m[1])) for m in spec.out_metas(metas) if m is not None]
        bound_of = bound_of or self.bound

        def host(*arrays):
            ctx = strict(self.strict) if self.strict is not None else contextlib.nullcontext()
            with ctx:
                out = call(spec, bound_of(arrays), self.backend)
            outs = out if isinstance(out, tuple) else (out,)
            return [np.asarray(o) for o in outs if o is not None]

        return list(jax.pure_callback(host, shapes, *operands, vmap_method="sequential"))


def _differentiable(spec, metas: list, run: _Runner):
    """The op as a jax.custom_vjp: the training forward saves what the backward needs (arrays as residuals,
    scalars fixed at trace time); the backward runs `<op>_backward`. Differentiating with respect to a
    constant (rope's tables) or differentiating the backward again raises UnsupportedError at trace time."""
    bwd = spec.backward_op
    trained = spec.train_forward or spec
    k = len(bwd.grads)  # upstream gradients: one per floating output
    n_out = spec.n_outputs
    names = [spec.params[i] for i in run.slots]  # the operands, in order
    carried = [p for p in bwd.params[k:] if p not in spec.params or p in names]  # outputs, stats, given arrays
    fixed = {p: run.template[spec.params.index(p)] for p in bwd.params[k:] if p not in carried}

    def backward_bound(grads, arrays) -> tuple:
        by_name = {**fixed, **dict(zip(carried, arrays)), **dict(zip(bwd.grads, grads))}
        return tuple(by_name[p] for p in bwd.params)

    def forward(*operands):
        outs = run.apply(spec, metas, operands)
        return outs[0] if n_out == 1 else tuple(outs)

    def fwd(*primals):
        _refuse_constants(spec, names, primals)
        values = [p.value for p in primals]
        outs = _once_differentiable(spec, lambda *ops: run.apply(trained, metas, ops))(*values)
        out, stats = (outs[0] if n_out == 1 else tuple(outs[:n_out])), tuple(outs[n_out:])
        saved = dict(zip(bwd.params[k:], saved_values(spec, run.bound(values), out, stats)))
        return out, tuple(saved[p] for p in carried)

    def bwd_rule(residuals, g):
        g = tuple(jnp.zeros(c.aval.shape, c.aval.dtype) if isinstance(c, SymbolicZero) else c
                  for c in ((g,) if n_out == 1 else floating_grads(spec, g)))
        bmetas = backward_bound([_meta(bwd, n, c) for n, c in zip(bwd.grads, g)],
                                [_meta(bwd, p, r) for p, r in zip(carried, residuals)])
        run_backward = _once_differentiable(
            spec, lambda *ops: run.apply(bwd, bmetas, ops, lambda a: backward_bound(a[:k], a[k:])))
        grads = iter(run_backward(*g, *residuals))
        by_name = {n: next(grads) for n in bwd.wrt if n in names}
        return tuple(by_name.get(n) for n in names)

    f = jax.custom_vjp(forward)
    f.defvjp(fwd, bwd_rule, symbolic_zeros=True)
    return f


def _fused(spec, metas: list, run: _Runner):
    """The op as a jax.custom_vjp through its fused value-and-grad: the forward rule keeps the unit gradients as
    residuals, the backward rule multiplies them by the cotangent (broadcast over their trailing dimensions),
    in float32 (float64 for float64) rounded once to their dtype; XLA fuses that product into its consumer."""
    vag = spec.value_and_grad_op
    names = [spec.params[i] for i in run.slots]
    present = [n for n in vag.wrt if n in names]

    def forward(*operands):
        return run.apply(spec, metas, operands)[0]

    def fwd(*primals):
        _refuse_constants(spec, names, primals)
        out, *grads = _once_differentiable(spec, lambda *ops: run.apply(vag, metas, ops))(*[p.value for p in primals])
        return out, tuple(grads)

    def bwd_rule(grads, g):
        if isinstance(g, SymbolicZero):
            g = jnp.zeros(g.aval.shape, g.aval.dtype)
        by_name = {}
        for n, d in zip(present, grads):
            acc = jnp.float64 if d.dtype == jnp.float64 else jnp.float32
            u = g.astype(acc).reshape(g.shape + (1,) * (d.ndim - g.ndim))
            by_name[n] = (d.astype(acc) * u).astype(d.dtype)
        return tuple(by_name.get(n) for n in names)

    f = jax.custom_vjp(forward)
    f.defvjp(fwd, bwd_rule, symbolic_zeros=True)
    return f


def _refuse_constants(spec, names: list, primals) -> None:
    bwd = spec.backward_op
    for name, p in zip(names, primals):
        if p.perturbed and name in bwd.constants:
            raise errors.UnsupportedError(
                op=spec.name, arg=name, constraint=f"{spec.name}.no_gradient", expected=f"no gradient for {name}",
                got="a gradient request", message=f"{spec.name}: no gradient for {name!r}: {bwd.constants[name]}")


def _once_differentiable(spec, fn):
    """`fn` (the backward's callback), refusing to be differentiated itself: double backward."""
    f = jax.custom_jvp(lambda *ops: tuple(fn(*ops)))

    @f.defjvp
    def _jvp(primals, tangents):
        raise errors.UnsupportedError(op=spec.name, arg=None, constraint=f"{spec.name}.double_backward",
                                      expected="first derivatives only", got="a second derivative",
                                      message=f"{spec.name}: double backward (gradients of gradients) is not "
                                              "supported by opport's backward kernels")

    return f


def _meta(spec, arg: str, a) -> Meta:
    if isinstance(a, jax.core.Tracer):
        return Meta("jax", np.dtype(a.dtype).name, a.shape, None, "cpu")
    return meta_of(spec, arg, a)
