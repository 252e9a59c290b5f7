"""Backend and kernel selection (docs/design.md section 4), the cached call path, and `explain`.

Hot path: `call` builds a hashable key from the op, the arrays' adapter keys (dtype, shape, strides,
device), the scalar arguments and the backend/strict settings (`key_function`). A hit reuses a `Plan`
(validation already passed for that key, kernel chosen, converters fixed); a miss validates the
metadata, selects, and stores the plan in the registry's cache. Validation and `supports(...)` see
only metadata, so the cache can never skip a check that the data would change.
"""

from __future__ import annotations

import sys
import threading
import warnings
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from opport import errors
from opport.dispatch import context, registry
from opport.dispatch.adapters import NumpyAdapter, adapter_for, array_type_error, metas_of, python_scalars
from opport.dispatch.registry import backend_for_device, backends, get_backend, kernels
from opport.dtypes import np_dtype


class FallbackWarning(UserWarning):
    """A kernel could not take a call and opport ran it on the cpu backend instead."""


_warned: set = set()
_warn_lock = threading.Lock()


# --------------------------------------------------------------------------- decisions


@dataclass
class Decision:
    """Why a call runs where it runs: what `opport.explain` shows."""

    op: str
    backend: str
    mode: str
    kernel: str | None
    requested: str  # how the backend was chosen
    candidates: list = field(default_factory=list)  # (backend, kernel, reason or None if taken)
    fallback: str | None = None  # why the requested backend's kernels were not used
    fallback_from: str | None = None  # the backend that was requested and declined
    error: str | None = None  # what the call would raise (strict mode)

    def __str__(self):
        lines = [f"{self.op}: backend {self.backend} ({self.mode}), kernel {self.kernel or '-'}",
                 f"  backend chosen by: {self.requested}"]
        if self.fallback:
            lines.append(f"  fell back from {self.fallback_from} to cpu because: {self.fallback}")
        if self.error:
            lines.append(f"  raises: {self.error}")
        for b, k, reason in self.candidates:
            lines.append(f"  [{'x' if reason is None else ' '}] {b}:{k}" + ("" if reason is None else f" - {reason}"))
        return "\n".join(lines)

    __repr__ = __str__

    def __rich__(self):
        from rich.markup import escape
        from rich.table import Table

        t = Table(title=escape(f"{self.op} -> {self.backend} ({self.mode}) : {self.kernel or '-'}"),
                  caption=escape(self.requested))
        for col in ("backend", "kernel", "taken", "reason"):
            t.add_column(col)
        for b, k, reason in self.candidates:
            t.add_row(escape(b), escape(k), "yes" if reason is None else "no", escape(reason or ""))
        if self.fallback:
            t.add_row("", "", "", escape(f"fell back from {self.fallback_from} to cpu: {self.fallback}"))
        return t


class Plan:
    """A cached decision plus the conversions that run it."""

    __slots__ = ("fn", "convert", "back", "direct", "first", "decision", "kernel", "lock", "writes", "check", "guest")

    def __init__(self, kernel, convert, back, first, decision, lock=None, op=None, check=None, guest=None):
        self.kernel, self.convert, self.back, self.lock = kernel, convert, back, lock
        self.check = check  # values validation cannot see (slot indices, scales, labels): on the caller's arrays
        # the kernel takes the caller's arrays and returns their kind, and nothing else runs
        self.direct = not convert and back is None and check is None
        self.fn = kernel.fn if lock is None else _serial(kernel.fn, lock)
        self.guest = guest  # the backend's wrapper for a kernel run on another framework's arrays (Backend.guest)
        if guest is not None:
            self.fn = guest(self.fn)
        self.writes = getattr(op, "write_pos", ())  # arguments written in place: copied back where converted
        self.first, self.decision = first, decision


_backend_locks: dict = {}


def value_check(op, bound: tuple):
    """The op's value check (`@<op>.check_values`) as `check(bound)` for a plan, or None: it reads the arrays at its
    positions on the host before any conversion or kernel. A check declared with `fn.on_device = False` would
    cost a device synchronisation per call (cross_entropy's labels on a GPU): on device arrays it runs only while
    OPPORT_CHECK_VALUES=1 (read per call), on host arrays (NumPy, CPU tensors, CPU JAX arrays) always."""
    found = getattr(op, "_value_check", None)
    if found is None:
        return None
    positions, fn = found
    if getattr(fn, "on_device", True) or all(_on_host(bound[i]) for i in positions if bound[i] is not None):
        return partial(_check_values, positions=positions, fn=fn)
    return partial(_check_values_if_asked, positions=positions, fn=fn)


