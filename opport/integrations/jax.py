"""opport ops inside `jax.jit` (and `vmap`, `grad`-free transforms): a host callback into the dispatcher.

Eager JAX arrays need nothing from here (the dispatcher's JAX adapter takes them). When an argument is
a tracer, the call is validated at trace time on its metadata (typed opport errors, as eagerly), the
output's shape and dtype come from the op's declaration, and the computation becomes a
`jax.pure_callback` that hands NumPy arrays to opport's dispatcher when the compiled function runs:
the cpu backend, or the backend named by `backend=` / `opport.use_backend` / `OPPORT_BACKEND`.

The backend name and strict mode in force when the function is traced are fixed into the callback
(a jitted function does not re-read Python state on later calls). On a GPU the callback still goes
through host memory; reaching the Triton kernels directly (DLPack, no host copy) is future work.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np

from opport.dispatch import call, context, strict
from opport.dispatch.adapters import meta_of
from opport.dtypes import np_dtype
from opport.spec import Meta


def traced_call(spec, bound: tuple, backend: str | None):
    """`opport.<op>(...)` with JAX tracers among the arrays: a pure callback with the declared output."""
    metas, slots, operands = list(bound), [], []
    for i in spec.array_pos:
        a = bound[i]
        if a is None:
            continue
        metas[i] = _meta(spec, spec.params[i], a)
        slots.append(i)
        operands.append(a)
    spec.validate(*metas)
    result = jax.ShapeDtypeStruct(spec.out_shape(metas), np_dtype(spec.out_dtype(metas)))
    template = tuple(None if i in slots else v for i, v in enumerate(bound))  # scalars only: no tracer kept
    chosen = backend if backend is not None else context.context_backend()
    host = _host_fn(spec, template, tuple(slots), chosen, context.context_strict())
    return jax.pure_callback(host, result, *operands, vmap_method="sequential")


def _meta(spec, arg: str, a) -> Meta:
    if isinstance(a, jax.core.Tracer):
        return Meta("jax", np.dtype(a.dtype).name, a.shape, None, "cpu")
    return meta_of(spec, arg, a)


def _host_fn(spec, template: tuple, slots: tuple, backend: str | None, strict_now: bool | None):
    """What runs on the host: the dispatcher on NumPy arrays, under the trace-time backend and strict mode."""

    def host(*arrays):
        args = list(template)
        for i, a in zip(slots, arrays):
            args[i] = a
        ctx = strict(strict_now) if strict_now is not None else contextlib.nullcontext()
        with ctx:
            return np.asarray(call(spec, tuple(args), backend))

    return host
