"""swiglu on NKI: ScalarE sigmoid of the gate, then two VectorE products, per tile."""

from __future__ import annotations

import math

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.ops.swiglu import swiglu as spec

FMAX = 4096  # free-dim chunk: gate, up, two fp32 temporaries and out <= 80 KiB per partition (fp32)
NEG_BIG = -3.4028234663852886e38  # -FLT_MAX stands in for a gate of -inf: silu(-inf) * up = -0.0 * up


@nki.jit
def _swiglu_kernel(gate_hbm, up_hbm, inf_up):
    """Elementwise silu(gate) * up of two [R, C] tensors, R on partitions, C on the free dimension.

    Dimensions:
        R: partitions in use (tiled by 128); C: elements per partition (chunks of FMAX).

    Args:
        gate_hbm: [R, C] gate in HBM, float32/float16/bfloat16.
        up_hbm: [R, C] up projection, same dtype.
        inf_up: compile-time bool, True when up holds +-inf somewhere (adds the exact-limit fix-up).

    Returns:
        out_hbm: [R, C] in gate's dtype.

    Notes:
        Computed as gate * (sigmoid(gate) * up): sigmoid is in [0, 1], so the inner product cannot
        overflow where silu(gate) * up would. ScalarE computes the sigmoid while VectorE does the two
        products of the previous tile; the outer product is one scalar_tensor_tensor that also maps a
        gate of -inf to -FLT_MAX, so silu(-inf) * up is the signed zero -0.0 * up (NaN against an
        infinite up, as in the reference). silu(gate) is nonzero for every finite gate != 0, so against
        up = +-inf the exact result is gate * up even where sigmoid(gate) underflows float32 (gate <
        -104) and the products above give 0 * inf = NaN; when the host saw an infinite up, three more
        VectorE instructions per tile write gate * up there through a predicated copy.

    Pseudocode:
        for each [128, FMAX] tile:
            out = max(gate, -FLT_MAX) * (sigmoid(gate) * up)
            if inf_up: out[|up| == inf and gate > -inf] = gate * up
    """
    R, C = gate_hbm.shape
    out_hbm = nl.ndarray((R, C), dtype=gate_hbm.dtype, buffer=nl.shared_hbm)
    PMAX = nl.tile_size.pmax
    for r0 in range(0, R, PMAX):
        p = min(PMAX, R - r0)
        for c0 in range(0, C, FMAX):
            f = min(FMAX, C - c0)
            g_sb = nl.ndarray((p, f), dtype=gate_hbm.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=g_sb, src=gate_hbm[r0:r0 + p, c0:c0 + f])
            u_sb = nl.ndarray((p, f), dtype=up_hbm.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=u_sb, src=up_hbm[r0:r0 + p, c0:c0 + f])
            sig_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=sig_sb, op=nl.sigmoid, data=g_sb)
            su_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=su_sb, data1=sig_sb, data2=u_sb, op=nl.multiply)
            out_sb = nl.ndarray((p, f), dtype=gate_hbm.dtype, buffer=nl.sbuf)
            nisa.scalar_tensor_tensor(dst=out_sb, data=g_sb, op0=nl.maximum, operand0=NEG_BIG, op1=nl.multiply,
                                      operand1=su_sb)
            if inf_up:
                uinf_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)  # 1.0 where |up| = inf
                nisa.tensor_scalar(dst=uinf_sb, data=u_sb, op0=nl.abs, operand0=0.0, op1=nl.equal, operand1=math.inf)
                pick_sb = nl.ndarray((p, f), dtype=nl.uint8, buffer=nl.sbuf)  # ... and gate > -inf
                nisa.scalar_tensor_tensor(dst=pick_sb, data=g_sb, op0=nl.greater, operand0=-math.inf, op1=nl.multiply,
                                          operand1=uinf_sb)
                lim_sb = nl.ndarray((p, f), dtype=gate_hbm.dtype, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=lim_sb, data1=g_sb, data2=u_sb, op=nl.multiply)
                nisa.tensor_copy_predicated(dst=out_sb, src=lim_sb, predicate=pick_sb)
            nisa.dma_copy(dst=out_hbm[r0:r0 + p, c0:c0 + f], src=out_sb)
    return out_hbm


@spec.impl("neuron", dtypes=("float32", "float16", "bfloat16"))
def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """Host side: lay both flat inputs onto the partitions ([128, n/128] plus a [tail, 1] tail) and launch.

    The kernel is specialised on whether up holds an infinity (a host-side scan of up), so the common
    finite case skips the exact-limit fix-up.
    """
    return _host.run_elementwise(_swiglu_kernel, (gate, up), gate.dtype.name, bool(np.isinf(up).any()))
