"""gelu on NumPy: float32 erfc fit (exact form) or x / (1 + exp(-2u)) (tanh form), over bounded blocks."""

import numpy as np

from opport.backends.cpu import _activations as act
from opport.backends.cpu import _fused
from opport.dispatch import impl
from opport.ops.gelu import gelu as spec


@impl(spec, "cpu")
def gelu(x: np.ndarray, approximate: str) -> np.ndarray:
    if approximate != "tanh":
        return act.elementwise(_fused.gelu_erf_block(act.gelu_erf) if _fused.enabled(x.dtype) else act.gelu_erf, x)
    return act.elementwise(_fused.gelu_tanh_block(act.gelu_tanh) if _fused.enabled(x.dtype) else act.gelu_tanh, x)


@impl(spec.backward_op, "cpu")
def gelu_backward(grad: np.ndarray, x: np.ndarray, approximate: str):
    if approximate != "tanh":
        careful = act.times_grad(act.gelu_erf_grad)
        return (act.elementwise(_fused.gelu_erf_grad_block(careful) if _fused.enabled(x.dtype) else careful, x, grad),)
    careful = act.times_grad(act.gelu_tanh_grad)
    return (act.elementwise(_fused.gelu_tanh_grad_block(careful) if _fused.enabled(x.dtype) else careful, x, grad),)
