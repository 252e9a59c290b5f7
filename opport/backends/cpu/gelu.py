"""gelu on NumPy: float32 erfc fit (exact form) or x / (1 + exp(-2u)) (tanh form), over bounded blocks."""

import numpy as np

from opport.backends.cpu import _activations as act
from opport.dispatch import impl
from opport.ops.gelu import gelu as spec


@impl(spec, "cpu")
def gelu(x: np.ndarray, approximate: str) -> np.ndarray:
    return act.elementwise(act.gelu_tanh if approximate == "tanh" else act.gelu_erf, x)


@impl(spec.backward_op, "cpu")
def gelu_backward(grad: np.ndarray, x: np.ndarray, approximate: str):
    deriv = act.gelu_tanh_grad if approximate == "tanh" else act.gelu_erf_grad
    return (act.elementwise(act.times_grad(deriv), x, grad),)
