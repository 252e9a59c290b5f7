"""The dispatcher's state, in one place: backends, their kernels, and the selection cache.

A backend is a package whose `__init__.py` defines `BACKEND = Backend(...)`: every folder under
`opport/backends/`, plus any module named by an `opport.backends` entry point. Its kernels live in
`<package>.<op module>` modules, imported the first time that op is dispatched to that backend (backend
discovery is the one place the dispatcher imports upward, by name). Kernels register themselves with
`@impl(spec, "<backend>", ...)`.

Everything that can change a selection goes through this module (registering or removing a backend or
a kernel), and each such change empties the selection cache here, in `_changed()`: no other module
clears it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import pkgutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points

from opport.errors import BackendUnavailableError


@dataclass(frozen=True)
class Capabilities:
    """What the conformance and performance suites need to know about a backend, declared by the backend.

    emulated: its current mode runs a device's kernels on this CPU (Triton's interpreter, the NKI emulator
        or simulator): conformance then uses the tier's smaller caps, and `opport bench` never times it.
    max_workers: at most this many conformance worker processes at once in the current mode (each holds
        a context on one shared device); None: no limit beyond the CPU count.
    bench: the module (found by name, like kernel modules) that tells `opport bench` how to measure this
        backend: its timer and ceilings or its counters, default tier and dtypes, time limit, baselines
        (the protocol is in opport/bench/profile.py). None: the backend cannot be benchmarked.
    device_resource: the cluster resource a host offers when it has this backend's real device ("GPU",
        "neuron_cores"; docs/fleet.md): on a cluster that offers it, the backend's cases and problems run
        only where it is. None: the backend runs on any CPU.
    checked: the context conformance runs each of its cases in, stricter than a user's call where an emulator
        only warns of what the device rejects (the NKI emulator's SBUF/PSUM capacity: the Neuron compiler
        refuses such a kernel).
    batch_invariant: under `opport.batch_invariant()` every kernel of the backend gives a row the same bits
        whatever batch it comes in (conformance's batch items then fail a row that varies); False: the report
        says which kernels are invariant, nothing is promised.
    compiles_per_shape: each new shape compiles its kernels first (XLA: ~0.1 s a kernel on a CPU core), so
        conformance draws the tier's `examples_compiled` Hypothesis examples (every fixed and layout case still runs).
    """

    emulated: Callable[[], bool] = field(default=lambda: False)
    max_workers: Callable[[], int | None] = field(default=lambda: None)
    bench: str | None = None
    device_resource: str | None = None
    checked: Callable[[], contextlib.AbstractContextManager] = field(default=contextlib.nullcontext)
    batch_invariant: bool = False
    compiles_per_shape: bool = False


@dataclass(frozen=True)
class Backend:
    name: str
    package: str  # module whose submodules `<package>.<op module>` hold kernels
    array_kind: str  # what kernels receive: "numpy" or "torch"
    device_types: tuple  # array devices that select this backend automatically
    dtypes: tuple
    probe: Callable[[], str | None]  # None when it can run here, else the reason it cannot
    mode: Callable[[], str]
    versions: Callable[[], dict] = dict
    hint: str = ""  # how to get it when it cannot run
    torch_device: Callable[[], str] = field(default=lambda: "cpu")  # where torch-kind kernels want arrays
    # True when two of its kernels must never run at once (Triton's interpreter patches triton.language
    # while a kernel runs): the dispatcher then runs them under one lock per backend
    serialized: Callable[[], bool] = field(default=lambda: False)
    capabilities: Capabilities = field(default_factory=Capabilities)
    # guest(kind) -> a wrapper for its kernels when called on another framework's arrays converted to this backend's
    # (kind "torch" for the cpu backend: its kernels then share the cores with torch's own thread pool), or None
    guest: Callable[[str], Callable | None] = field(default=lambda kind: None)

    def unavailable(self) -> str | None:
        """Why this backend cannot run here (None if it can); probed once, lazily."""
        return _probe(self)

    def require(self, op: str = "opport"):
        reason = self.unavailable()
        if reason:
            raise BackendUnavailableError(
                op=op, arg="backend", constraint=_backend_constraint(op, "available"), expected=f"a usable {self.name} backend",
                got=reason, message=f"{op}: backend {self.name!r} cannot run here: {reason}. {self.hint}".strip(),
            )


@dataclass
class Kernel:
    op: object  # the OpSpec
    backend: str
    fn: Callable
    name: str
    dtypes: tuple
    supports: Callable | None = None
    priority: int = 0
    deterministic: bool = True

    def check(self, dtype: str, bound: tuple) -> str | None:
        """None if this kernel takes the call, else the reason it does not."""
        if dtype not in self.dtypes:
            return f"dtype {dtype} not in {self.dtypes}"
        return self.supports(*bound) if self.supports else None


_lock = threading.RLock()
_backends: dict[str, Backend] | None = None
_probes: dict[str, str | None] = {}
_kernels: dict[tuple, list[Kernel]] = {}  # (spec, backend name) -> kernels, best first
_loaded: set = set()  # (op package, op module, backend name) whose kernel modules have been imported
SELECTIONS: dict = {}  # the dispatcher's cache: selection key -> plan (opport.dispatch.core)
SELECTIONS_MAX = 8192


def _changed():
    """A backend or kernel came or went: every cached selection may be stale."""
    SELECTIONS.clear()


def clear_cache():
    """Forget every cached selection (the next call of each op plans afresh)."""
    _changed()


def backends() -> dict[str, Backend]:
    """All known backends by name (cpu first)."""
    global _backends
    if _backends is None:
        with _lock:
            if _backends is None:
                _backends = _discover()
    return _backends


def _discover() -> dict[str, Backend]:
    found = {}
    import opport.backends as pkg

    for m in pkgutil.iter_modules(pkg.__path__):
        if m.ispkg:
            b = getattr(importlib.import_module(f"opport.backends.{m.name}"), "BACKEND", None)
            if b is not None:
                found[b.name] = b
    for ep in entry_points(group="opport.backends"):
        b = getattr(importlib.import_module(ep.value), "BACKEND", None)
        if b is not None:
            found.setdefault(b.name, b)
    return dict(sorted(found.items(), key=lambda kv: kv[0] != "cpu"))


def register_backend(b: Backend):
    """Add a backend at run time (tests, plugins); its kernels come from `b.package` as usual."""
    with _lock:
        backends()[b.name] = b
        _probes.pop(b.name, None)
        _changed()


def unregister_backend(name: str):
    """Remove a backend and every kernel registered for it."""
    with _lock:
        backends().pop(name, None)
        _probes.pop(name, None)
        for key in [k for k in _kernels if k[1] == name]:
            del _kernels[key]
        for key in [k for k in _loaded if k[-1] == name]:
            _loaded.discard(key)
        _changed()


def get_backend(name: str, op: str = "opport") -> Backend:
    b = backends().get(name) if isinstance(name, str) else None
    if b is None:
        raise BackendUnavailableError(
            op=op, arg="backend", constraint=_backend_constraint(op, "name"), expected=f"one of {tuple(backends())}",
            got=repr(name), message=f"{op}: unknown backend {name!r}; valid names: {', '.join(backends())}",
        )
    return b


def _backend_constraint(op: str, what: str) -> str:
    """`<op>.backend` for an op's call (declared by every op); `backend.<what>` outside one."""
    return f"{op}.backend" if op != "opport" else f"backend.{what}"


def backend_for_device(device_type: str, kind: str | None = None, spec=None) -> Backend:
    """The backend automatic selection takes for arrays of `kind` on `device_type`: one whose kernels take that
    kind of array itself (`array_kind`: the jax backend for JAX arrays), lists the device, can run here and has
    kernels for `spec`; else the first backend that lists the device; else cpu."""
    if kind is not None and spec is not None:
        for b in backends().values():
            if b.array_kind == kind and device_type in b.device_types and not b.unavailable() and kernels(spec, b):
                return b
    for b in backends().values():
        if device_type in b.device_types:
            return b
    return backends()["cpu"]


def impl(spec, backend: str, dtypes=None, supports=None, priority=0, name=None, deterministic=True):
    """Register the decorated function as a kernel of `backend` for the op `spec`.

    The kernel takes the op's bound arguments in signature order (arrays of the backend's kind) and returns
    its output. `dtypes`: only where the kernel narrows what the op and the backend declare (by default, the
    op's dtypes that the backend runs). `supports(*metas)` returns None when it takes a call, else the reason
    it does not.
    """

    def register(fn):
        kname = name or f"{backend}.{fn.__name__}"
        k = Kernel(spec, backend, fn, kname, tuple(dtypes or _default_dtypes(spec, backend)), supports, priority,
                   deterministic)
        with _lock:
            ks = [old for old in _kernels.get((spec, backend), []) if old.name != kname]  # reload-safe
            ks.append(k)
            ks.sort(key=lambda k: -k.priority)
            _kernels[(spec, backend)] = ks
            _changed()
        return fn

    return register


def _default_dtypes(spec, backend: str) -> tuple:
    """The op's dtypes that the backend declares (all of them for a backend not registered, as tests make)."""
    b = backends().get(backend)
    return tuple(d for d in spec.dtypes if b is None or d in b.dtypes)


def remove_kernel(spec, backend: str, name: str):
    """Unregister one kernel (tests and the gate's self-test install temporary ones)."""
    with _lock:
        ks = [k for k in _kernels.get((spec, backend), []) if k.name != name]
        if ks:
            _kernels[(spec, backend)] = ks
        else:
            _kernels.pop((spec, backend), None)
        _changed()


def kernel_modules(spec, backend: Backend) -> tuple:
    """Where `spec`'s kernels for `backend` live: the backend's module named like the op and, where a backend
    keeps an op's backward apart (a large kernel pair), `<op>_backward`; for an op a plugin package declares,
    also that package's own `<package>.backends.<backend>.<op>` (opport's layout)."""
    pkgs = (backend.package,) + ((f"{spec.package}.backends.{backend.name}",) if spec.package != "opport" else ())
    return tuple(f"{pkg}.{spec.module}{part}" for pkg in pkgs for part in ("", "_backward"))


def has_kernel_module(spec, backend: Backend) -> bool:
    """Whether `backend` has a module for `spec`'s kernels (found without importing it)."""
    return any(_exists(mod) for mod in kernel_modules(spec, backend))


def kernels(spec, backend: Backend) -> list:
    """The op's kernels on this backend, best first (imports the backend's modules for the op once)."""
    key = (spec.package, spec.module, backend.name)
    if key not in _loaded:
        with _lock:
            if key not in _loaded:
                for mod in kernel_modules(spec, backend):
                    if _exists(mod):
                        importlib.import_module(mod)
                _loaded.add(key)
    return _kernels.get((spec, backend.name), [])


def _exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package that does not exist (a backend registered with no module tree)
        return False


def registered(spec) -> list:
    """Every kernel registered for `spec` so far, on any backend (nothing is imported)."""
    return [k for (s, _), ks in list(_kernels.items()) if s is spec for k in ks]


def has_kernels(spec, backend_name: str) -> bool:
    """Whether `backend_name` has registered kernels for `spec` (without importing anything)."""
    return bool(_kernels.get((spec, backend_name)))


def _probe(b: Backend) -> str | None:
    if b.name not in _probes:
        with _lock:
            if b.name not in _probes:
                try:
                    _probes[b.name] = b.probe()
                except Exception as e:  # a probe that crashes means "cannot run", with the reason
                    _probes[b.name] = f"probe failed: {type(e).__name__}: {e}"
    return _probes[b.name]
