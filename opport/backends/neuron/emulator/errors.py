"""Errors and warnings the emulator raises, shaped like the real simulator's."""

from __future__ import annotations

import warnings


class NkiValidationError(AssertionError):
    """A kernel broke a hardware or API constraint (the real simulator raises AssertionErrors too)."""


class NkiWarning(UserWarning):
    """Legal but suspicious use: undefined behaviour on hardware, or a likely kernel bug."""


class NkiCapacityWarning(NkiWarning):
    """Live SBUF/PSUM tiles exceed the per-partition capacity (an error in strict mode)."""


def check(cond, op: str, message: str):
    """Raise NkiValidationError('<op>: <message>') unless cond holds."""
    if not cond:
        raise NkiValidationError(f"{op}: {message}")


def fail(op: str, message: str):
    """Raise NkiValidationError('<op>: <message>'): for hot paths, which build the message only when it is needed."""
    raise NkiValidationError(f"{op}: {message}")


def warn(op: str, message: str, category=NkiWarning):
    warnings.warn(f"{op}: {message}", category, stacklevel=4)