def _on_host(a) -> bool:
    return a.__class__ is np.ndarray or adapter_for(a).meta(a).device == "cpu"


def _check_values(bound: tuple, positions: tuple, fn):
    fn(*_host_values(bound, positions))


def _check_values_if_asked(bound: tuple, positions: tuple, fn):
    if context.check_values():
        fn(*_host_values(bound, positions))


def _host_values(args: tuple, positions: tuple) -> tuple:
    """`args` with the arrays at `positions` as NumPy (read back from a device: a synchronisation)."""
    out = list(args)
    for i in positions:
        a = args[i]
        if a is not None and not isinstance(a, np.ndarray):
            out[i] = adapter_for(a).to_numpy(a)
    return tuple(out)


def _write_back(op: str, positions: tuple, orig: tuple, conv: list):
    """Copy what the kernel wrote into a converted argument (a device copy, a native copy) back into the
    caller's array, so an op that writes in place does so whatever backend ran it."""
    for i in positions:
        a, c = orig[i], conv[i]
        if c is a or a is None:
            continue
        if isinstance(a, np.ndarray):
            got = c if isinstance(c, np.ndarray) else adapter_for(c).to_numpy(c)
            if not np.shares_memory(a, got):
                np.copyto(a, got)
        elif hasattr(a, "copy_"):  # a torch tensor (opport never imports torch itself)
            src = c if hasattr(c, "copy_") else NumpyAdapter.to_torch(np.ascontiguousarray(c), str(a.device))
            if src.data_ptr() != a.data_ptr():
                a.copy_(src)
        else:
            raise errors.DTypeError(op=op, arg=f"argument {i}", constraint=f"{op}.array_type",
                                    expected="a NumPy array or torch tensor (written in place)", got=type(a).__name__)


def _serial(fn, lock):
    def run(*args):
        with lock:
            return fn(*args)

    return run


# --------------------------------------------------------------------------- the call path

_SELECTIONS = registry.SELECTIONS  # the registry owns and invalidates it; the hot path only reads and fills it


def call(op, bound: tuple, backend: str | None):
    """Run op `op` on its bound arguments (signature order) on the selected kernel."""
    key_fn = _key_functions.get(op) or key_function(op)
    try:
        key = key_fn(bound, backend)
    except Exception:  # an array the inline reads cannot describe (a sparse tensor has no strides)
        metas_of(op, bound)  # raises the op's typed error for it
        raise
    try:
        plan = _SELECTIONS.get(key)
    except TypeError:  # an unhashable scalar: validation will say what is wrong with it
        plan = None
    if plan is None:
        plan = _miss(op, bound, backend, key, key_fn)
    if plan.direct:
        return plan.fn(*bound)
    return _run_converted(plan, bound)


def plan_of(op, bound: tuple, backend: str | None) -> Plan:
    """The plan a call of `op` on `bound` runs (cached like a call's), without running it: validation errors are
    raised as the call would raise them. For paths that run the same kernel another way (torch's native nodes)."""
    key_fn = _key_functions.get(op) or key_function(op)
    key = key_fn(bound, backend)
    try:
        plan = _SELECTIONS.get(key)
    except TypeError:  # an unhashable scalar
        plan = None
    return plan if plan is not None else _miss(op, bound, backend, key, key_fn)


def _miss(op, bound: tuple, backend: str | None, key: tuple, key_fn) -> Plan:
    """Plan a call the cache has not seen, and cache the plan if the settings did not change meanwhile."""
    name = context.requested_backend(backend)
    plan = _plan(op, bound, name, context.is_strict(), backend is not None)
    try:
        if key_fn(bound, backend) == key:  # the settings read for the key are the ones just planned with
            if len(_SELECTIONS) >= registry.SELECTIONS_MAX:
                registry.clear_cache()
            _SELECTIONS[key] = plan
    except TypeError:  # an unhashable scalar that validation accepted: the plan runs, uncached
        pass
    return plan


# --------------------------------------------------------------------------- the selection key

_key_functions: dict = {}


