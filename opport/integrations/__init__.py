"""Framework integration: opport ops inside `torch.compile` and `jax.jit`, and model patching.

The public op functions (opport/_ops.py) send every call whose first array is not a NumPy array through `route` before
the dispatcher. Outside tracing and autograd `route` declines (returns NotImplemented) and the call is
dispatched as usual; while torch.compile traces, or when a torch input requires grad, the call becomes
the custom op `torch.ops.opport.<name>` (opport.integrations.torch: its autograd formula runs opport's
backward); when an argument is a JAX tracer, it becomes a `jax.pure_callback` with a custom VJP into
the dispatcher (opport.integrations.jax). Neither framework is imported here unless the caller
already imported it, and nothing is imported at all on the NumPy path.
"""

from __future__ import annotations

import sys

from opport.dispatch import call
from opport.integrations.samples import small_cases  # noqa: F401 - re-exported for tests and users


def apply(spec, *args, backend: str | None = None, **kwargs):
    """`opport.<op>(*args, **kwargs)` for code inside the integrations (the model patcher): the route, then
    the dispatcher, as the public functions do, without importing them from above."""
    bound = spec.bind(*args, **kwargs)
    out = route(spec, bound, backend)
    return call(spec, bound, backend) if out is NotImplemented else out


def route(spec, bound: tuple, backend: str | None):
    """The traced form of a call, or NotImplemented when the call is not being traced."""
    if _TORCH or _bind_torch():
        if _is_compiling():
            from opport.integrations.torch import compiled_call

            return compiled_call(spec, bound, backend)
        if _grad_enabled() and (_grad_checks.get(spec) or _grad_check(spec))(bound):
            from opport.integrations.torch import autograd_call

            return autograd_call(spec, bound, backend)
        if spec.name in NATIVE_OPS and _native_candidate(bound[spec.array_pos[0]]):
            out = (_native_run or _bind_native())(spec, bound, backend, False)  # nothing to record: the forward alone
            if out is not NotImplemented:
                return out
    jax = sys.modules.get("jax")
    if jax is not None and not spec.writes:  # JAX arrays are immutable: an op that writes in place refuses them
        tracer = jax.core.Tracer
        for i in spec.array_pos:
            if isinstance(bound[i], tracer):
                from opport.integrations.jax import traced_call

                return traced_call(spec, bound, backend)
    return NotImplemented


# ops with native torch calls (opport/integrations/torch_native.py: small float32 cpu calls), which calls without
# gradients take (decode): named here so that other ops' calls import nothing
NATIVE_OPS = frozenset({"silu", "swiglu", "layernorm", "rmsnorm", "add_rmsnorm", "rope", "attention"})

# torch's checks, bound once torch is imported (by the caller: opport never imports it); this route runs on
# every call with a torch first argument, where each attribute lookup costs.
_TORCH = None
_is_compiling = _grad_enabled = None
_grad_checks: dict = {}


def _bind_torch() -> bool:
    global _TORCH, _is_compiling, _grad_enabled
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    _is_compiling, _grad_enabled, _TORCH = torch.compiler.is_compiling, torch.is_grad_enabled, torch
    return True


_native_run = None


def _bind_native():
    global _native_run
    from opport.integrations import torch_native  # (it imports the cpu backend's loops: not for other calls)

    _native_run = torch_native.run
    return _native_run


def _native_candidate(x) -> bool:
    """Whether a call that records nothing may take a native forward: a float32 CPU tensor first (the rest, e.g.
    the dispatcher's plan, torch_native.run asks); CUDA, 16-bit and JAX calls pass on at the cost of this look."""
    return getattr(x, "dtype", None) is _TORCH.float32 and x.is_cpu


def _grad_check(spec):
    """`needs(bound)`: whether an array argument requires grad, as straight-line code for the op's arrays."""
    reads = " or ".join(f"getattr(b[{i}], 'requires_grad', False)" for i in spec.array_pos)
    fn = _grad_checks[spec] = eval(f"lambda b: {reads}")  # our own text: the op's array positions
    return fn
