"""gelu on NumPy: float32 erfc fit (exact form) or x / (1 + exp(-2u)) (tanh form), over bounded blocks."""

import numpy as np

from opport.backends.cpu import _activations as act
from opport.backends.cpu import _fused
from opport.dispatch import impl
from opport.ops.gelu import gelu as spec

# (forward, backward) block functions per form: the NumPy ones, and the fused loops' (made once) where numba is
_NUMPY = {"none": (act.gelu_erf, act.times_grad(act.gelu_erf_grad)),
          "tanh": (act.gelu_tanh, act.times_grad(act.gelu_tanh_grad))}
if _fused.numba is not None:
    _FAST = {"none": (_fused.gelu_erf_block(_NUMPY["none"][0]), _fused.gelu_erf_grad_block(_NUMPY["none"][1])),
             "tanh": (_fused.gelu_tanh_block(_NUMPY["tanh"][0]), _fused.gelu_tanh_grad_block(_NUMPY["tanh"][1]))}


def _blocks(approximate: str, dtype) -> tuple:
    form = "tanh" if approximate == "tanh" else "none"
    return (_FAST if _fused.enabled(dtype) else _NUMPY)[form]


@impl(spec, "cpu")
def gelu(x: np.ndarray, approximate: str) -> np.ndarray:
    return act.elementwise(_blocks(approximate, x.dtype)[0], x)


@impl(spec.backward_op, "cpu")
def gelu_backward(grad: np.ndarray, x: np.ndarray, approximate: str):
    return (act.elementwise(_blocks(approximate, x.dtype)[1], x, grad),)
