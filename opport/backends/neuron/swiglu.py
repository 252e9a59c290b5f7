"""swiglu on NKI: ScalarE sigmoid of the gate, then two VectorE products, per tile."""

from __future__ import annotations

import math

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron._tiles import spans
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.backends.neuron.silu import clipped, deep_factor, infinite_limit, silu_grad
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
    for r0, p in spans(R, PMAX):
        for c0, f in spans(C, FMAX):
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


@impl(spec, "neuron")
def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """Host side: lay both flat inputs onto the partitions ([128, n/128] plus a [tail, 1] tail) and launch.

    The kernel is specialised on whether up holds an infinity and whether some gate lies below -DEEP
    (host-side scans), so the common case skips both fix-ups.
    """
    deep = bool((gate.astype(np.float32) < -DEEP).any())
    return _host.run_elementwise(_swiglu_kernel, (gate, up), gate.dtype.name, bool(np.isinf(up).any()), deep)


# --------------------------------------------------------------------------- backward

GRAD_FMAX = 1024  # backward free-dim chunk: three inputs, two outputs and ~12 fp32 temporaries <= 80 KiB per partition
EXP_NEG_HALF_DEEP = 1.2664165549094176e-14  # exp(-DEEP / 2): the deep tail's exp(-DEEP), in two halves around up
SWIGLU_GRAD_ZERO64 = -745.1332397460938  # float32 gate at and below which float64 silu'(gate) is 0: inf * 0 = NaN there


def swiglu_product(du_sb, gate_sb, g_sb, sp_sb, eg_sb, is_deep_sb, p, f):
    """du = swiglu(gate, g) = gate * (sigmoid(gate) * g) with the forward kernel's rules, into du (the output
    dtype): sigmoid(gate) * g recomputed as (exp(gate + DEEP) * g) * exp(-DEEP) below -DEEP (eg_sb holds
    exp(gate + DEEP) * g), gate = -inf taken as -FLT_MAX (silu(-inf) * g = -0.0 * g), and gate * g where g is
    infinite and gate > -inf (silu(gate) != 0 there, even where sigmoid(gate) underflows float32)."""
    su_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=su_sb, data1=sp_sb, data2=g_sb, op=nl.multiply)
    deep_su_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=deep_su_sb, data=eg_sb, op0=nl.multiply, operand0=EXP_NEG_DEEP)
    nisa.tensor_copy_predicated(dst=su_sb, src=deep_su_sb, predicate=is_deep_sb)
    nisa.scalar_tensor_tensor(dst=du_sb, data=gate_sb, op0=nl.maximum, operand0=NEG_BIG, op1=nl.multiply,
                              operand1=su_sb)
    ginf_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)  # 1.0 where |g| = inf
    nisa.tensor_scalar(dst=ginf_sb, data=g_sb, op0=nl.abs, operand0=0.0, op1=nl.equal, operand1=math.inf)
    pick_sb = nl.ndarray((p, f), dtype=nl.uint8, buffer=nl.sbuf)  # ... and gate > -inf
    nisa.scalar_tensor_tensor(dst=pick_sb, data=gate_sb, op0=nl.greater, operand0=-math.inf, op1=nl.multiply,
                              operand1=ginf_sb)
    lim_sb = nl.ndarray((p, f), dtype=du_sb.dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=lim_sb, data1=gate_sb, data2=g_sb, op=nl.multiply)
    nisa.tensor_copy_predicated(dst=du_sb, src=lim_sb, predicate=pick_sb)


def gate_grad(dg_sb, gate_sb, gc_sb, g_sb, u_sb, sp_sb, eg_sb, is_deep_sb, p, f):
    """dg = (g * silu'(gate)) * up in float32. silu' is at most 1.0998, so g * silu' may pass FLT_MAX where
    the reference's float64 product times a |up| < 1 does not: g * (silu' / 2), times up, times 2 keeps every
    intermediate finite unless the result overflows. Below -DEEP it is (((g exp(gate + DEEP)) (1 + gate))
    exp(-DEEP/2)) up exp(-DEEP/2) (silu's deep_factor), the tiny factor split around up so that neither a
    huge up (to FLT_MAX) overflows nor a moderate one meets a product already subnormal; and an infinite g or
    up that met a silu' float32 rounds to 0 takes the reference's infinite limit (infinite_limit)."""
    d_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    silu_grad(d_sb, sp_sb, gate_sb, gc_sb, p, f)
    nisa.scalar_tensor_tensor(dst=d_sb, data=d_sb, op0=nl.multiply, operand0=0.5, op1=nl.multiply, operand1=g_sb)
    nisa.tensor_tensor(dst=d_sb, data1=d_sb, data2=u_sb, op=nl.multiply)
    nisa.tensor_scalar(dst=dg_sb, data=d_sb, op0=nl.multiply, operand0=2.0)
    deep_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)  # (1 + gate) clipped: -inf gives g * 0
    nisa.scalar_tensor_tensor(dst=deep_sb, data=gc_sb, op0=nl.add, operand0=1.0, op1=nl.multiply, operand1=eg_sb)
    nisa.tensor_scalar(dst=deep_sb, data=deep_sb, op0=nl.multiply, operand0=EXP_NEG_HALF_DEEP)
    nisa.tensor_tensor(dst=deep_sb, data1=deep_sb, data2=u_sb, op=nl.multiply)
    nisa.tensor_scalar(dst=deep_sb, data=deep_sb, op0=nl.multiply, operand0=EXP_NEG_HALF_DEEP)
    nisa.tensor_copy_predicated(dst=dg_sb, src=deep_sb, predicate=is_deep_sb)
    lim_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)  # -(g * up): silu' < 0 in the deep tail
    nisa.scalar_tensor_tensor(dst=lim_sb, data=g_sb, op0=nl.multiply, operand0=-1.0, op1=nl.multiply, operand1=u_sb)
    infinite_limit(dg_sb, gate_sb, lim_sb, SWIGLU_GRAD_ZERO64, p, f)


