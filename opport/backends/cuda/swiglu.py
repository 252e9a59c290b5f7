"""swiglu in Triton: silu(gate) * up through the shared elementwise launcher; its backward likewise."""

import torch

from opport.backends.cuda._launch import (
    at,
    cdiv,
    elementwise,
    elementwise_config,
    elementwise_tile,
    exp_f32,
    f32,
    narrow,
    neg_zero_like,
    rows_layout,
    sigmoid_f32,
    silu_grad_wide,
    tl,
    triton,
)
from opport.dispatch import impl
from opport.ops.swiglu import swiglu as spec

DEEP = tl.constexpr(64.0)  # below -DEEP, sigmoid(gate) heads for float32 subnormals (few significant bits)
EXP_NEG_DEEP = tl.constexpr(1.603810890548638e-28)  # exp(-DEEP), a float32 normal


@triton.jit
def _swiglu_kernel(
    # pointers
    gate_ptr, up_ptr, out_ptr,
    # shapes, strides
    n_rows, n_cols, n1, n2,
    g_s0, g_s1, g_s2, g_sc, u_s0, u_s1, u_s2, u_sc, o_s0, o_s1, o_s2, o_sc,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out = silu(gate) * up in float32, rounded once, with the limits of the reference. Two reads, one write."""
    i0, i1, i2, cols, mask = elementwise_tile(n_rows, n_cols, n1, n2, BLOCK_M, BLOCK_N)
    g = f32(tl.load(gate_ptr + at(i0, i1, i2, cols, g_s0, g_s1, g_s2, g_sc), mask=mask, other=0.0))
    u = f32(tl.load(up_ptr + at(i0, i1, i2, cols, u_s0, u_s1, u_s2, u_sc), mask=mask, other=0.0))
    y = _swiglu_f32(g, u)
    tl.store(out_ptr + at(i0, i1, i2, cols, o_s0, o_s1, o_s2, o_sc), narrow(y, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_f32(g, u):
    """silu(g) * u in float32 with the reference's limits (the forward, and dup = swiglu(gate, grad))."""
    # gate * (sigmoid(gate) * up) overflows or underflows only where the exact product does; against an
    # infinite up the limit is gate * up (silu(gate) != 0 for finite gate != 0), and silu(-inf) = -0.0
    # for gate < -DEEP: sigmoid(gate) * up = (exp(gate + DEEP) * up) * exp(-DEEP), no subnormal in between
    su = tl.where(g < -DEEP, (exp_f32(g + DEEP, True) * u) * EXP_NEG_DEEP, sigmoid_f32(g) * u)
    y = tl.where((u == float("inf")) | (u == float("-inf")), g * u, g * su)
    return tl.where(g == float("-inf"), neg_zero_like(u) * u, y)


@impl(spec, "cuda")
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return elementwise(_swiglu_kernel, [gate, up], torch.empty(gate.shape, dtype=gate.dtype, device=gate.device))


# --------------------------------------------------------------------------- backward


@triton.jit
def _swiglu_bwd_kernel(
    # pointers
    grad_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr,
    # shapes, strides
    n_rows, n_cols, n1, n2,
    r_s0, r_s1, r_s2, r_sc, g_s0, g_s1, g_s2, g_sc, u_s0, u_s1, u_s2, u_sc,
    dg_s0, dg_s1, dg_s2, dg_sc, du_s0, du_s1, du_s2, du_sc,
    # meta-parameters
    WIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dgate = (grad * silu'(gate)) * up and dup = swiglu(gate, grad), each rounded once. Three reads, two writes.

    Notes: dgate's products are taken in float64, as the reference's: grad * silu'(gate) (up to 1.1 |grad|) may
    overflow float32 where dgate does not, and float64 keeps silu'(gate) nonzero down to -745 (`silu_grad_wide`),
    so a deep gate against up near the float maximum stays O(1) and an infinite factor keeps its sign. WIDE
    (float32 inputs): silu' in float64 too (float64 exp and division): near its root, gate = -1.2785, float32's
    silu' cancels to ~1e-8 absolute, which a large |grad * up| would carry into dgate (16-bit outputs hide it).
    """
    i0, i1, i2, cols, mask = elementwise_tile(n_rows, n_cols, n1, n2, BLOCK_M, BLOCK_N)
    r = f32(tl.load(grad_ptr + at(i0, i1, i2, cols, r_s0, r_s1, r_s2, r_sc), mask=mask, other=0.0))
    g = f32(tl.load(gate_ptr + at(i0, i1, i2, cols, g_s0, g_s1, g_s2, g_sc), mask=mask, other=0.0))
    u = f32(tl.load(up_ptr + at(i0, i1, i2, cols, u_s0, u_s1, u_s2, u_sc), mask=mask, other=0.0))
    d = silu_grad_wide(g.to(tl.float64) if WIDE else g, WIDE)
    dgate = ((r.to(tl.float64) * d) * u.to(tl.float64)).to(tl.float32)
    tl.store(dgate_ptr + at(i0, i1, i2, cols, dg_s0, dg_s1, dg_s2, dg_sc), narrow(dgate, dgate_ptr.dtype.element_ty),
             mask=mask)
    tl.store(dup_ptr + at(i0, i1, i2, cols, du_s0, du_s1, du_s2, du_sc), narrow(_swiglu_f32(g, r), dup_ptr.dtype.element_ty),
             mask=mask)


@impl(spec.backward_op, "cuda")
def swiglu_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    dup = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if dgate.numel():
        _launch_pair(grad, gate, up, dgate, dup)
    return dgate, dup


def _launch_pair(grad, gate, up, dgate, dup):
    """The elementwise launch with two outputs (both allocated alike, so one layout serves them)."""
    lay, (grad, gate, up) = rows_layout([grad, gate, up], dgate, merge_cols=True)
    cfg = elementwise_config(lay)
    strides = [s for t in range(4) for s in lay.args(t)] + list(lay.args(3))
    wide = gate.dtype == torch.float32
    _swiglu_bwd_kernel[(cdiv(lay.n_rows, cfg.block_m) * cdiv(lay.n_cols, cfg.block_n),)](
        grad, gate, up, dgate, dup, lay.n_rows, lay.n_cols, lay.sizes[1], lay.sizes[2], *strides,
        WIDE=wide, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        num_warps=2 * cfg.num_warps if wide else cfg.num_warps,  # float64 exp and division: 254 registers at 4 warps
    )
