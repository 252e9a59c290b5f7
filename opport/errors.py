"""User-facing errors (docs/design.md section 2).

Every error derives from `OpError` and from the builtin a caller would catch, and carries
`op`, `arg`, `constraint` (a stable id such as "rmsnorm.weight_shape"), `expected` and `got`.
"""

from __future__ import annotations


class OpError(Exception):
    """Base class: an op rejected its input, or no kernel could take it."""

    def __init__(self, op=None, arg=None, constraint=None, expected=None, got=None, message=None):
        self.op, self.arg, self.constraint = op, arg, constraint
        self.expected, self.got = expected, got
        if message is None:
            where = f"{op}: argument {arg!r}" if arg else f"{op}"
            message = f"{where}: expected {expected}, got {got} [{constraint}]"
        super().__init__(message)


class ShapeError(OpError, ValueError):
    """Shapes or ranks disagree with the signature."""


class DTypeError(OpError, TypeError):
    """Unsupported or mixed dtypes, integer where float is required."""


class ArgumentError(OpError, ValueError):
    """Bad scalar arguments (eps <= 0, unknown reduction, ...)."""


class DeviceError(OpError, ValueError):
    """Inputs on different devices, or a device the chosen backend cannot use."""


class UnsupportedError(OpError, NotImplementedError):
    """Valid input that no kernel of the chosen backend supports (strict mode)."""


class BackendUnavailableError(OpError, RuntimeError):
    """A named backend cannot run here; the message says why and how to get it."""