@nki.jit
def _swiglu_backward_kernel(g_hbm, gate_hbm, up_hbm):
    """Gradients of silu(gate) * up for gate and up, of [R, C] tensors, R on partitions, C on the free dimension.

    Dimensions:
        R: partitions in use (tiled by 128); C: elements per partition (chunks of GRAD_FMAX).

    Args:
        g_hbm: [R, C] upstream gradient in HBM, float32/float16/bfloat16.
        gate_hbm: [R, C] the forward's gate (saved), same dtype.
        up_hbm: [R, C] the forward's up (saved), same dtype.

    Returns:
        dgate_hbm, dup_hbm: [R, C] each, in gate's dtype.

    Notes:
        dup = swiglu(gate, grad) and dgate = (grad * silu'(gate)) * up share one ScalarE sigmoid(gate) and
        one exp(gate + DEEP) (the scaled deep tail: below -DEEP sigmoid(gate) is subnormal or 0 in float32);
        silu'(gate) = sigmoid(gate) (1 + gate sigmoid(-gate)) takes a second sigmoid. Everything else is
        VectorE, float32 inside, cast once on the way out (swiglu_product, gate_grad say which special
        values need which rule). Pure streaming: grad, gate and up read once, both gradients written once.

    Pseudocode:
        for each [128, GRAD_FMAX] tile:
            s = sigmoid(gate); eg = exp(gate + DEEP) * g
            dup = swiglu(gate, g)                          (forward's rules, deep tail from eg)
            dgate = ((g * silu'(gate) / 2) * up) * 2
            dgate[gate < -DEEP] = (((eg * (1 + gate)) * exp(-DEEP/2)) * up) * exp(-DEEP/2)
            dgate[dgate NaN, |g * up| = inf, gate > -745.13] = -(g * up)
    """
    R, C = gate_hbm.shape
    dgate_hbm = nl.ndarray((R, C), dtype=gate_hbm.dtype, buffer=nl.shared_hbm)
    dup_hbm = nl.ndarray((R, C), dtype=gate_hbm.dtype, buffer=nl.shared_hbm)
    PMAX = nl.tile_size.pmax
    for r0, p in spans(R, PMAX):
        for c0, f in spans(C, GRAD_FMAX):
            gate_sb = nl.ndarray((p, f), dtype=gate_hbm.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=gate_sb, src=gate_hbm[r0:r0 + p, c0:c0 + f])
            u_sb = nl.ndarray((p, f), dtype=up_hbm.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=u_sb, src=up_hbm[r0:r0 + p, c0:c0 + f])
            g_sb = nl.ndarray((p, f), dtype=g_hbm.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=g_sb, src=g_hbm[r0:r0 + p, c0:c0 + f])
            sp_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=sp_sb, op=nl.sigmoid, data=gate_sb)
            eg_sb, is_deep_sb = deep_factor(gate_sb, g_sb, p, f)

            du_sb = nl.ndarray((p, f), dtype=gate_hbm.dtype, buffer=nl.sbuf)
            swiglu_product(du_sb, gate_sb, g_sb, sp_sb, eg_sb, is_deep_sb, p, f)
            nisa.dma_copy(dst=dup_hbm[r0:r0 + p, c0:c0 + f], src=du_sb)

            dg_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
            gate_grad(dg_sb, gate_sb, clipped(gate_sb, p, f), g_sb, u_sb, sp_sb, eg_sb, is_deep_sb, p, f)
            dgate_sb = nl.ndarray((p, f), dtype=gate_hbm.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=dgate_sb, src=dg_sb)
            nisa.dma_copy(dst=dgate_hbm[r0:r0 + p, c0:c0 + f], src=dgate_sb)
    return dgate_hbm, dup_hbm


@impl(spec.backward_op, "neuron")
def swiglu_backward(grad: np.ndarray, gate: np.ndarray, up: np.ndarray):
    """Host side: lay grad, gate and up onto the partitions ([128, n/128] plus a [tail, 1] tail), launch per part."""
    flats = [_host.contiguous(a).reshape(-1) for a in (grad, gate, up)]
    dgate, dup = (np.empty(gate.size, gate.dtype) for _ in range(2))
    for start, parts, per in _host.elementwise_parts(gate.size):
        views = [a[start:start + parts * per].reshape(parts, per) for a in flats]
        outs = _host.run(_swiglu_backward_kernel, *views)
        for dst, out in zip((dgate, dup), outs):
            dst[start:start + parts * per] = _host.as_dtype(out, gate.dtype.name, (parts * per,))
    return dgate.reshape(gate.shape), dup.reshape(gate.shape)
