"""softmax in Triton over any axis: the axis becomes the row (by strides, no copy), online max/sum past one tile."""

import torch

from opport.backends.cuda._launch import at, cdiv, exp_f32, f32, lead_index, narrow, row_config, rows_layout, tl, triton
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


@impl(spec, "cuda", dtypes=("float32", "float16", "bfloat16"))
def softmax(x: torch.Tensor, axis: int) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if x.dim() == 0:  # a row of one element
        xv, ov = x.reshape(1), out.reshape(1)
    else:
        xv, ov = x.movedim(axis, -1), out.movedim(axis, -1)  # views: the kernel reads the axis by its stride
    lay, (xv,) = rows_layout([xv], ov)
    cfg = row_config(lay.n_rows, lay.n_cols)
    _softmax_kernel[(cdiv(lay.n_rows, cfg.block_m),)](
        xv, ov, lay.n_rows, lay.n_cols, lay.sizes[1], lay.sizes[2], *lay.args(0), *lay.args(1),
        PRECISE=x.dtype == torch.float32, **cfg.meta, num_warps=cfg.num_warps,
    )
    return out