class _NoClass:
    """Stands for torch.Tensor in the key functions until a torch tensor is first seen (opport never
    imports torch itself)."""


_TENSOR = [_NoClass]


def key_function(op, env_get=None, env_key=None):
    """The op's selection-key function `key(bound, backend)`, generated once per op for its argument positions.

    Contract (tested): two calls get the same key only if they would plan the same way. The key holds,
    per array, its class and its adapter key (`NumpyAdapter.key` / `TorchAdapter.key`, inlined for NumPy
    arrays and plain torch tensors; other arrays go through `adapter_for`); per scalar, its value and
    class (True == 1 == 1.0 hash alike, but validation tells them apart); then the backend setting
    (keyword, else use_backend(), else OPPORT_BACKEND as read) and the strict settings (strict() and
    OPPORT_STRICT as read). Nothing reads the key back by position: a miss re-reads the settings itself
    (opport.dispatch.context). Straight-line code costs about half a generic loop over adapters.
    `env_get`/`env_key` replace the environment reader (tests run both readers).
    """
    lines, parts = [], ["op"]
    for i in op.array_pos:  # the NP and TENSOR branches are NumpyAdapter.key and TorchAdapter.key, inlined
        lines += [f"a{i} = b[{i}]",
                  f"c{i} = a{i}.__class__",
                  f"if c{i} is NP: k{i} = (a{i}.dtype, a{i}.shape, a{i}.strides)",
                  f"elif c{i} is TENSOR[0]: k{i} = (a{i}.dtype, a{i}.shape, a{i}.stride(), a{i}.device)",
                  f"elif a{i} is None: k{i} = None",
                  f"else: k{i} = other(op, {i}, a{i})"]
        parts += [f"c{i}", f"k{i}"]
    for i in op.scalar_pos:
        lines.append(f"s{i} = b[{i}]")
        parts += [f"s{i}", f"s{i}.__class__"]
    parts += ["backend if backend is not None else (backend_ctx() or env(K_BACKEND))", "strict_ctx()", "env(K_STRICT)"]
    if getattr(op, "batch_args", ()):  # the batch-invariant mode decides whether its plan may run (`_plan`)
        parts += ["batch_ctx()", "env(K_BATCH)"]
    lines.append(f"return ({', '.join(parts)})")
    src = "def key(b, backend):\n" + "".join(f"    {ln}\n" for ln in lines)
    get, keyname = (context.ENV_GET, context.ENV_KEY) if env_get is None else (env_get, env_key)
    scope = dict(op=op, NP=np.ndarray, TENSOR=_TENSOR, other=_other_key, backend_ctx=context.context_backend,
                 strict_ctx=context.context_strict, env=get, K_BACKEND=keyname(context.BACKEND_VAR),
                 K_STRICT=keyname(context.STRICT_VAR), batch_ctx=context.context_batch_invariant,
                 K_BATCH=keyname(context.BATCH_INVARIANT_VAR))
    exec(compile(src, f"<opport key {op.name}>", "exec"), scope)
    if env_get is None:
        _key_functions[op] = scope["key"]
    return scope["key"]


def _other_key(op, i: int, a):
    """The adapter key of an array that is neither a NumPy array nor a plain torch tensor seen before."""
    ad = adapter_for(a)
    if ad is None:
        raise array_type_error(op, op.params[i], a)
    if ad.kind == "torch" and _TENSOR[0] is _NoClass:
        _TENSOR[0] = sys.modules["torch"].Tensor  # from now on the key functions read plain tensors inline
    return ad.key(a)


def takes(op, bound: tuple, backend: str | None) -> bool:
    """Whether the backend a call of `op` would select (keyword, use_backend, OPPORT_BACKEND, else the arrays'
    device) has a kernel that takes it, without falling back to cpu: capability as data, asked of the registry.
    Autograd asks it of a derived op it may run instead of another (a fused value-and-grad). Validation errors
    are raised as a call would raise them. Cached beside the dispatcher's selections (cleared with them when a
    backend or kernel comes or goes)."""
    key_fn = _key_functions.get(op) or key_function(op)
    try:
        key = ("takes", key_fn(bound, backend))
        found = _SELECTIONS.get(key)
    except TypeError:  # an unhashable scalar: decide without caching
        key, found = None, None
    if found is None:
        metas = metas_of(op, python_scalars(op, bound))
        decision, kernel = decide(op, metas, context.requested_backend(backend), True, backend is not None)
        found = kernel is not None
        if key is not None:
            if len(_SELECTIONS) >= registry.SELECTIONS_MAX:
                registry.clear_cache()
            _SELECTIONS[key] = found
    return found


