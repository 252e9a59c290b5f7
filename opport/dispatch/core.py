"""Backend and kernel selection (design.md section 4), the selection cache, and `explain`.

Hot path: `call` builds a hashable key from the op, the arrays' adapter keys (dtype, shape,
strides, device), the scalar arguments and the backend/strict settings. A hit reuses a `Plan`
(validation already passed for that key, kernel chosen, converters fixed); a miss validates the
metadata, selects, and stores the plan. Validation and `supports(...)` see only metadata, so the
cache can never skip a check that the data would change.
"""

from __future__ import annotations

import os
import threading
import warnings
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from opport import errors
from opport.dispatch.adapters import NumpyAdapter, adapter_for
from opport.dispatch.registry import backend_for_device, backends, get_backend, kernels


class FallbackWarning(UserWarning):
    """A kernel could not take a call and opport ran it on the cpu backend instead."""


_backend_ctx: ContextVar = ContextVar("opport_backend", default=None)
_strict_ctx: ContextVar = ContextVar("opport_strict", default=None)
_cache: dict = {}
_CACHE_MAX = 8192
_warned: set = set()
_warn_lock = threading.Lock()


@contextmanager
def use_backend(name: str):
    """Run the ops in this block on backend `name` (unless a call names its own)."""
    get_backend(name)  # fail early on an unknown name
    token = _backend_ctx.set(name)
    try:
        yield
    finally:
        _backend_ctx.reset(token)


@contextmanager
def strict(enabled: bool = True):
    """In this block, raise UnsupportedError instead of falling back to cpu."""
    token = _strict_ctx.set(enabled)
    try:
        yield
    finally:
        _strict_ctx.reset(token)


# os.environ.get costs ~0.7 us (it encodes the key); the dispatch hot path reads the mapping that
# os.environ keeps in sync underneath, which costs ~0.04 us.
_ENV_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None


def env(name: str) -> str | None:
    """An environment variable, read on every call (so a change takes effect), cheaply."""
    if _ENV_DATA is None:
        return os.environ.get(name)
    v = _ENV_DATA.get(name.encode() if name not in _ENV_KEYS else _ENV_KEYS[name])
    return None if v is None else v.decode()


_ENV_KEYS = {"OPPORT_BACKEND": b"OPPORT_BACKEND", "OPPORT_STRICT": b"OPPORT_STRICT"}


def is_strict() -> bool:
    s = _strict_ctx.get()
    if s is not None:
        return s
    v = env("OPPORT_STRICT")
    return v is not None and v.lower() not in ("", "0", "false", "no")


def clear_cache():
    _cache.clear()


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
        from rich.table import Table

        t = Table(title=f"{self.op} -> {self.backend} ({self.mode}) : {self.kernel or '-'}", caption=self.requested)
        for col in ("backend", "kernel", "taken", "reason"):
            t.add_column(col)
        for b, k, reason in self.candidates:
            t.add_row(b, k, "yes" if reason is None else "no", reason or "")
        if self.fallback:
            t.add_row("", "", "", f"fell back from {self.fallback_from} to cpu: {self.fallback}")
        return t


class Plan:
    """A cached decision plus the conversions that run it."""

    __slots__ = ("fn", "convert", "back", "first", "decision", "kernel")

    def __init__(self, kernel, convert, back, first, decision, lock=None):
        self.kernel, self.convert, self.back = kernel, convert, back
        self.fn = kernel.fn if lock is None else _serial(kernel.fn, lock)
        self.first, self.decision = first, decision


_backend_locks: dict = {}


def _serial(fn, lock):
    def run(*args):
        with lock:
            return fn(*args)

    return run


# --------------------------------------------------------------------------- the call path


def call(op, bound: tuple, backend: str | None):
    key = [op]
    for i in op.array_pos:
        a = bound[i]
        if a is None:
            key.append(None)
            continue
        ad = adapter_for(a)
        if ad is None:
            _bad_array(op, op.params[i], a)
        key.append(ad)
        key.append(ad.key(a))
    for i in op.scalar_pos:
        s = bound[i]
        key.append(s)
        key.append(s.__class__)  # True == 1 == 1.0 hash alike, but validation tells them apart
    name = backend or _backend_ctx.get() or env("OPPORT_BACKEND") or None
    key.append(name)
    strict_now = is_strict()
    key.append(strict_now)
    try:
        key = tuple(key)
        plan = _cache.get(key)
    except TypeError:  # an unhashable scalar: validation will say what is wrong with it
        key, plan = None, None
    if plan is None:
        plan = _plan(op, bound, name, strict_now, backend is not None)
        if key is not None:
            if len(_cache) >= _CACHE_MAX:
                _cache.clear()
            _cache[key] = plan
    if plan.convert or plan.back:
        return _run_converted(plan, bound)
    return plan.fn(*bound)


