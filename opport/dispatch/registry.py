"""Backends and their kernels, found from the file tree (no central list).

A backend is a package whose `__init__.py` defines `BACKEND = Backend(...)`: every folder under
`opport/backends/`, plus any module named by an `opport.backends` entry point. Its kernels live in
`<package>.<op name>` modules, imported the first time that op is dispatched to that backend.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points

from opport.errors import BackendUnavailableError


@dataclass(frozen=True)
class Backend:
    name: str
    package: str  # module whose submodules `<package>.<op>` hold kernels
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

    def unavailable(self) -> str | None:
        """Why this backend cannot run here (None if it can); probed once, lazily."""
        return _probe(self)

    def require(self, op: str = "opport"):
        reason = self.unavailable()
        if reason:
            raise BackendUnavailableError(
                op=op, arg="backend", constraint="backend.available", expected=f"a usable {self.name} backend",
                got=reason, message=f"{op}: backend {self.name!r} cannot run here: {reason}. {self.hint}".strip(),
            )


_lock = threading.RLock()
_backends: dict[str, Backend] | None = None
_probes: dict[str, str | None] = {}
_loaded: set = set()


def backends() -> dict[str, Backend]:
    """All known backends by name (cpu first)."""
    global _backends
    if _backends is None:
        with _lock:
            if _backends is None:
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
                _backends = dict(sorted(found.items(), key=lambda kv: kv[0] != "cpu"))
    return _backends


def register_backend(b: Backend):
    """Add a backend at run time (tests, plugins); its kernels come from `b.package` as usual."""
    with _lock:
        backends()[b.name] = b
        _probes.pop(b.name, None)
    from opport.dispatch.core import clear_cache

    clear_cache()


def unregister_backend(name: str):
    with _lock:
        backends().pop(name, None)
        _probes.pop(name, None)
        for key in [k for k in _loaded if k[1] == name]:
            _loaded.discard(key)
    from opport.dispatch.core import clear_cache

    clear_cache()


def get_backend(name: str, op: str = "opport") -> Backend:
    b = backends().get(name)
    if b is None:
        raise BackendUnavailableError(
            op=op, arg="backend", constraint="backend.name", expected=f"one of {tuple(backends())}",
            got=repr(name), message=f"{op}: unknown backend {name!r}; valid names: {', '.join(backends())}",
        )
    return b


def backend_for_device(device_type: str) -> Backend:
    for b in backends().values():
        if device_type in b.device_types:
            return b
    return backends()["cpu"]


def kernels(op, backend: Backend) -> list:
    """The op's kernels on this backend, best first (imports the backend's op module once)."""
    key = (op.name, backend.name)
    if key not in _loaded:
        with _lock:
            if key not in _loaded:
                mod = f"{backend.package}.{op.name}"
                try:
                    found = importlib.util.find_spec(mod) is not None
                except ModuleNotFoundError:  # a backend package registered at run time with no module tree
                    found = False
                if found:
                    importlib.import_module(mod)
                _loaded.add(key)
    return op.kernels.get(backend.name, [])


def _probe(b: Backend) -> str | None:
    if b.name not in _probes:
        with _lock:
            if b.name not in _probes:
                try:
                    _probes[b.name] = b.probe()
                except Exception as e:  # a probe that crashes means "cannot run", with the reason
                    _probes[b.name] = f"probe failed: {type(e).__name__}: {e}"
    return _probes[b.name]