def _run_converted(plan: Plan, bound: tuple):
    if plan.check is not None:
        plan.check(bound)
    like, orig = bound[plan.first], bound
    if plan.convert:
        bound = list(bound)
        for i, f in plan.convert:
            if bound[i] is not None:
                bound[i] = f(bound[i])
    out = plan.fn(*bound)
    if plan.writes:
        _write_back(plan.decision.op, plan.writes, orig, bound)
    if plan.back is None or out is None:  # None: an op that writes in place
        return out
    if out.__class__ is tuple:  # a derived op's several outputs (gradients, forward + statistics); None stays None
        return tuple(None if o is None else plan.back(o, like) for o in out)
    return plan.back(out, like)


def _plan(op, bound: tuple, name: str | None, strict_now: bool, by_keyword: bool) -> Plan:
    scalars = python_scalars(op, bound)  # NumPy scalars and 0-d arrays in scalar positions as Python scalars
    metas = metas_of(op, scalars)
    decision, kernel = select(op, metas, name, strict_now, by_keyword)
    for i in op.write_pos:  # written in place: the caller's own memory must be writable by a kernel or a copy-back
        if bound[i] is not None and adapter_for(bound[i]).kind not in ("numpy", "torch"):
            raise errors.DTypeError(op=op.name, arg=op.params[i], constraint=f"{op.name}.array_type",
                                    expected="a NumPy array or torch tensor (written in place; JAX arrays are immutable)",
                                    got=type(bound[i]).__name__)
    plan = _make_plan(op, bound, kernel, decision)
    changed = tuple((i, _as_python) for i in op.scalar_pos if scalars[i] is not bound[i])
    if changed:
        plan = Plan(kernel, plan.convert + changed, plan.back, plan.first, decision, plan.lock, op, plan.check,
                    plan.guest)
    return plan


def select(op, metas: list, name: str | None, strict_now: bool, by_keyword: bool):
    """`decide`, then what a call does with the decision before it runs: UnsupportedError where no kernel takes it
    (strict mode, or nothing on cpu either), the fallback warning, the batch-invariant check. (Decision, Kernel).
    The dispatcher's plans and JAX's traced calls (opport/integrations/jax.py) both go through it."""
    decision, kernel = decide(op, metas, name, strict_now, by_keyword)
    if kernel is None:
        raise errors.UnsupportedError(op=op.name, arg="backend", constraint=f"{op.name}.supported",
                                      expected=f"a {decision.backend} kernel that takes this call",
                                      got=decision.error, message=f"{op.name}: {decision.error}")
    if decision.fallback:
        _warn_once(op.name, decision.fallback_from, decision.fallback)
    if getattr(op, "batch_args", ()) and context.is_batch_invariant():
        _check_batch_invariant(op.name, kernel.backend, strict_now)
    return decision, kernel


def _as_python(v):
    return v.item()


