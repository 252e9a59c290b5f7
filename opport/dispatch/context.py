"""The settings a call is dispatched under: backend choice and strict mode, from context or environment.

Precedence (docs/design.md section 4): the `backend=` keyword > `with use_backend(name)` > env
`OPPORT_BACKEND` > the inputs' device. Strict mode: `with strict()` > env `OPPORT_STRICT`.

The environment is read on every call (so a change takes effect at once), and cheaply: `os.environ.get`
costs ~0.7 us because it encodes the key, so on POSIX `env_reader()` reads the bytes mapping that
`os.environ` keeps in sync underneath (`os.environ._data`, ~0.04 us). That is a private CPython
attribute: where it is missing or not a mapping, `env_reader()` falls back to `os.environ.get`, and a
test runs the dispatcher on both readers.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import contextmanager
from contextvars import ContextVar

_backend: ContextVar = ContextVar("opport_backend", default=None)
_strict: ContextVar = ContextVar("opport_strict", default=None)
_batch_invariant: ContextVar = ContextVar("opport_batch_invariant", default=None)

BACKEND_VAR, STRICT_VAR = "OPPORT_BACKEND", "OPPORT_STRICT"


def env_reader(fast: bool = True) -> tuple[Callable, Callable[[str], object]]:
    """(get, key): `get(key(name))` returns the variable's raw value (bytes on the fast POSIX path) or None.

    `text(raw)` turns a raw value into str. fast=False gives the portable `os.environ.get` reader.
    """
    data = getattr(os.environ, "_data", None) if fast and os.name == "posix" else None
    if data is None or not hasattr(data, "get"):
        return os.environ.get, (lambda name: name)
    return data.get, (lambda name: name.encode())


def text(raw) -> str | None:
    """An environment value as returned by an `env_reader()` getter, as str."""
    return raw.decode() if isinstance(raw, bytes) else raw


ENV_GET, ENV_KEY = env_reader()


def env(name: str) -> str | None:
    """An environment variable, read now."""
    return text(ENV_GET(ENV_KEY(name)))


@contextmanager
def use_backend(name: str):
    """Run the ops in this block on backend `name` (unless a call names its own)."""
    from opport.dispatch.registry import get_backend

    get_backend(name)  # fail early on an unknown name
    token = _backend.set(name)
    try:
        yield
    finally:
        _backend.reset(token)


@contextmanager
def strict(enabled: bool = True):
    """In this block, raise UnsupportedError instead of falling back to cpu."""
    token = _strict.set(enabled)
    try:
        yield
    finally:
        _strict.reset(token)


@contextmanager
def batch_invariant(enabled: bool = True):
    """In this block, kernels take configurations whose results for a row do not depend on the batch it is computed
    in (its size, the row's position): the backends that declare the mode (Capabilities.batch_invariant; cpu) do
    so for every op, at some cost in speed (measured by `opport bench --batch-invariant`); on another backend an op
    with a batch warns once and strict() refuses it (dispatch/core.py `_check_batch_invariant`). Env
    `OPPORT_BATCH_INVARIANT=1` sets it for a whole process (worker processes and JAX callbacks see the environment,
    not this block)."""
    token = _batch_invariant.set(enabled)
    try:
        yield
    finally:
        _batch_invariant.reset(token)


BATCH_INVARIANT_VAR = "OPPORT_BATCH_INVARIANT"


def is_batch_invariant() -> bool:
    """Whether kernels must give batch-invariant results now (`batch_invariant()` > env OPPORT_BATCH_INVARIANT)."""
    return strict_from(_batch_invariant.get(), ENV_GET(ENV_KEY(BATCH_INVARIANT_VAR)))


def context_batch_invariant() -> bool | None:
    """The innermost `batch_invariant()` block's setting, or None outside any."""
    return _batch_invariant.get()


def context_backend() -> str | None:
    """The backend named by the innermost `use_backend` block, or None."""
    return _backend.get()


def context_strict() -> bool | None:
    """The innermost `strict()` block's setting, or None outside any."""
    return _strict.get()


def strict_from(ctx: bool | None, raw) -> bool:
    """Strict mode from a `strict()` setting (wins when set) and a raw OPPORT_STRICT value."""
    if ctx is not None:
        return ctx
    v = text(raw)
    return v is not None and v.lower() not in ("", "0", "false", "no")


CHECK_VALUES_VAR = "OPPORT_CHECK_VALUES"


def check_values() -> bool:
    """OPPORT_CHECK_VALUES (read now): run value checks that would synchronise a device (class labels on a GPU) on
    device arrays too. They always run on host arrays."""
    return strict_from(None, ENV_GET(ENV_KEY(CHECK_VALUES_VAR)))


def is_strict() -> bool:
    return strict_from(_strict.get(), ENV_GET(ENV_KEY(STRICT_VAR)))


def requested_backend(backend: str | None) -> str | None:
    """The backend a call asks for: its keyword, else use_backend(), else OPPORT_BACKEND; None = by device."""
    return backend if backend is not None else (_backend.get() or env(BACKEND_VAR) or None)


def how_requested(backend: str | None) -> str:
    if backend is not None:
        return "backend= keyword"
    return "opport.use_backend()" if _backend.get() else BACKEND_VAR
