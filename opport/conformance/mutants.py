"""Self-test of the gate (docs/numerics.md G4): broken versions of every cpu kernel must each fail a case.

Each mutant is a backend (`mutant-zeros`, ...) whose kernels wrap the cpu kernels, so it sees the same
cases through the same dispatcher, poisoning and comparisons as a real backend. `self_test` runs
them and reports, per op and mutant, the first case that caught it (None = it survived).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from opport.conformance.cases import Selection, items_for, size
from opport.conformance.execute import run_item
from opport.conformance.gate import BAD
from opport.dtypes import FLOATS

MUTANTS = ("zeros", "input", "unwritten", "skip-last", "ignore-strides")
GRAD_MUTANT = "mutant-grad"  # the backend that runs each op's declared backward mutants, one at a time


def _each(out, fn):
    """`fn` applied to each output of a kernel (derived ops return several; None stays None)."""
    if isinstance(out, tuple):
        return tuple(None if o is None else fn(np.asarray(o)) for o in out)
    return fn(np.asarray(out))


def _zeros(fn, spec):
    return lambda *bound: _each(fn(*bound), lambda o: np.zeros(o.shape, o.dtype))


def _input(fn, spec):
    if spec.n_outputs > 1:  # several outputs: hand back the first array for each
        return lambda *bound: _each(fn(*bound), lambda o: bound[spec.array_pos[0]])
    return lambda *bound: bound[spec.array_pos[0]]


def _unwritten(fn, spec):
    return lambda *bound: _each(fn(*bound), lambda o: np.empty(o.shape, o.dtype))  # what the allocator left


def _skip_last(fn, spec):
    def drop_last(o):
        res = np.empty(o.shape, o.dtype)
        if o.ndim:  # a 0-d output is its own row: its only element is the last
            res[..., :-1] = o[..., :-1]
        return res

    return lambda *bound: _each(fn(*bound), drop_last)


def _ignore_strides(fn, spec):
    def kernel(*bound):
        args = [as_if_contiguous(a) if isinstance(a, np.ndarray) else a for a in bound]
        return fn(*args)

    return kernel


def as_if_contiguous(a):
    """What a kernel that indexes `a` as row-major from its data pointer reads (never past the buffer: zeros there).
    NumPy arrays and torch tensors (on their own device) alike."""
    if hasattr(a, "is_contiguous"):
        return _torch_as_if_contiguous(a)
    if a.flags.c_contiguous or a.size == 0:
        return a
    if a.dtype.kind == "V" or a.dtype.str == "<f1":  # ml_dtypes (bfloat16, fp8): as_strided loses them; move the bits
        return as_if_contiguous(a.view(f"u{a.itemsize}")).view(a.dtype)
    from numpy.lib.array_utils import byte_bounds

    start, end = byte_bounds(a)
    avail = min(a.size, (end - start) // a.itemsize)
    flat = np.lib.stride_tricks.as_strided(a, shape=(avail,), strides=(a.itemsize,), writeable=False)
    out = np.zeros(a.size, a.dtype)
    out[:avail] = flat
    return out.reshape(a.shape)


def _torch_as_if_contiguous(t):
    import torch

    if t.is_contiguous() or t.numel() == 0:
        return t
    avail = min(t.numel(), t.untyped_storage().nbytes() // t.element_size() - t.storage_offset())
    out = torch.zeros(t.numel(), dtype=t.dtype, device=t.device)
    out[:avail] = t.as_strided((avail,), (1,), t.storage_offset())
    return out.view(t.shape)


MAKERS = {"zeros": _zeros, "input": _input, "unwritten": _unwritten, "skip-last": _skip_last,
          "ignore-strides": _ignore_strides}


def install():
    """Register the five mutant backends and their kernels for every op, training forward and backward
    (idempotent), and the empty backend that runs the declared backward mutants."""
    from opport.dispatch import Backend, backends, get_backend, impl, kernels, register_backend
    from opport.ops import all_ops, with_derived

    cpu = get_backend("cpu")
    for name in (*(f"mutant-{kind}" for kind in MUTANTS), GRAD_MUTANT):
        if name not in backends():
            register_backend(Backend(name=name, package="opport.conformance", array_kind="numpy", device_types=(),
                                     dtypes=FLOATS, probe=lambda: None, mode=lambda: "mutant"))
    for kind in MUTANTS:
        for spec in with_derived(all_ops().values()):
            for k in kernels(spec, cpu):
                impl(spec, f"mutant-{kind}", dtypes=k.dtypes, supports=k.supports, priority=k.priority,
                     name=f"mutant-{kind}.{k.name.split('.', 1)[-1]}")(MAKERS[kind](k.fn, spec))


def uninstall():
    """Remove the mutant backends and kernels again (so they never show up in `opport.backends()` afterwards)."""
    from opport.dispatch import unregister_backend

    for name in (*(f"mutant-{kind}" for kind in MUTANTS), GRAD_MUTANT):
        unregister_backend(name)  # and its kernels


def self_test(ops=None, dtypes=("float32",), examples: int = 5) -> dict:
    """{(op, mutant): id of the first case that caught it, or None if it survived}: the five generic mutants
    of every op, training forward and backward, and each declared mutant (a dropped term, an ignored argument, a
    gradient not summed over rows, a wrong scale: `@<op>_backward.mutant`)."""
    from opport.ops import all_ops, get_op, with_derived

    specs = with_derived([get_op(n) for n in ops] if ops else all_ops().values())
    sel = Selection("fast", examples, 0)
    install()
    try:
        kills = {(spec.name, kind): _first_kill(spec, f"mutant-{kind}", dtypes, sel) for spec in specs for kind in MUTANTS}
        for spec in specs:
            for name, fn in getattr(spec, "mutants", {}).items():
                kills[(spec.name, name)] = _declared_kill(spec, name, fn, dtypes, sel)
        return kills
    finally:
        uninstall()


def _declared_kill(spec, name: str, fn, dtypes, sel) -> str | None:
    """A declared mutant (mostly a backward's; a forward's such as rmsnorm's offset-ignored), run as the only kernel of
    the mutant-grad backend."""
    from opport.dispatch import impl, remove_kernel

    kname = f"{GRAD_MUTANT}.{spec.name}.{name}"
    impl(spec, GRAD_MUTANT, name=kname)(_as_kernel(spec, fn))
    try:
        return _first_kill(spec, GRAD_MUTANT, dtypes, sel)
    finally:
        remove_kernel(spec, GRAD_MUTANT, kname)


def _as_kernel(spec, fn):
    """A float64 mutant function as a kernel: inputs upcast, each output rounded to its declared dtype."""
    from opport.dtypes import np_dtype

    single = spec.n_outputs == 1 and not spec.returns_list  # a forward's one array (rmsnorm's offset-ignored)

    def kernel(*bound):
        args = [a.astype(np.float64) if isinstance(a, np.ndarray) and a.dtype.kind in "fV" else a for a in bound]
        with np.errstate(all="ignore"):
            outs = fn(*args)
        metas = spec.out_metas(bound)
        outs = tuple(None if o is None else np.asarray(o).astype(np_dtype(getattr(m[1], "name", m[1])))
                     for o, m in zip((outs,) if single else outs, metas))
        return outs[0] if single else outs

    return kernel


# --------------------------------------------------------------------------- strides, on every backend


def stride_kills(spec, backend: str, dtype: str = "float32") -> dict:
    """{array argument: the first fast-tier layout case that catches `backend`'s kernels reading that argument with
    contiguous strides from its data pointer (None: none did)}, for each argument some case gives a strided view.

    The bug class of a kernel, or a launcher that does not pass an input's strides (cuda cross_entropy_backward
    once read a sliced lse that way: NaN gradients). The mutant is each of the backend's kernels with that one
    argument replaced by `as_if_contiguous`, registered above them for the duration; the cases are what the fast
    tier runs on this backend, so a survivor means the gate would miss the bug there.
    """
    from opport.dispatch import get_backend, impl, kernels, remove_kernel

    b = get_backend(backend)
    sel = Selection("fast", 0, 0, emulated=b.capabilities.emulated())
    items = sorted((it for it in items_for(spec, backend, dtype, sel) if it.source == "layout"), key=lambda it: size(it.case))
    real = kernels(spec, b)
    out = {}
    for pos in spec.array_pos:
        hits = [it for it in items if _strided(spec, it, pos)]
        if not hits:
            continue
        names = []
        for k in real:
            names.append(f"{k.name}.stride-mutant")
            impl(spec, backend, dtypes=k.dtypes, supports=k.supports, priority=k.priority + 1000, name=names[-1],
                 deterministic=k.deterministic)(_contiguous_at(k.fn, pos))
        try:
            # "fail", not any bad status: a mutant that raised (error) would prove nothing about the cases; but an
            # index array (cu_seqlens) read as contiguous holds garbage offsets, and a kernel raising on them is
            # the bug showing: the gate reports that error too
            index = getattr(spec.bind(*hits[0].case.args, **hits[0].case.kwargs)[pos], "dtype", np.dtype("f")).kind in "iu"
            caught_by = ("fail", "error") if index else ("fail",)
            caught = next((it.id for it in hits[:TRIES] if run_item(it)["status"] in caught_by), None)
            out[spec.params[pos]] = caught if caught or _reads(spec, hits[0].case, pos) else UNREAD
        finally:
            for n in names:
                remove_kernel(spec, backend, n)
    return out


TRIES = 6  # strided cases tried per argument before calling the mutant a survivor
UNREAD = "unread"  # the reference's outputs do not depend on the argument's values (matmul_backward's bias)


def _reads(spec, case, pos: int) -> bool:
    """Whether the reference's outputs change when the argument at `pos` changes (its values, not its shape)."""
    bound = list(spec.bind(*case.args, **case.kwargs))
    first = spec.run_reference(*bound)
    bound[pos] = bound[pos] * 2 + 1
    try:
        second = spec.run_reference(*bound)
    except (IndexError, ValueError):  # an index array (cu_seqlens) sent out of range: its values are read
        return True
    pairs = zip(first, second) if isinstance(first, tuple) else [(first, second)]
    return any(x is not None and not np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True) for x, y in pairs)


def _strided(spec, item, pos: int) -> bool:
    """Whether `item`'s layout gives the argument at signature position `pos` a non-contiguous view."""
    from opport.conformance.cases import _arg_applies

    a = spec.bind(*item.case.args, **item.case.kwargs)[pos]
    return isinstance(a, np.ndarray) and item.layout != "offset" and _arg_applies(item.layout, a)


def _contiguous_at(fn, pos: int):
    def kernel(*bound):
        args = list(bound)
        args[pos] = as_if_contiguous(args[pos])
        return fn(*args)

    return kernel


def _first_kill(spec, backend: str, dtypes, sel) -> str | None:
    """The first case the mutant fails while the real cpu kernel passes it (a fair kill)."""
    for dtype in dtypes:
        items = items_for(spec, backend, dtype, sel)
        items.sort(key=lambda it: it.source != "layout")  # strided views first: they catch ignore-strides
        for it in items:
            if run_item(it)["status"] in BAD and run_item(replace(it, backend="cpu"))["status"] == "pass":
                return it.id
    return None
