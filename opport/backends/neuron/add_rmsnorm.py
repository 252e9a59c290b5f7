"""add_rmsnorm on NKI: rmsnorm's kernels (neuron/rmsnorm.py) with the residual. The forward reads x and residual
once, writes their sum rounded to the dtype and its rmsnorm; the backward is rmsnorm's at the saved sum with
grad_sum added to dx in its last instruction, dweight summed on TensorE as rmsnorm's.

float32: rmsnorm's exact bracket (two-float row sums and projection) keeps dn accurate enough that dx = dn +
grad_sum passes where the sum is small (x ~ -residual: dx ~100x smaller than dn), which the plain float32
arithmetic of the cuda kernel did not (cuda computes that case in float64). Its factor k = s / rms is still one
float32 rounding: cases cancelling further than the conformance cases' would show it."""

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron.rmsnorm import _rmsnorm_backward_kernel, _rmsnorm_kernel
from opport.dispatch import impl
from opport.ops.add_rmsnorm import add_rmsnorm as spec


@impl(spec, "neuron", dtypes=("float32", "float16", "bfloat16"))
def add_rmsnorm(x: np.ndarray, residual: np.ndarray, weight, eps: float):
    """Host side: flatten leading dims to rows and launch; empty inputs have nothing to compute."""
    if x.size == 0:
        return np.empty(x.shape, x.dtype), np.empty(x.shape, x.dtype)
    w = None if weight is None else _host.contiguous(weight)
    normed, total = _host.run(_rmsnorm_kernel, _host.rows(x), w, float(eps), _host.rows(residual))
    return _host.as_dtype(normed, x.dtype.name, x.shape), _host.as_dtype(total, x.dtype.name, x.shape)


@impl(spec.backward_op, "neuron", dtypes=("float32", "float16", "bfloat16"))
def add_rmsnorm_backward(grad_normed: np.ndarray, grad_sum: np.ndarray, total: np.ndarray, weight, eps: float):
    """Host side: rows, launch; dx and dresidual are one array (one write)."""
    n = total.shape[-1]
    if total.size == 0:  # no rows: dweight sums nothing (0); no features: nothing at all
        dx = np.empty(total.shape, total.dtype)
        return dx, dx, None if weight is None else np.zeros(n, weight.dtype)
    w = None if weight is None else _host.contiguous(weight)
    eps_lo = float(eps) - float(np.float32(eps))
    out = _host.run(_rmsnorm_backward_kernel, _host.rows(grad_normed), _host.rows(total), w, float(eps), eps_lo,
                    _host.rows(grad_sum))
    dx, dw = (out, None) if weight is None else out
    dx = _host.as_dtype(dx, total.dtype.name, total.shape)
    return dx, dx, None if dw is None else _host.as_dtype(dw, weight.dtype.name, (n,))
