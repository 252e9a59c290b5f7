"""swiglu on NumPy: silu(gate) * up in float32 (float64 for float64 inputs), over bounded blocks."""

import numpy as np

from opport.backends.cpu import _activations as act
from opport.ops.swiglu import swiglu as spec


def _swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    # gate * (sigmoid(gate) * up): sigmoid is in [0, 1], so the inner product cannot overflow, and
    # sigmoid_times keeps its precision where sigmoid(gate) is subnormal but up is huge
    y = act.sigmoid_times(gate, up)
    np.multiply(gate, y, out=y)
    # against an infinite up the exact result is gate * up wherever silu(gate) != 0, even where
    # sigmoid(gate) underflows float32 (gate < -103.9) and the product above gave 0 * inf = NaN
    np.multiply(gate, up, out=y, where=np.isinf(up))
    return np.multiply(up, -0.0, out=y, where=np.isneginf(gate))  # silu(-inf) = -0.0


@spec.impl("cpu")
def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return act.elementwise(_swiglu, gate, up)
