"""silu on NumPy: x / (1 + exp(-x)) in float32 (float64 for float64 inputs), over bounded blocks; its backward
grad * silu'(x) likewise."""

import numpy as np

from opport.backends.cpu import _activations as act
from opport.backends.cpu import _fused
from opport.dispatch import impl
from opport.ops.silu import silu as spec


@impl(spec, "cpu")
def silu(x: np.ndarray) -> np.ndarray:
    return act.elementwise(_fused.silu_block(act.silu) if _fused.enabled(x.dtype) else act.silu, x)


@impl(spec.backward_op, "cpu")
def silu_backward(grad: np.ndarray, x: np.ndarray):
    careful = act.times_grad(act.silu_grad)
    return (act.elementwise(_fused.silu_grad_block(careful) if _fused.enabled(x.dtype) else careful, x, grad),)