def _run_converted(plan: Plan, bound: tuple):
    like = bound[plan.first]
    if plan.convert:
        bound = list(bound)
        for i, f in plan.convert:
            if bound[i] is not None:
                bound[i] = f(bound[i])
    out = plan.fn(*bound)
    return plan.back(out, like) if plan.back else out


def _bad_array(op, arg, a):
    raise errors.DTypeError(op=op.name, arg=arg, constraint=f"{op.name}.array_type",
                            expected="a NumPy array, torch tensor or JAX array", got=type(a).__name__)


def metas_of(op, bound: tuple) -> list:
    """The bound arguments with every array replaced by its `Meta`."""
    metas = list(bound)
    for i in op.array_pos:
        a = bound[i]
        if a is not None:
            ad = adapter_for(a)
            if ad is None:
                _bad_array(op, op.params[i], a)
            metas[i] = ad.meta(a)
    return metas


def _plan(op, bound: tuple, name: str | None, strict_now: bool, by_keyword: bool) -> Plan:
    metas = metas_of(op, bound)
    decision, kernel = decide(op, metas, name, strict_now, by_keyword)
    if kernel is None:
        raise errors.UnsupportedError(op=op.name, arg=None, constraint=f"{op.name}.supported",
                                      expected=f"a {decision.backend} kernel that takes this call",
                                      got=decision.error, message=f"{op.name}: {decision.error}")
    if decision.fallback:
        _warn_once(op.name, decision.fallback_from, decision.fallback)
    return _make_plan(op, bound, kernel, decision)


def decide(op, metas: list, name: str | None, strict_now: bool, by_keyword: bool = False):
    """Validate the metadata, then pick backend and kernel. Returns (Decision, Kernel or None)."""
    arrays = [(op.params[i], metas[i]) for i in op.array_pos if metas[i] is not None]
    devices = {m.device for _, m in arrays}
    if len(devices) > 1:
        raise errors.DeviceError(op=op.name, arg=arrays[-1][0], constraint=f"{op.name}.device",
                                 expected="all arrays on one device", got=", ".join(sorted(devices)))
    device_type = arrays[0][1].device_type if arrays else "cpu"
    if device_type != "cpu" and not any(device_type in b.device_types for b in backends().values()):
        raise errors.DeviceError(op=op.name, arg=arrays[0][0], constraint=f"{op.name}.device",
                                 expected="arrays on a device some backend can use", got=arrays[0][1].device)
    op.validate(*metas)

    if name:
        requested = "backend= keyword" if by_keyword else (
            "opport.use_backend()" if _backend_ctx.get() else "OPPORT_BACKEND")
        b = get_backend(name, op.name)
        b.require(op.name)
        if b.name != "cpu" and device_type != "cpu" and device_type not in b.device_types:
            raise errors.DeviceError(op=op.name, arg=arrays[0][0], constraint=f"{op.name}.device",
                                     expected=f"arrays on cpu or {'/'.join(b.device_types)} for backend {b.name}",
                                     got=device_type)
        fallback = None
    else:
        b = backend_for_device(device_type)
        requested = f"input device {device_type}"
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


def _first_taker(op, b, dtype, metas, candidates):
    for k in kernels(op, b):
        reason = k.check(dtype, metas) if dtype in b.dtypes else f"backend {b.name} has no {dtype}"
        candidates.append((b.name, k.name, reason))
        if reason is None:
            return k
    if not op.kernels.get(b.name):
        candidates.append((b.name, "-", f"no {b.name} kernel for {op.name}"))
    return None


def _warn_once(op: str, backend: str, reason: str):
    key = (op, backend, reason)
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(f"opport.{op}: falling back from {backend} to cpu: {reason}", FallbackWarning, stacklevel=5)


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
        if b.array_kind == "numpy":
            if ad is not NumpyAdapter:
                convert.append((i, ad.to_numpy))
        else:
            device = b.torch_device()
            if ad.kind != "torch" or not _on(a, device):
                convert.append((i, lambda x, ad=ad, device=device: ad.to_torch(x, device)))
    same_kind = (src is None or src.kind == b.array_kind) and not convert
    back = None if same_kind else src.from_native
    lock = _backend_locks.setdefault(b.name, threading.Lock()) if b.serialized() else None
    return Plan(kernel, tuple(convert), back, first if first is not None else 0, decision, lock)


def _on(t, device: str) -> bool:
    return t.device.type == device.split(":")[0]


def explain(op, *args, backend: str | None = None, **kwargs) -> Decision:
    """The dispatch decision for this call: backend, kernel, mode and every candidate's reason."""
    from opport.ops import get_op

    spec = get_op(op) if isinstance(op, str) else op
    bound = spec.bind(*args, **kwargs)
    name = backend or _backend_ctx.get() or env("OPPORT_BACKEND") or None
    decision, _ = decide(spec, metas_of(spec, bound), name, is_strict(), backend is not None)
    return decision
