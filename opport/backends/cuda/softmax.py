"""softmax in Triton over any axis: the axis becomes the row (by strides, no copy), online max/sum past one tile;
its backward y (g - sum(g y)) the same way, with the row sum in float64."""

import torch

from opport.backends.cuda._launch import (
    at,
    bwd_row_config,
    cdiv,
    exp_f32,
    f32,
    is_finite,
    lead_index,
    narrow,
    row_config,
    rows_layout,
    tl,
    triton,
)
from opport.dispatch import impl
from opport.ops.softmax import softmax as spec


@triton.jit
def _softmax_kernel(
    # pointers
    x_ptr, out_ptr,
    # shapes, strides
    n_rows, n_cols, n1, n2,
    x_s0, x_s1, x_s2, x_sc,
    o_s0, o_s1, o_s2, o_sc,
    # meta-parameters
    PRECISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr,
):
    """out = exp(x - max) / sum(exp(x - max)) over each row, float32 inside.

    Dimensions: x, out [n_rows, n_cols] strided views (the softmax axis is the column axis).
    Notes: masked columns load -inf (neutral for the max, exp gives 0 for the sum). SINGLE holds
    the row in registers: one read, one write. Otherwise pass 1 keeps a running max m and sum
    (sum *= exp(m_old - m_new) when the max grows) and pass 2 re-reads to write: two reads, one
    write. A running max of -inf is replaced by 0 inside the exponentials so an all -inf prefix
    adds 0 instead of NaN; the final pass uses the true max, so an all -inf row is NaN (torch).
    PRECISE (float32 output) takes libdevice's expf: the fast exp's 15 ULP exceed the 1.3e-6 rtol.
    Pseudocode: m = max(x); l = sum(exp(x - m)); out = exp(x - m) / l
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = (rows < n_rows)[:, None]
    i0, i1, i2 = lead_index(rows, n1, n2)
    i0, i1, i2 = i0[:, None], i1[:, None], i2[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    if SINGLE:
        mask = row_ok & (cols < n_cols)
        x = f32(tl.load(x_ptr + at(i0, i1, i2, cols, x_s0, x_s1, x_s2, x_sc), mask=mask, other=float("-inf")))
        e = exp_f32(x - tl.max(x, 1)[:, None], PRECISE)
        y = e / tl.sum(e, 1)[:, None]
        tl.store(out_ptr + at(i0, i1, i2, cols, o_s0, o_s1, o_s2, o_sc), narrow(y, out_ptr.dtype.element_ty), mask=mask)
    else:
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        total = tl.zeros((BLOCK_M,), tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            mask = row_ok & (start + cols < n_cols)
            x = f32(tl.load(x_ptr + at(i0, i1, i2, start + cols, x_s0, x_s1, x_s2, x_sc), mask=mask, other=float("-inf")))
            m_new = tl.maximum(m, tl.max(x, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            total = total * exp_f32(m - m_safe, PRECISE) + tl.sum(exp_f32(x - m_safe[:, None], PRECISE), 1)
            m = m_new
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = row_ok & (c < n_cols)
            x = f32(tl.load(x_ptr + at(i0, i1, i2, c, x_s0, x_s1, x_s2, x_sc), mask=mask, other=float("-inf")))
            y = exp_f32(x - m[:, None], PRECISE) / total[:, None]
            tl.store(out_ptr + at(i0, i1, i2, c, o_s0, o_s1, o_s2, o_sc), narrow(y, out_ptr.dtype.element_ty), mask=mask)


@impl(spec, "cuda")
def softmax(x: torch.Tensor, axis: int) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    (xv,), ov = _axis_last([x], out, axis)
    lay, (xv,) = rows_layout([xv], ov)
    cfg = row_config(lay.n_rows, lay.n_cols)
    _softmax_kernel[(cdiv(lay.n_rows, cfg.block_m),)](
        xv, ov, lay.n_rows, lay.n_cols, lay.sizes[1], lay.sizes[2], *lay.args(0), *lay.args(1),
        PRECISE=x.dtype == torch.float32, **cfg.meta, num_warps=cfg.num_warps,
    )
    return out


def _axis_last(inputs: list, out, axis: int) -> tuple:
    """Views with the softmax axis last (the kernels read it by its stride); a 0-d tensor is a row of one element."""
    if out.dim() == 0:
        return [t.reshape(1) for t in inputs], out.reshape(1)
    return [t.movedim(axis, -1) for t in inputs], out.movedim(axis, -1)


# --------------------------------------------------------------------------- backward


@triton.jit
def _softmax_bwd_kernel(
    # pointers
    g_ptr, y_ptr, dx_ptr,
    # shapes, strides
    n_rows, n_cols, n1, n2,
    g_s0, g_s1, g_s2, g_sc,
    y_s0, y_s1, y_s2, y_sc,
    d_s0, d_s1, d_s2, d_sc,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr,
):
    """dx = y (g - s), s = sum(g y) over each row, from the saved output y.

    Dimensions: g, y, dx [n_rows, n_cols] strided views (the softmax axis is the column axis).
    Notes: s is summed in float64 from exact products (float32 x float32 fits a float64 significand): where
    g_i is close to s, dx_i cancels (a constant grad: dx = y c (1 - sum y), only the roundings of the saved y),
    and a float32 sum's error of |s| 2^-24 would swamp it. `_softmax_dx` applies s as two floats. SINGLE holds
    the row in registers (one read of g and y); otherwise pass 1 sums chunk by chunk, pass 2 re-reads.
    Masked columns load 0: neutral for the sum, and not stored.
    Pseudocode: s = sum(g * y); dx = y * ((g - hi(s)) - lo(s)), or g y - y s where that is not finite
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = (rows < n_rows)[:, None]
    i0, i1, i2 = lead_index(rows, n1, n2)
    i0, i1, i2 = i0[:, None], i1[:, None], i2[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    if SINGLE:
        mask = row_ok & (cols < n_cols)
        g = f32(tl.load(g_ptr + at(i0, i1, i2, cols, g_s0, g_s1, g_s2, g_sc), mask=mask, other=0.0))
        y = f32(tl.load(y_ptr + at(i0, i1, i2, cols, y_s0, y_s1, y_s2, y_sc), mask=mask, other=0.0))
        s = tl.sum(g.to(tl.float64) * y.to(tl.float64), 1)[:, None]
        dx = _softmax_dx(g, y, s)
        tl.store(dx_ptr + at(i0, i1, i2, cols, d_s0, d_s1, d_s2, d_sc), narrow(dx, dx_ptr.dtype.element_ty), mask=mask)
    else:
        s = tl.zeros((BLOCK_M,), tl.float64)
        for start in range(0, n_cols, BLOCK_N):
            mask = row_ok & (start + cols < n_cols)
            g = f32(tl.load(g_ptr + at(i0, i1, i2, start + cols, g_s0, g_s1, g_s2, g_sc), mask=mask, other=0.0))
            y = f32(tl.load(y_ptr + at(i0, i1, i2, start + cols, y_s0, y_s1, y_s2, y_sc), mask=mask, other=0.0))
            s += tl.sum(g.to(tl.float64) * y.to(tl.float64), 1)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = row_ok & (c < n_cols)
            g = f32(tl.load(g_ptr + at(i0, i1, i2, c, g_s0, g_s1, g_s2, g_sc), mask=mask, other=0.0))
            y = f32(tl.load(y_ptr + at(i0, i1, i2, c, y_s0, y_s1, y_s2, y_sc), mask=mask, other=0.0))
            dx = _softmax_dx(g, y, s[:, None])
            tl.store(dx_ptr + at(i0, i1, i2, c, d_s0, d_s1, d_s2, d_sc), narrow(dx, dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_dx(g, y, s):
    """y ((g - s_hi) - s_lo) for float64 s = s_hi + s_lo: where g_i is near s, g_i - s_hi is exact and dx_i keeps
    its relative accuracy. Where that is not finite, the reference's form g y - y s in float64: g - s can
    overflow where dx is finite, 0 * inf is NaN at masked positions (y = 0), and a real NaN or inf in the row
    gives the reference's own NaN / inf pattern."""
    hi = s.to(tl.float32)
    lo = (s - hi.to(tl.float64)).to(tl.float32)
    dx = ((g - hi) - lo) * y
    y64 = y.to(tl.float64)
    return tl.where(is_finite(dx), dx, (g.to(tl.float64) * y64 - y64 * s).to(tl.float32))


@impl(spec.backward_op, "cuda")
def softmax_backward(grad: torch.Tensor, out: torch.Tensor, axis: int):
    dx = torch.empty(out.shape, dtype=out.dtype, device=out.device)
    if dx.numel() == 0:
        return (dx,)
    (gv, yv), dv = _axis_last([grad, out], dx, axis)
    lay, (gv, yv) = rows_layout([gv, yv], dv)
    cfg = bwd_row_config(lay.n_rows, lay.n_cols, spread=4)  # float64 temporaries: 4 x 1024 tiles spilled at 8 warps
    _softmax_bwd_kernel[(cdiv(lay.n_rows, cfg.block_m),)](
        gv, yv, dv, lay.n_rows, lay.n_cols, lay.sizes[1], lay.sizes[2], *lay.args(0), *lay.args(1), *lay.args(2),
        **cfg.meta, num_warps=cfg.num_warps,
    )
    return (dx,)
