"""Dispatch: backend registry, kernel selection, array adapters."""

from opport.dispatch.core import (
    Decision,
    FallbackWarning,
    call,
    clear_cache,
    explain,
    is_strict,
    strict,
    use_backend,
)
from opport.dispatch.registry import Backend, backends, get_backend, kernels

__all__ = [
    "Backend", "Decision", "FallbackWarning", "backends", "call", "clear_cache", "explain",
    "get_backend", "is_strict", "kernels", "strict", "use_backend",
]