def decide(op, metas: list, name: str | None, strict_now: bool, by_keyword: bool = False):
    """Validate the metadata, then pick backend and kernel. Returns (Decision, Kernel or None)."""
    arrays = [(op.params[i], metas[i]) for i in op.array_pos if metas[i] is not None]
    usable = {t for b in backends().values() for t in b.device_types} | {"cpu"}
    for arg, m in arrays:  # name the first array on a device no backend can use
        if m.device_type not in usable:
            raise errors.DeviceError(op=op.name, arg=arg, constraint=f"{op.name}.device",
                                     expected="arrays on a device some backend can use", got=m.device)
    odd = next((arg for arg, m in arrays if m.device != arrays[0][1].device), None)
    if odd is not None:  # name the first array not on the first array's device
        raise errors.DeviceError(op=op.name, arg=odd, constraint=f"{op.name}.device",
                                 expected=f"all arrays on one device ({arrays[0][1].device}, as {arrays[0][0]})",
                                 got=", ".join(sorted({m.device for _, m in arrays})))
    device_type = arrays[0][1].device_type if arrays else "cpu"
    op.validate(*metas)
    _check_out_sizes(op, metas)

    if name is not None:
        requested = "backend= keyword" if by_keyword else context.how_requested(None)
        b = get_backend(name, op.name)
        b.require(op.name)  # both raise BackendUnavailableError with the constraint id <op>.backend
        if b.name != "cpu" and device_type != "cpu" and device_type not in b.device_types:
            raise errors.DeviceError(op=op.name, arg=arrays[0][0], constraint=f"{op.name}.device",
                                     expected=f"arrays on cpu or {'/'.join(b.device_types)} for backend {b.name}",
                                     got=device_type)
        fallback = None
    else:
        kind = arrays[0][1].kind if arrays else None
        b = backend_for_device(device_type, kind, op)
        requested = f"input device {device_type}" + (f" ({kind} arrays)" if b.array_kind == kind != "numpy" else "")
        fallback = b.unavailable() and f"backend {b.name} unavailable: {b.unavailable()}"

    dtype = op.dtype_of(metas)
    candidates = []
    chosen = None
    if not fallback:
        chosen = _first_taker(op, b, dtype, metas, candidates)
        if chosen is None:
            fallback = "; ".join(r for _, _, r in candidates) or f"no {b.name} kernel for {op.name}"
    if chosen is not None:
        return Decision(op.name, b.name, b.mode(), chosen.name, requested, candidates), chosen

    if strict_now or b.name == "cpu":
        why = f"no {b.name} kernel takes this call: {fallback}"
        return Decision(op.name, b.name, b.mode(), None, requested, candidates, error=why), None
    cpu = backends()["cpu"]
    chosen = _first_taker(op, cpu, dtype, metas, candidates)
    d = Decision(op.name, "cpu", cpu.mode(), chosen and chosen.name, requested, candidates, fallback=fallback,
                 fallback_from=b.name)
    if chosen is None:
        d.error = f"no cpu kernel takes this call either (after: {fallback})"
    return d, chosen


MAX_BYTES = 2**63 - 1  # the most bytes an array can span (NumPy's, torch's and JAX's int64 sizes): inputs are held
# to it by the array libraries themselves, outputs (matmul's M x N from small operands) only here


def _check_out_sizes(op, metas: list):
    """Every output fits in an array: a shape whose bytes exceed MAX_BYTES (`opport explain matmul --shape
    4294967296,1 --shape 1,4294967296`) is a typed error before any kernel, not a library's allocation error."""
    for i, m in enumerate(op.out_metas(metas)):
        if m is None:
            continue
        shape, dtype = m
        size = 1
        for d in shape:
            size *= d
        if size * np_dtype(getattr(dtype, "name", dtype)).itemsize > MAX_BYTES:
            name = op.output_names[i] if i < len(op.output_names) else f"output {i}"
            raise errors.ShapeError(op=op.name, arg=name, constraint=f"{op.name}.out_size",
                                    expected=f"an output of at most {MAX_BYTES} bytes (int64 sizes)",
                                    got=f"{name} of shape {tuple(shape)} ({dtype})")


def _first_taker(op, b, dtype, metas, candidates):
    ks = kernels(op, b)
    for k in ks:
        reason = k.check(dtype, metas) if dtype in b.dtypes else f"backend {b.name} has no {dtype}"
        candidates.append((b.name, k.name, reason))
        if reason is None:
            return k
    if not ks:
        candidates.append((b.name, "-", f"no {b.name} kernel for {op.name}"))
    return None


def _warn_once(op: str, backend: str, reason: str):
    key = (op, backend, reason)
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(f"opport.{op}: falling back from {backend} to cpu: {reason}", FallbackWarning, stacklevel=6)


def _check_batch_invariant(op: str, backend: str, strict_now: bool):
    """Under opport.batch_invariant(), a backend that does not declare the mode (Capabilities.batch_invariant) runs
    its usual kernels: refused under strict mode, else a warning once per op and backend."""
    if backends()[backend].capabilities.batch_invariant:
        return
    why = f"the {backend} backend does not make its kernels batch-invariant (only backends that declare the mode do)"
    if strict_now:
        raise errors.UnsupportedError(op=op, arg="backend", constraint=f"{op}.batch_invariant",
                                      expected="a backend that keeps opport.batch_invariant()", got=backend,
                                      message=f"{op}: under opport.batch_invariant(): {why}; strict mode refuses")
    key = (op, backend, "batch_invariant")
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(f"opport.{op}: under opport.batch_invariant(): {why}; its rows may differ with the batch",
                  FallbackWarning, stacklevel=6)


