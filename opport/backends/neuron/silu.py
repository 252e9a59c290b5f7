"""silu on NKI: one ScalarE activation per tile."""

from __future__ import annotations

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.dispatch import impl
from opport.ops.silu import silu as spec

FMAX = 8192  # free-dim chunk: in + out tiles <= 48 KiB per partition (fp32)


@nki.jit
def _silu_kernel(x_hbm):
    """Elementwise SiLU, x * sigmoid(x), of a [R, C] tensor, R on partitions, C on the free dimension.

    Dimensions:
        R: partitions in use (tiled by 128); C: elements per partition (chunks of FMAX).

    Args:
        x_hbm: [R, C] input in HBM, float32/float16/bfloat16.

    Returns:
        out_hbm: [R, C] in x's dtype.

    Notes:
        A single ScalarE nl.silu activation per tile, float32 inside, cast on the write; the
        activation table handles x = -inf (-0.0) where a naive x * sigmoid(x) would give NaN.
        ScalarE computes silu(x * scale + bias), and -0.0 + 0.0 is +0.0, so silu(-0.0) would come out
        +0.0: two VectorE instructions copy x itself where x == 0 (silu(+-0) = +-0).

    Pseudocode:
        for each [128, FMAX] tile: out = silu(x); out[x == 0] = x
    """
    R, C = x_hbm.shape
    out_hbm = nl.ndarray((R, C), dtype=x_hbm.dtype, buffer=nl.shared_hbm)
    PMAX = nl.tile_size.pmax
    for r0 in range(0, R, PMAX):
        p = min(PMAX, R - r0)
        for c0 in range(0, C, FMAX):
            f = min(FMAX, C - c0)
            x_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_sb, src=x_hbm[r0:r0 + p, c0:c0 + f])
            out_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
            nisa.activation(dst=out_sb, op=nl.silu, data=x_sb)
            zero_sb = nl.ndarray((p, f), dtype=nl.uint8, buffer=nl.sbuf)  # 1 where x == +-0
            nisa.tensor_scalar(dst=zero_sb, data=x_sb, op0=nl.equal, operand0=0.0)
            nisa.tensor_copy_predicated(dst=out_sb, src=x_sb, predicate=zero_sb)
            nisa.dma_copy(dst=out_hbm[r0:r0 + p, c0:c0 + f], src=out_sb)
    return out_hbm


@impl(spec, "neuron", dtypes=("float32", "float16", "bfloat16"))
def silu(x: np.ndarray) -> np.ndarray:
    """Host side: lay the flat input onto the partitions ([128, n/128] plus a [tail, 1] tail) and launch."""
    return _host.run_elementwise(_silu_kernel, (x,), x.dtype.name)
