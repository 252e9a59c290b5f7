"""layernorm in Triton: centred float32 statistics of power-of-two-scaled rows, whole rows or three passes."""

import torch

from opport.backends.cuda._launch import at, cdiv, f32, lead_index, narrow, pow2_scale, row_config, rows_layout, tl, triton
from opport.dispatch import impl
from opport.ops.layernorm import layernorm as spec

FLT_MIN = tl.constexpr(1.1754943508222875e-38)  # floor for eps / s**2, so a constant row stays 0 / sqrt(eps') = 0, never 0 / 0


@triton.jit
def _layernorm_kernel(
    # pointers
    x_ptr, w_ptr, b_ptr, out_ptr,
    # shapes, strides
    n_rows, n_cols, n1, n2,
    x_s0, x_s1, x_s2, x_sc,
    o_s0, o_s1, o_s2, o_sc,
    w_s, b_s, eps,
    # meta-parameters
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr,
):
    """y = (x - mean) / sqrt(var + eps) * w + b over each row, population variance.

    Dimensions: x, out [n_rows, n_cols] strided views; w, b [n_cols].
    Notes: statistics are of x shifted by its row's first element x0 (exact for constant rows, and
    no loss when mean >> std), then two-pass: the variance is the mean of squared deviations (no
    E[x^2] - E[x]^2 cancellation). Rows are divided by s, a power of two near max|x| when that is
    >= 2 (exact), with eps / s**2 in place of eps: layernorm is scale invariant, and float32 squares
    then never overflow. SINGLE keeps the row in registers (one read); otherwise three passes over
    L2-resident chunks: running s and shifted sum (rescaled when s grows), squared deviations, output.
    Pseudocode: c = (x - x0) / s; d = c - mean(c); out = d * rsqrt(mean(d*d) + max(eps/s**2, FLT_MIN)) * w + b
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = (rows < n_rows)[:, None]
    i0, i1, i2 = lead_index(rows, n1, n2)
    i0, i1, i2 = i0[:, None], i1[:, None], i2[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    x0 = f32(tl.load(x_ptr + i0 * x_s0 + i1 * x_s1 + i2 * x_s2, mask=row_ok, other=0.0))
    if SINGLE:
        mask = row_ok & (cols < n_cols)
        x = f32(tl.load(x_ptr + at(i0, i1, i2, cols, x_s0, x_s1, x_s2, x_sc), mask=mask, other=0.0))
        s = pow2_scale(tl.max(tl.abs(x), 1))[:, None]
        c = tl.where(mask, x / s - x0 / s, 0.0)
        d = tl.where(mask, c - tl.sum(c, 1)[:, None] / n_cols, 0.0)
        r = tl.rsqrt(tl.sum(d * d, 1)[:, None] / n_cols + tl.maximum(eps / (s * s), FLT_MIN))
        _affine_store(d * r, w_ptr, w_s, b_ptr, b_s, cols, mask, out_ptr + at(i0, i1, i2, cols, o_s0, o_s1, o_s2, o_sc),
                      HAS_WEIGHT, HAS_BIAS)
    else:
        s = tl.full((BLOCK_M, 1), 1.0, tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            mask = row_ok & (start + cols < n_cols)
            x = f32(tl.load(x_ptr + at(i0, i1, i2, start + cols, x_s0, x_s1, x_s2, x_sc), mask=mask, other=0.0))
            s_new = tl.maximum(s, pow2_scale(tl.max(tl.abs(x), 1))[:, None])
            acc = acc * (s / s_new) + tl.where(mask, x / s_new - x0 / s_new, 0.0)  # s / s_new: an exact power of two
            s = s_new
        mean = tl.sum(acc, 1)[:, None] / n_cols
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            mask = row_ok & (start + cols < n_cols)
            x = f32(tl.load(x_ptr + at(i0, i1, i2, start + cols, x_s0, x_s1, x_s2, x_sc), mask=mask, other=0.0))
            d = tl.where(mask, (x / s - x0 / s) - mean, 0.0)
            acc += d * d
        r = tl.rsqrt(tl.sum(acc, 1)[:, None] / n_cols + tl.maximum(eps / (s * s), FLT_MIN))
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = row_ok & (c < n_cols)
            x = f32(tl.load(x_ptr + at(i0, i1, i2, c, x_s0, x_s1, x_s2, x_sc), mask=mask, other=0.0))
            _affine_store(((x / s - x0 / s) - mean) * r, w_ptr, w_s, b_ptr, b_s, c, mask,
                          out_ptr + at(i0, i1, i2, c, o_s0, o_s1, o_s2, o_sc), HAS_WEIGHT, HAS_BIAS)


@triton.jit
def _affine_store(y, w_ptr, w_s, b_ptr, b_s, cols, mask, out_ptrs, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    c = cols.to(tl.int64)
    if HAS_WEIGHT:
        y = y * f32(tl.load(w_ptr + c * w_s, mask=mask, other=0.0))
    if HAS_BIAS:
        y = y + f32(tl.load(b_ptr + c * b_s, mask=mask, other=0.0))
    tl.store(out_ptrs, narrow(y, out_ptrs.dtype.element_ty), mask=mask)


@impl(spec, "cuda", dtypes=("float32", "float16", "bfloat16"))
def layernorm(x: torch.Tensor, weight, bias, eps: float) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    lay, (x,) = rows_layout([x], out)
    cfg = row_config(lay.n_rows, lay.n_cols)
    w, w_s = (weight, weight.stride(0)) if weight is not None else (x, 0)
    b, b_s = (bias, bias.stride(0)) if bias is not None else (x, 0)
    _layernorm_kernel[(cdiv(lay.n_rows, cfg.block_m),)](
        x, w, b, out, lay.n_rows, lay.n_cols, lay.sizes[1], lay.sizes[2], *lay.args(0), *lay.args(1), w_s, b_s, eps,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, **cfg.meta, num_warps=cfg.num_warps,
    )
    return out
