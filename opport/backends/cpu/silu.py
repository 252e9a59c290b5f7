"""silu on NumPy: x / (1 + exp(-x)) in float32 (float64 for float64 inputs), over bounded blocks; its backward
grad * silu'(x) likewise."""

import numpy as np

from opport.backends.cpu import _activations as act
from opport.backends.cpu import _fused
from opport.dispatch import impl
from opport.ops.silu import silu as spec

_careful_grad = act.times_grad(act.silu_grad)
if _fused.numba is not None:  # the block functions, made once (a decode step's call is a few microseconds)
    _fast, _fast_grad = _fused.silu_block(act.silu), _fused.silu_grad_block(_careful_grad)


@impl(spec, "cpu")
def silu(x: np.ndarray) -> np.ndarray:
    return act.elementwise(_fast if _fused.enabled(x.dtype) else act.silu, x)


@impl(spec.backward_op, "cpu")
def silu_backward(grad: np.ndarray, x: np.ndarray):
    return (act.elementwise(_fast_grad if _fused.enabled(x.dtype) else _careful_grad, x, grad),)
