"""opport: ML operators declared once, run on NumPy (cpu), Triton (cuda) and NKI (neuron).

    import opport
    y = opport.rmsnorm(x, weight)            # NumPy, torch or JAX arrays in, the same kind out
    opport.explain("rmsnorm", x, weight)     # which backend and kernel, and why
    with opport.use_backend("cpu"): ...      # pick a backend for a block
    with opport.strict(): ...                # no silent fallback to cpu

This module is the composition root: it puts the declarations (opport.ops), the dispatcher
(opport.dispatch) and the public op functions (opport/_ops.py, generated; opport.public) together.
"""

from opport._ops import *  # noqa: F403 - opport.softmax, opport.rmsnorm, ...: one function per declared op
from opport._ops import __all__ as _op_names
from opport._version import __version__  # noqa: F401 - opport.__version__
from opport.dispatch import Decision, FallbackWarning, batch_invariant, clear_cache, strict, use_backend
from opport.errors import (
    ArgumentError,
    BackendUnavailableError,
    DeviceError,
    DTypeError,
    OpError,
    ShapeError,
    UnsupportedError,
)
from opport.ops import all_ops, get_op
from opport.public import explain, vjp

__all__ = [
    "ArgumentError", "BackendUnavailableError", "batch_invariant", "Decision", "DeviceError", "DTypeError", "FallbackWarning",
    "OpError", "ShapeError", "UnsupportedError", "all_ops", "clear_cache", "explain", "get_op",
    "strict", "use_backend", "vjp", *_op_names,
]


def __getattr__(name: str):
    """`opport.<op>` for ops other packages declare (the `opport.ops` entry points)."""
    import importlib.util

    if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is not None:
        raise AttributeError(f"module 'opport' has no attribute {name!r}")  # a submodule: the import system loads it
    spec = all_ops().get(name)
    if spec is None:
        raise AttributeError(f"module 'opport' has no attribute {name!r}")
    from opport.public import function

    return function(spec)
