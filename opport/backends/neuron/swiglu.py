"""swiglu on NKI: ScalarE sigmoid of the gate, then two VectorE products, per tile."""

from __future__ import annotations

import math

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.dispatch import impl
from opport.ops.swiglu import swiglu as spec

FMAX = 4096  # free-dim chunk: gate, up, two fp32 temporaries and out <= 80 KiB per partition (fp32)
NEG_BIG = -3.4028234663852886e38  # -FLT_MAX stands in for a gate of -inf: silu(-inf) * up = -0.0 * up
DEEP = 64.0  # below -DEEP, sigmoid(gate) heads for float32 subnormals, which hold few significant bits
EXP_NEG_DEEP = 1.603810890548638e-28  # exp(-DEEP), a float32 normal


@nki.jit
def _swiglu_kernel(gate_hbm, up_hbm, inf_up, deep_gate):
    """Elementwise silu(gate) * up of two [R, C] tensors, R on partitions, C on the free dimension.

    Dimensions:
        R: partitions in use (tiled by 128); C: elements per partition (chunks of FMAX).

    Args:
        gate_hbm: [R, C] gate in HBM, float32/float16/bfloat16.
        up_hbm: [R, C] up projection, same dtype.
        inf_up: compile-time bool, True when up holds +-inf somewhere (adds the exact-limit fix-up).
        deep_gate: compile-time bool, True when some gate < -DEEP (adds the subnormal-sigmoid fix-up).

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
        VectorE instructions per tile write gate * up there through a predicated copy. Where gate < -DEEP,
        sigmoid(gate) is (nearly) subnormal and sigmoid(gate) * up loses its precision against a huge up;
        when the host saw such a gate, sigmoid(gate) * up is recomputed there as
        (exp(gate + DEEP) * up) * exp(-DEEP): exp(gate + DEEP) <= 1 keeps the product finite.

    Pseudocode:
        for each [128, FMAX] tile:
            su = sigmoid(gate) * up
            if deep_gate: su[gate < -DEEP] = (exp(gate + DEEP) * up) * exp(-DEEP)
            out = max(gate, -FLT_MAX) * su
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
            if deep_gate:
                deep_bias_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # a [P, 1] bias: any generation
                nisa.memset(dst=deep_bias_sb, value=DEEP)
                e_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
                nisa.activation(dst=e_sb, op=nl.exp, data=g_sb, bias=deep_bias_sb)
                deep_su_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=deep_su_sb, data1=e_sb, data2=u_sb, op=nl.multiply)  # before the tiny factor
                nisa.tensor_scalar(dst=deep_su_sb, data=deep_su_sb, op0=nl.multiply, operand0=EXP_NEG_DEEP)
                is_deep_sb = nl.ndarray((p, f), dtype=nl.uint8, buffer=nl.sbuf)
                nisa.tensor_scalar(dst=is_deep_sb, data=g_sb, op0=nl.less, operand0=-DEEP)
                nisa.tensor_copy_predicated(dst=su_sb, src=deep_su_sb, predicate=is_deep_sb)
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


@impl(spec, "neuron", dtypes=("float32", "float16", "bfloat16"))
def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """Host side: lay both flat inputs onto the partitions ([128, n/128] plus a [tail, 1] tail) and launch.

    The kernel is specialised on whether up holds an infinity and whether some gate lies below -DEEP
    (host-side scans), so the common case skips both fix-ups.
    """
    deep = bool((gate.astype(np.float32) < -DEEP).any())
    return _host.run_elementwise(_swiglu_kernel, (gate, up), gate.dtype.name, bool(np.isinf(up).any()), deep)
