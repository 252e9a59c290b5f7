"""opport: ML operators declared once, run on NumPy (cpu), Triton (cuda) and NKI (neuron).

    import opport
    y = opport.rmsnorm(x, weight)            # NumPy, torch or JAX arrays in, the same kind out
    opport.explain("rmsnorm", x, weight)     # which backend and kernel, and why
    with opport.use_backend("cpu"): ...      # pick a backend for a block
    with opport.strict(): ...                # no silent fallback to cpu
"""

from opport.dispatch import Decision, FallbackWarning, clear_cache, explain, strict, use_backend
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

__version__ = "0.1.0"

globals().update(all_ops())  # opport.softmax, opport.rmsnorm, ... straight from the declarations

__all__ = [
    "ArgumentError", "BackendUnavailableError", "Decision", "DeviceError", "DTypeError", "FallbackWarning",
    "OpError", "ShapeError", "UnsupportedError", "all_ops", "clear_cache", "explain", "get_op",
    "strict", "use_backend", *all_ops(),
]