def _make_plan(op, bound: tuple, kernel, decision: Decision) -> Plan:
    b = backends()[kernel.backend]
    convert = []
    first = None
    src = None
    for i in op.array_pos:
        a = bound[i]
        if a is None:
            continue
        ad = adapter_for(a)
        if first is None:
            first, src = i, ad
        if ad is NumpyAdapter and not NumpyAdapter.plain(a):  # big-endian data, record views: native copies
            convert.append((i, _normalizer(b)))
        elif b.array_kind == "numpy":
            if ad is not NumpyAdapter:
                convert.append((i, ad.to_numpy))
        elif b.array_kind == "jax":
            if ad.kind != "jax":
                convert.append((i, partial(_to_jax, ad)))
        else:
            device = b.torch_device()
            if ad.kind != "torch" or not _on(a, device):
                convert.append((i, lambda x, ad=ad, device=device: ad.to_torch(x, device)))
            else:  # kernels read memory: a negative-bit view (not in the key: rare, and 65 ns to ask) materialised
                convert.append((i, _resolve_neg))
    same_kind = (src is None or src.kind == b.array_kind) and not convert
    back = None if same_kind else partial(_from_jax, src) if b.array_kind == "jax" else src.from_native
    convert += kernel_views(op, bound)  # after any conversion of the same argument
    lock = _backend_locks.setdefault(b.name, threading.Lock()) if b.serialized() else None
    guest = b.guest(src.kind) if src is not None and src.kind != b.array_kind else None
    return Plan(kernel, tuple(convert), back, first if first is not None else 0, decision, lock, op,
                value_check(op, bound), guest)


def kernel_views(op, bound: tuple) -> list:
    """[(position, reshape)] for the arrays the op declares kernels receive in another shape (`op.kernel_shapes(*bound)
    -> {name: shape}`, e.g. scaled_matmul's 0-d per-tensor scales as (1, 1)): one normalisation before every
    backend's kernels instead of one per kernel. Decided per plan: the shapes are part of the selection key."""
    rule = getattr(op, "kernel_shapes", None)
    if rule is None:
        return []
    return [(op.params.index(name), partial(_reshaped, shape=tuple(shape))) for name, shape in rule(*bound).items()]


def kernel_args(op, bound: tuple) -> tuple:
    """`bound` as the op's kernels receive it from the dispatcher (its `kernel_views` applied), for code that calls a
    kernel directly (tests, `opport bench --overhead`)."""
    out = list(bound)
    for i, f in kernel_views(op, bound):
        out[i] = f(out[i])
    return tuple(out)


def _reshaped(a, shape: tuple):
    return a.reshape(shape)  # NumPy and torch alike: a view of the same memory


def _normalizer(b):
    """A converter to a native, contiguous copy in backend `b`'s array kind."""
    if b.array_kind == "numpy":
        return NumpyAdapter.normalized
    if b.array_kind == "jax":
        return lambda x: _to_jax(NumpyAdapter, NumpyAdapter.normalized(x))
    device = b.torch_device()
    return lambda x: NumpyAdapter.to_torch(NumpyAdapter.normalized(x), device)


def _to_jax(ad, a):
    """A NumPy array or torch tensor as a JAX array (through a NumPy view; a copy on the device)."""
    import jax.numpy as jnp

    return jnp.asarray(ad.to_numpy(a))


def _from_jax(src, out, like):
    """A jax-kind kernel's output as the caller's kind: a writeable NumPy copy, then `src`'s conversion."""
    return src.from_native(np.array(out), like)


def _resolve_neg(t):
    return t.resolve_neg()  # the tensor itself unless its negative bit is set


def _on(t, device: str) -> bool:
    return t.device.type == device.split(":")[0]


def explain(op, *args, backend: str | None = None, **kwargs) -> Decision:
    """The dispatch decision for calling op `op` (an OpSpec) so: backend, kernel, mode, every candidate's reason."""
    bound = python_scalars(op, op.bind(*args, **kwargs))
    name = context.requested_backend(backend)
    decision, _ = decide(op, metas_of(op, bound), name, context.is_strict(), backend is not None)
    return decision
