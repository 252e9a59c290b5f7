"""gelu on NKI: one ScalarE activation per tile (erf form or tanh form)."""

from __future__ import annotations

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.dispatch import impl
from opport.ops.gelu import gelu as spec

FMAX = 4096  # free-dim chunk: in, clamped and out tiles <= 48 KiB per partition (fp32), room to double-buffer
NEG_BIG = -3.4028234663852886e38  # -FLT_MAX: gelu(-FLT_MAX) = -0.0 = gelu(-inf), inside the activation's input range


@nki.jit
def _gelu_kernel(x_hbm, approximate):
    """Elementwise GELU of a [R, C] tensor, R on partitions, C on the free dimension.

    Dimensions:
        R: partitions in use (tiled by 128); C: elements per partition (chunks of FMAX).

    Args:
        x_hbm: [R, C] input in HBM, float32/float16/bfloat16.
        approximate: compile-time "none" (x * Phi(x), erf form) or "tanh".

    Returns:
        out_hbm: [R, C] in x's dtype.

    Notes:
        One ScalarE activation per tile (nl.gelu or nl.gelu_apprx_tanh), computed in float32 and
        cast to x's dtype on the write. The activation tables cover the reals only (-inf would give
        -inf * 0 = NaN), so a VectorE max first maps -inf to -FLT_MAX, whose GELU is the limit -0.0
        (NaN must pass through that max: IEEE maximum, checked in emulation only). Pure streaming:
        every element is read and written once. ScalarE adds its (zero) bias, which turns -0.0 into
        +0.0: two VectorE instructions copy x itself where x == 0 (gelu(+-0) = +-0).

    Pseudocode:
        for each [128, FMAX] tile: out = gelu(max(x, -FLT_MAX)); out[x == 0] = x
    """
    R, C = x_hbm.shape
    out_hbm = nl.ndarray((R, C), dtype=x_hbm.dtype, buffer=nl.shared_hbm)
    PMAX = nl.tile_size.pmax
    act = nl.gelu_apprx_tanh if approximate == "tanh" else nl.gelu
    for r0 in range(0, R, PMAX):
        p = min(PMAX, R - r0)
        for c0 in range(0, C, FMAX):
            f = min(FMAX, C - c0)
            x_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_sb, src=x_hbm[r0:r0 + p, c0:c0 + f])
            xc_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=xc_sb, data=x_sb, op0=nl.maximum, operand0=NEG_BIG)
            out_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
            nisa.activation(dst=out_sb, op=act, data=xc_sb)
            zero_sb = nl.ndarray((p, f), dtype=nl.uint8, buffer=nl.sbuf)  # 1 where x == +-0
            nisa.tensor_scalar(dst=zero_sb, data=x_sb, op0=nl.equal, operand0=0.0)
            nisa.tensor_copy_predicated(dst=out_sb, src=x_sb, predicate=zero_sb)
            nisa.dma_copy(dst=out_hbm[r0:r0 + p, c0:c0 + f], src=out_sb)
    return out_hbm


@impl(spec, "neuron", dtypes=("float32", "float16", "bfloat16"))
def gelu(x: np.ndarray, approximate: str) -> np.ndarray:
    """Host side: lay the flat input onto the partitions ([128, n/128] plus a [tail, 1] tail) and launch."""
    return _host.run_elementwise(_gelu_kernel, (x,), x.dtype.name, approximate)
