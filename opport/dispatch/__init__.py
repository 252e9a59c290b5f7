"""Dispatch: the backend and kernel registry, kernel selection, array adapters, the call settings.

Imports point one way: `opport.spec` (declarations) <- `opport.dispatch` <- backends (which register
kernels with `impl`) and everything above (integrations, conformance, bench, the public functions,
the CLI). The one upward import is backend discovery, by name (registry.py).
"""

from opport.dispatch.context import batch_invariant, is_batch_invariant, is_strict, strict, use_backend
from opport.dispatch.core import Decision, FallbackWarning, call, decide, explain, kernel_args, select, takes
from opport.dispatch.registry import (
    Backend,
    Capabilities,
    Kernel,
    backends,
    clear_cache,
    get_backend,
    impl,
    kernels,
    register_backend,
    remove_kernel,
    unregister_backend,
)

__all__ = [
    "Backend", "Capabilities", "Decision", "FallbackWarning", "Kernel", "backends", "call", "clear_cache", "decide",
    "batch_invariant", "explain", "get_backend", "impl", "is_batch_invariant", "is_strict", "kernel_args", "kernels",
    "register_backend", "remove_kernel", "select", "strict",
    "takes", "unregister_backend", "use_backend",
]
