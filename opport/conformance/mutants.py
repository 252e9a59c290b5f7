"""Self-test of the gate (docs/numerics.md G4): five broken versions of every cpu kernel must each fail a case.

Each mutant is a backend (`mutant-zeros`, ...) whose kernels wrap the cpu kernels, so it sees the same
cases through the same dispatcher, poisoning and comparisons as a real backend. `self_test` runs
them and reports, per op and mutant, the first case that caught it (None = it survived).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from opport.conformance.cases import Selection, items_for
from opport.conformance.execute import run_item
from opport.conformance.gate import BAD
from opport.dtypes import FLOATS

MUTANTS = ("zeros", "input", "unwritten", "skip-last", "ignore-strides")


def _zeros(fn, spec):
    def kernel(*bound):
        out = np.asarray(fn(*bound))
        return np.zeros(out.shape, out.dtype)

    return kernel


def _input(fn, spec):
    return lambda *bound: bound[spec.array_pos[0]]


def _unwritten(fn, spec):
    def kernel(*bound):
        out = np.asarray(fn(*bound))
        return np.empty(out.shape, out.dtype)  # never written: what the allocator left

    return kernel


def _skip_last(fn, spec):
    def kernel(*bound):
        out = np.asarray(fn(*bound))
        res = np.empty(out.shape, out.dtype)
        if out.ndim:  # a 0-d output is its own row: its only element is the last
            res[..., :-1] = out[..., :-1]
        return res

    return kernel


def _ignore_strides(fn, spec):
    def kernel(*bound):
        args = [as_if_contiguous(a) if isinstance(a, np.ndarray) else a for a in bound]
        return fn(*args)

    return kernel


def as_if_contiguous(a: np.ndarray) -> np.ndarray:
    """What a kernel that indexes `a` as row-major from its data pointer reads (never past the buffer: zeros there)."""
    if a.flags.c_contiguous or a.size == 0:
        return a
    from numpy.lib.array_utils import byte_bounds

    start, end = byte_bounds(a)
    avail = min(a.size, (end - start) // a.itemsize)
    flat = np.lib.stride_tricks.as_strided(a, shape=(avail,), strides=(a.itemsize,), writeable=False)
    out = np.zeros(a.size, a.dtype)
    out[:avail] = flat
    return out.reshape(a.shape)


MAKERS = {"zeros": _zeros, "input": _input, "unwritten": _unwritten, "skip-last": _skip_last,
          "ignore-strides": _ignore_strides}


def install():
    """Register the five mutant backends and their kernels for every op (idempotent)."""
    from opport.dispatch import Backend, backends, get_backend, impl, kernels, register_backend
    from opport.ops import all_ops

    cpu = get_backend("cpu")
    for kind in MUTANTS:
        name = f"mutant-{kind}"
        if name not in backends():
            register_backend(Backend(name=name, package="opport.conformance", array_kind="numpy", device_types=(),
                                     dtypes=FLOATS, probe=lambda: None, mode=lambda: "mutant"))
        for spec in all_ops().values():
            for k in kernels(spec, cpu):
                impl(spec, name, dtypes=k.dtypes, supports=k.supports, priority=k.priority,
                     name=f"{name}.{k.name.split('.', 1)[-1]}")(MAKERS[kind](k.fn, spec))


def uninstall():
    """Remove the mutant backends and kernels again (so they never show up in `opport.backends()` afterwards)."""
    from opport.dispatch import unregister_backend

    for kind in MUTANTS:
        unregister_backend(f"mutant-{kind}")  # and its kernels


def self_test(ops=None, dtypes=("float32",), examples: int = 5) -> dict:
    """{(op, mutant): id of the first case that caught it, or None if it survived}."""
    from opport.ops import all_ops, get_op

    specs = [get_op(n) for n in ops] if ops else list(all_ops().values())
    sel = Selection("fast", examples, 0)
    install()
    try:
        return {(spec.name, kind): _first_kill(spec, f"mutant-{kind}", dtypes, sel) for spec in specs for kind in MUTANTS}
    finally:
        uninstall()


def _first_kill(spec, backend: str, dtypes, sel) -> str | None:
    """The first case the mutant fails while the real cpu kernel passes it (a fair kill)."""
    for dtype in dtypes:
        items = items_for(spec, backend, dtype, sel)
        items.sort(key=lambda it: it.source != "layout")  # strided views first: they catch ignore-strides
        for it in items:
            if run_item(it)["status"] in BAD and run_item(replace(it, backend="cpu"))["status"] == "pass":
                return it.id
    return None
