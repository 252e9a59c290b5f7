"""nki.jit / nki.simulate: run a kernel function on NumPy arrays.

Array arguments become shared_hbm tensors over the caller's memory (in-place writes reach the caller,
as in the real simulator); other arguments pass through as compile-time values. The kernel's returned
tensors must be shared_hbm and come back as NumPy arrays (a tuple stays a tuple).
"""

from __future__ import annotations

import functools
import inspect

import numpy as np

from opport.backends.neuron.emulator import runtime
from opport.backends.neuron.emulator import typing as nki_typing
from opport.backends.neuron.emulator.errors import NkiValidationError
from opport.backends.neuron.emulator.tensor import NkiTensor, shared_hbm, wrap_hbm


class Kernel:
    """A jitted kernel; `kernel[n](...)` launches it with LNC degree n (1 or 2)."""

    def __init__(self, func, grid=None, **options):
        self.func, self.grid, self.options = func, grid, options
        functools.update_wrapper(self, func)

    def __getitem__(self, grid) -> Kernel:
        n = grid[0] if isinstance(grid, tuple) and len(grid) == 1 else grid
        if not isinstance(n, int) or n not in (1, 2):
            raise NkiValidationError(f"{self.func.__name__}[{grid!r}]: the launch grid is one integer, the LNC degree 1 "
                                     "or 2 (multi-dimensional SPMD grids were removed in NKI 0.2)")
        return Kernel(self.func, n, **self.options)

    def __call__(self, *args, **kwargs):
        name = self.func.__name__
        _check_signature(self.func)
        _check_annotations(self.func, args, kwargs)
        if isinstance(self.grid, int) and self.grid == 2 and runtime.current().target.version < 3:
            raise NkiValidationError(f"{name}: LNC=2 needs Trn2 or Trn3")
        programs = self.grid or 1
        shared, stats = None, runtime.KernelStats(kernel=name)
        for pid in range(programs):  # LNC programs run one after the other, sharing shared_hbm tensors
            targs = [_arg(a, f"arg{i}") for i, a in enumerate(args)]
            tkw = {k: _arg(v, k) for k, v in kwargs.items()}
            with runtime.kernel_run(name, pid, programs, 0 if self.grid is None else 1, shared) as run:
                out = self.func(*targs, **tkw)
            shared = run.shared_allocs
            stats.merge(run.stats)
        stats.calls = 1
        runtime.record(stats)
        return _outputs(out, name)


def _check_signature(func):
    """NKI >= 0.3 rejects the keyword-only separator `*` in kernel signatures (NKI 0.3.0 update guide)."""
    kw_only = [p.name for p in inspect.signature(func).parameters.values() if p.kind is p.KEYWORD_ONLY]
    if kw_only:
        raise NkiValidationError(f"{func.__name__}: keyword-only parameters ({', '.join(kw_only)}) after `*` are not "
                                 "supported in NKI kernel signatures; move them to the end as ordinary parameters")


def _check_annotations(func, args, kwargs):
    """Parameters annotated `nki.typing.tensor[shape]` must receive arrays of that shape."""
    try:
        hints = inspect.get_annotations(func, eval_str=True)
    except Exception:  # annotations naming things the emulator cannot resolve declare nothing it can check
        return
    bound = inspect.signature(func).bind_partial(*args, **kwargs).arguments
    for name, hint in hints.items():
        if isinstance(hint, nki_typing.TensorType) and name in bound:
            hint.check(bound[name], f"{func.__name__}: argument {name}")


def _arg(a, name):
    if isinstance(a, np.ndarray):
        return wrap_hbm(a, name)
    if isinstance(a, NkiTensor):
        return a
    if isinstance(a, np.generic):  # NumPy scalars are compile-time constants
        return a.item()
    if hasattr(a, "__array__") and not isinstance(a, (int, float, bool, str, tuple)):
        raise NkiValidationError(f"kernel argument {name}: pass NumPy arrays to the emulator, got {type(a).__name__}")
    if isinstance(a, list):
        raise NkiValidationError(f"kernel argument {name}: list arguments are not allowed in NKI kernels; use a tuple")
    return a


def _outputs(out, name):
    if out is None:
        return None
    if isinstance(out, (tuple, list)):
        return type(out)(_outputs(o, name) for o in out)
    if isinstance(out, NkiTensor):
        if out.buffer is not shared_hbm:
            raise NkiValidationError(f"{name}: kernel outputs must be allocated in nl.shared_hbm, got {out.buffer}")
        return np.array(out.read())
    return out


def jit(func=None, mode=None, **options):
    """`@nki.jit` or `@nki.jit(...)`: options (platform, debug flags) are accepted and ignored."""
    if func is None:
        return lambda f: Kernel(f, **options)
    return Kernel(func, **options)


def simulate(kernel):
    """`nki.simulate(kernel)(*args)`: in the emulator every call is a simulation."""
    if isinstance(kernel, Kernel):
        return kernel
    return Kernel(kernel)
