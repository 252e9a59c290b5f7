"""add_rmsnorm on NKI: rmsnorm's kernel bodies (neuron/rmsnorm.py) with the residual. The forward reads x and
residual once, writes their sum rounded to the dtype and its rmsnorm; the backward is rmsnorm's at the saved sum
with grad_sum added to dx in its last instruction, dweight summed on TensorE as rmsnorm's.

float32: rmsnorm's exact bracket (two-float row sums and projection) keeps dn accurate enough that dx = dn +
grad_sum passes where the sum is small (x ~ -residual: dx ~100x smaller than dn), which the plain float32
arithmetic of the cuda kernel did not (cuda computes that case in float64). Its factor k = s / rms is still one
float32 rounding: cases cancelling further than the conformance cases' would show it."""

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron.nki_compat import nki
from opport.backends.neuron.rmsnorm import backward_body, forward_body
from opport.dispatch import impl
from opport.ops.add_rmsnorm import add_rmsnorm as spec


@nki.jit
def _add_rmsnorm_kernel(x_hbm, r_hbm, w_hbm, eps):
    """The residual add and RMS normalisation of [R, N] tensors over N, with an optional per-feature weight.

    Dimensions:
        R: rows (tiled by 128 onto the partitions); N: features (free dim, chunks of FMAX).

    Args:
        x_hbm: [R, N] input in HBM, float32/float16/bfloat16.
        r_hbm: [R, N] residual, x's dtype.
        w_hbm: [N] weight in x's dtype, or None.
        eps: compile-time float added to the mean square.

    Returns:
        (normed_hbm, sum_hbm): [R, N] each in x's dtype; sum = x + r rounded to the dtype, normed its rmsnorm.

    Notes:
        rmsnorm's kernel (forward_body) with each chunk of x loaded as the sum: x and r DMA'd, one VectorE
        tensor_tensor add (float32, rounded once into an x-typed tile: the correctly rounded sum), the tile
        DMA'd to sum_hbm and kept for the statistics and the output pass (rows up to RESIDENT elements), so
        every input is read once and every output written once. Longer rows recompute the sum in the
        streaming passes (the same bits).

    Pseudocode:
        for each 128-row tile:
            for each chunk c: t_c = round(x_c + r_c); sum_c = t_c
            rmsnorm of t (rmsnorm's row scale, statistics and output pass)
    """
    return forward_body(x_hbm, w_hbm, eps, r_hbm)


@impl(spec, "neuron")
def add_rmsnorm(x: np.ndarray, residual: np.ndarray, weight, eps: float):
    """Host side: flatten leading dims to rows and launch; empty inputs have nothing to compute."""
    if x.size == 0:
        return np.empty(x.shape, x.dtype), np.empty(x.shape, x.dtype)
    w = None if weight is None else _host.contiguous(weight)
    normed, total = _host.run(_add_rmsnorm_kernel, _host.rows(x), _host.rows(residual), w, float(eps))
    return _host.as_dtype(normed, x.dtype.name, x.shape), _host.as_dtype(total, x.dtype.name, x.shape)


@nki.jit
def _add_rmsnorm_backward_kernel(gn_hbm, gs_hbm, s_hbm, w_hbm, eps, eps_lo):
    """Gradients of add_rmsnorm for x (= residual's) and weight, [R, N] over N.

    Dimensions:
        R: rows (tiled by 128 onto the partitions); N: features (free dim, chunks of FMAX).

    Args:
        gn_hbm: [R, N] upstream gradient of normed, float32/float16/bfloat16.
        gs_hbm: [R, N] upstream gradient of sum, same dtype.
        s_hbm: [R, N] the saved sum, same dtype.
        w_hbm: [N] weight in the same dtype, or None.
        eps: compile-time float added to the mean square.
        eps_lo: compile-time float, eps - float32(eps) (rmsnorm's exact float32 path).

    Returns:
        dx_hbm: [R, N], rmsnorm's dx of gn at s plus gs; dw_hbm: [N] (only with a weight).

    Notes:
        rmsnorm's backward (backward_body) at the sum; gs is read once, in the pass that writes dx, and added
        there in the same instruction as the last multiply (scalar_tensor_tensor: bracket * k + gs).

    Pseudocode:
        dx, dw = rmsnorm_backward(gn, s, w); dx += gs
    """
    return backward_body(gn_hbm, s_hbm, w_hbm, eps, eps_lo, gs_hbm)


@impl(spec.backward_op, "neuron")
def add_rmsnorm_backward(grad_normed: np.ndarray, grad_sum: np.ndarray, total: np.ndarray, weight, eps: float):
    """Host side: rows, launch; dx and dresidual are one array (one write)."""
    n = total.shape[-1]
    if total.size == 0:  # no rows: dweight sums nothing (0); no features: nothing at all
        dx = np.empty(total.shape, total.dtype)
        return dx, dx, None if weight is None else np.zeros(n, weight.dtype)
    w = None if weight is None else _host.contiguous(weight)
    eps_lo = float(eps) - float(np.float32(eps))
    out = _host.run(_add_rmsnorm_backward_kernel, _host.rows(grad_normed), _host.rows(grad_sum), _host.rows(total), w,
                    float(eps), eps_lo)
    dx, dw = (out, None) if weight is None else out
    dx = _host.as_dtype(dx, total.dtype.name, total.shape)
    return dx, dx, None if dw is None else _host.as_dtype(dw, weight.dtype.name, (n,))
