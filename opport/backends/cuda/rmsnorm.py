"""rmsnorm in Triton: one program normalises BLOCK_M rows, statistics in float32."""

import torch

from opport.backends.cuda._launch import at, cdiv, f32, lead_index, narrow, pow2_scale, row_config, rows_layout, tl, triton
from opport.dispatch import impl
from opport.ops.rmsnorm import rmsnorm as spec


@triton.jit
def _rmsnorm_kernel(
    # pointers
    x_ptr, w_ptr, out_ptr,
    # shapes, strides
    n_rows, n_cols, n1, n2,
    x_s0, x_s1, x_s2, x_sc,
    o_s0, o_s1, o_s2, o_sc,
    w_s, eps,
    # meta-parameters
    HAS_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr,
):
    """y = x / sqrt(mean(x**2) + eps) * w over each row.

    Dimensions: x, out [n_rows, n_cols] as strided views (leading dims n0 x n1 x n2); w [n_cols].
    Notes: SINGLE keeps the whole row in registers (reads x once); otherwise pass 1 sums squares
    chunk by chunk and pass 2 re-reads (from L2 for rows up to a few MB) to scale. Masked columns
    load 0, neutral for the sum of squares. The squares are taken of x / s, s a power of two near
    max|x| when that is >= 2 (exact scaling), so float32 statistics do not overflow where the float64
    reference does not (|x| > 1.8e19/sqrt(n)); the chunked pass rescales its running sum when a chunk
    raises s, like an online softmax.
    Pseudocode: for each row: s = pow2_scale(max|x|); r = rsqrt(mean((x/s)**2) + eps/s**2); out = (x/s) * r * w
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = (rows < n_rows)[:, None]
    i0, i1, i2 = lead_index(rows, n1, n2)
    i0, i1, i2 = i0[:, None], i1[:, None], i2[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    if SINGLE:
        mask = row_ok & (cols < n_cols)
        x = f32(tl.load(x_ptr + at(i0, i1, i2, cols, x_s0, x_s1, x_s2, x_sc), mask=mask, other=0.0))
        s = pow2_scale(tl.max(tl.abs(x), 1))[:, None]
        xs = x / s
        r = tl.rsqrt(tl.sum(xs * xs, 1)[:, None] / n_cols + eps / (s * s))
        _scale_store(xs, r, w_ptr, w_s, cols, mask, out_ptr + at(i0, i1, i2, cols, o_s0, o_s1, o_s2, o_sc), HAS_WEIGHT)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        s = tl.full((BLOCK_M, 1), 1.0, tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            mask = row_ok & (start + cols < n_cols)
            x = f32(tl.load(x_ptr + at(i0, i1, i2, start + cols, x_s0, x_s1, x_s2, x_sc), mask=mask, other=0.0))
            s_new = tl.maximum(s, pow2_scale(tl.max(tl.abs(x), 1))[:, None])
            ratio = s / s_new  # a power of two <= 1: exact rescale of the running sum
            xs = x / s_new
            acc = acc * (ratio * ratio) + xs * xs
            s = s_new
        r = tl.rsqrt(tl.sum(acc, 1)[:, None] / n_cols + eps / (s * s))
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = row_ok & (c < n_cols)
            x = f32(tl.load(x_ptr + at(i0, i1, i2, c, x_s0, x_s1, x_s2, x_sc), mask=mask, other=0.0))
            _scale_store(x / s, r, w_ptr, w_s, c, mask, out_ptr + at(i0, i1, i2, c, o_s0, o_s1, o_s2, o_sc), HAS_WEIGHT)


@triton.jit
def _scale_store(xs, r, w_ptr, w_s, cols, mask, out_ptrs, HAS_WEIGHT: tl.constexpr):
    y = xs * r
    if HAS_WEIGHT:
        y = y * f32(tl.load(w_ptr + cols.to(tl.int64) * w_s, mask=mask, other=0.0))
    tl.store(out_ptrs, narrow(y, out_ptrs.dtype.element_ty), mask=mask)


@impl(spec, "cuda", dtypes=("float32", "float16", "bfloat16"))
def rmsnorm(x: torch.Tensor, weight, eps: float) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    lay, (x,) = rows_layout([x], out)
    cfg = row_config(lay.n_rows, lay.n_cols)
    w, w_s = (weight, weight.stride(0)) if weight is not None else (x, 0)
    _rmsnorm_kernel[(cdiv(lay.n_rows, cfg.block_m),)](
        x, w, out, lay.n_rows, lay.n_cols, lay.sizes[1], lay.sizes[2], *lay.args(0), *lay.args(1), w_s, eps,
        HAS_WEIGHT=weight is not None, **cfg.meta, num_warps=cfg.num_warps,
    )
    return out
