"""swiglu on NumPy: silu(gate) * up in float32 (float64 for float64 inputs), over bounded blocks."""

import numpy as np

from opport.backends.cpu import _activations as act
from opport.backends.cpu import _fused
from opport.dispatch import impl
from opport.ops.swiglu import swiglu as spec


def _careful(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    # gate * (sigmoid(gate) * up): sigmoid is in [0, 1], so the inner product cannot overflow, and
    # sigmoid_times keeps its precision where sigmoid(gate) is subnormal but up is huge
    y = act.sigmoid_times(gate, up)
    np.multiply(gate, y, out=y)
    # against an infinite up the exact result is gate * up wherever silu(gate) != 0, even where
    # sigmoid(gate) underflows float32 (gate < -103.9) and the product above gave 0 * inf = NaN
    np.multiply(gate, up, out=y, where=np.isinf(up))
    return np.multiply(up, -0.0, out=y, where=np.isneginf(gate))  # silu(-inf) = -0.0


def _swiglu(y: np.ndarray, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gate * (sigmoid(gate) * up), with the careful formula only where gate < -C (or -inf).

    Above -C the plain product is right, NaN and infinite up included (inf * gate; NaN for gate = 0,
    as in the reference). Below it sigmoid(gate) heads for subnormals and a huge up needs the
    rescaled product, and silu(-inf) = -0.0 has its own rule. Elementwise, so no result depends on
    its block. The roundings are those of the float reference run at the compute dtype: the noise
    floor gate judges single huge elements (up near the float max) against exactly that.
    """
    np.multiply(act.sigmoid(gate), up, out=y)
    np.multiply(gate, y, out=y)
    deep = gate < -act.DEEP[gate.dtype]
    if deep.any():
        y[deep] = _careful(gate[deep], up[deep])
    return y


@impl(spec, "cpu")
def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return act.elementwise(_fast if _fused.enabled(gate.dtype) else _swiglu, gate, up)


def _swiglu_backward(dg: np.ndarray, du: np.ndarray, gate: np.ndarray, up: np.ndarray, g: np.ndarray) -> tuple:
    """dgate = (grad * silu'(gate)) * up, and dup = swiglu(gate, grad) by the forward's block function.

    float32 blocks of 16-bit inputs redo two kinds of elements in float64, the reference's own arithmetic:
    gate < -C, where exp(-|gate|) and with it silu'(gate) head for subnormals (few significant bits) while up
    may be near the float maximum; and non-finite results, where grad * silu' overflowed though dgate does not
    (grad near the maximum, silu' up to 1.1) or an infinite grad or up met a silu' that float32 rounds to 0.
    float32's silu' errs by up to a few float32 ulps (far more near its root), well inside a 16-bit ulp.
    """
    _swiglu(du, gate, g)
    act.silu_grad(dg, gate)
    dg *= g
    dg *= up
    if dg.dtype == np.float64:  # already the reference's formula
        return dg, du
    redo = gate < -act.DEEP[gate.dtype]
    if not np.isfinite(dg.sum()):
        redo |= ~np.isfinite(dg)
    _redo_deep(dg, gate, up, g, redo)
    return dg, du


def _swiglu_backward32(dg: np.ndarray, du: np.ndarray, gate: np.ndarray, up: np.ndarray, g: np.ndarray) -> tuple:
    """The float32 blocks of float32 inputs: dgate in float64, rounded once (a large |up| turns float32's
    silu' errors near its root, 1.3e7 ulps at gate = -1.2785, into dgate's), and float64's products cannot
    overflow; gate < -C again by the careful float64 silu', exp(-gate) overflowing float64 near -709."""
    _swiglu(du, gate, g)
    act.silu_grad_product64(dg, gate, g, up)
    _redo_deep(dg, gate, up, g, gate < -act.DEEP[gate.dtype])
    return dg, du


def _redo_deep(dg: np.ndarray, gate: np.ndarray, up: np.ndarray, g: np.ndarray, redo: np.ndarray) -> None:
    """dgate of the elements `redo` by the float64 reference's formula."""
    if redo.any():
        r = np.flatnonzero(redo)
        g64 = gate[r].astype(np.float64)
        dg[r] = (g[r] * act.silu_grad(np.empty_like(g64), g64)) * up[r]


if _fused.numba is not None:  # the block functions, made once (a decode step's call is a few microseconds)
    _fast = _fused.swiglu_block(_swiglu)
    # dgate in float64 for every float32 block: 16-bit inputs gain precision
    _fast_grad = {f: _fused.swiglu_backward_block(f) for f in (_swiglu_backward32, _swiglu_backward)}


@impl(spec.backward_op, "cpu")
def swiglu_backward(grad: np.ndarray, gate: np.ndarray, up: np.ndarray):
    fn = _swiglu_backward32 if gate.dtype == np.float32 else _swiglu_backward
    if _fused.enabled(gate.dtype):
        fn = _fast_grad[fn]
    return act.elementwise(fn, gate, up, grad, outputs=2)
