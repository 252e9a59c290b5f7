"""layernorm in Triton: centred float32 statistics of power-of-two-scaled rows, whole rows or three passes. Its
backward recomputes them (in float64 for float32 inputs) and sums dweight and dbias without atomics."""

import torch

from opport.backends.cuda._launch import (
    at,
    bwd_row_config,
    cdiv,
    f32,
    is_finite,
    lead_index,
    narrow,
    partial_programs,
    pow2_scale,
    row_config,
    rows_layout,
    sum_partials,
    tl,
    triton,
)
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
    Notes: statistics are of x shifted by its row's first element x0 (docs/numerics.md 3.8): x/s - x0/s
    is exact for x within a factor of 2 of x0 (Sterbenz) and for constant rows, and otherwise errs by
    <= u |x - x0| / s <= 2u D / s (D = max|x - mean|), so the centred values err by <= (2k + 6) u D / s
    whatever |mean| (k = log2(n) for whole rows' tree sums, n / BLOCK_N + log2(BLOCK_N) chunked); a plain
    float32 mean would be off by up to u |mean| / 2 (0.03 at 1e6). Then two-pass: the variance is the
    mean of squared deviations (no E[x^2] - E[x]^2 cancellation). Rows are divided by s, a power of two near max|x| when that is
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


@impl(spec, "cuda")
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


# --------------------------------------------------------------------------- backward


@triton.jit
def _layernorm_bwd_kernel(
    # pointers
    g_ptr, x_ptr, w_ptr, dx_ptr, pw_ptr, pb_ptr,
    # shapes, strides
    n_rows, n_cols, n1, n2,
    g_s0, g_s1, g_s2, g_sc,
    x_s0, x_s1, x_s2, x_sc,
    d_s0, d_s1, d_s2, d_sc,
    w_s, eps,
    # meta-parameters
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, TWO_COLS: tl.constexpr, WIDE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr,
):
    """dx = (gw - mean(gw) - xhat mean(gw xhat)) / std per row, gw = grad * w; dweight, dbias partials.

    Dimensions: grad, x, dx [n_rows, n_cols] strided views; w [n_cols]; pw, pb [programs, n_cols] in the
    compute dtype.
    Notes: a fixed grid of programs, each taking row tiles pid, pid + programs, ...; its sums of grad * xhat and
    grad over them go to row pid of pw and pb (no atomics: the same bits every run). The statistics are the
    forward's, recomputed from x: rows shifted by their first element and divided by s, a power of two near
    max|x| (exact), two-pass variance, eps / s^2 (floored at FLT_MIN) for eps. WIDE (float32 inputs) computes in
    float64: the bracket cancels O(|g|) terms down to elements ~1000x smaller and is then multiplied by up to
    1/sqrt(eps), where float32's roundings of mean(gw), xhat and their products (~5e-8 absolute) exceed the
    1e-5 / std an element near 0 allows (the cpu kernel measured it). 16-bit inputs compute in float32, with grad
    divided by its row's power of two near max|grad| (dx is linear in it), so that grad * w and the row sums do
    not overflow float32 for finite grads near the 16-bit maximum (`_grad_scale`). SINGLE holds whole rows in
    registers (one read of grad and x); otherwise three passes over L2-resident chunks (`_layernorm_bwd_chunked`).
    Pseudocode: c = (x - x0) / s; d = c - mean(c); r = rsqrt(mean(d^2) + eps'); xhat = d r; gw = grad / sg * w;
                dx = (gw - mean(gw) - xhat mean(gw xhat)) r / s * sg; pw[pid] += sum(grad xhat); pb[pid] += sum(grad)
    """
    CT: tl.constexpr = tl.float64 if WIDE else tl.float32
    pid = tl.program_id(0)
    part = pid.to(tl.int64) * n_cols
    if SINGLE:
        cols = tl.arange(0, BLOCK_N)
        w = _weight(w_ptr, w_s, cols[None, :], cols[None, :] < n_cols, HAS_WEIGHT).to(CT)
        dw = tl.zeros((BLOCK_N,), CT)
        db = tl.zeros((BLOCK_N,), CT)
        for tile in range(pid, tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0)):
            gc, xhat = _layernorm_bwd_rows(g_ptr, x_ptr, w, dx_ptr, tile, n_rows, n_cols, n1, n2, g_s0, g_s1, g_s2, g_sc,
                                           x_s0, x_s1, x_s2, x_sc, d_s0, d_s1, d_s2, d_sc, eps,
                                           TWO_COLS, WIDE, BLOCK_M, BLOCK_N)
            dw += tl.sum(gc * xhat, 0)
            db += tl.sum(gc, 0)
        if HAS_WEIGHT:
            tl.store(pw_ptr + part + cols, dw, mask=cols < n_cols)
        if HAS_BIAS:
            tl.store(pb_ptr + part + cols, db, mask=cols < n_cols)
    else:
        for tile in range(pid, tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0)):
            _layernorm_bwd_chunked(g_ptr, x_ptr, w_ptr, dx_ptr, pw_ptr + part, pb_ptr + part, tile, n_rows, n_cols, n1, n2,
                                   g_s0, g_s1, g_s2, g_sc, x_s0, x_s1, x_s2, x_sc, d_s0, d_s1, d_s2, d_sc, w_s, eps,
                                   HAS_WEIGHT, HAS_BIAS, WIDE, BLOCK_M, BLOCK_N)


@triton.jit
def _layernorm_bwd_rows(g_ptr, x_ptr, w, dx_ptr, tile, n_rows, n_cols, n1, n2, g_s0, g_s1, g_s2, g_sc,
                        x_s0, x_s1, x_s2, x_sc, d_s0, d_s1, d_s2, d_sc, eps,
                        TWO_COLS: tl.constexpr, WIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dx of one tile of whole rows (see the kernel); returns grad and xhat in the compute dtype (0 where masked).
    TWO_COLS: xhat = (h, -h), and the bracket is (gw - mean(gw)) (1 - h^2) = (gw - mean(gw)) eps' r^2 exactly;
    the general form cancels to noise (1 - h^2 ~ eps / var)."""
    CT: tl.constexpr = tl.float64 if WIDE else tl.float32
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = (rows < n_rows)[:, None]
    i0, i1, i2 = lead_index(rows, n1, n2)
    i0, i1, i2 = i0[:, None], i1[:, None], i2[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    mask = row_ok & (cols < n_cols)
    g = f32(tl.load(g_ptr + at(i0, i1, i2, cols, g_s0, g_s1, g_s2, g_sc), mask=mask, other=0.0))
    x = f32(tl.load(x_ptr + at(i0, i1, i2, cols, x_s0, x_s1, x_s2, x_sc), mask=mask, other=0.0))
    x0 = f32(tl.load(x_ptr + i0 * x_s0 + i1 * x_s1 + i2 * x_s2, mask=row_ok, other=0.0)).to(CT)
    s = pow2_scale(tl.max(tl.abs(x), 1))[:, None].to(CT)
    c = tl.where(mask, x.to(CT) / s - x0 / s, 0.0)
    d = tl.where(mask, c - tl.sum(c, 1)[:, None] / n_cols, 0.0)
    eps_s = tl.maximum(eps / (s * s), FLT_MIN)
    r = _rsqrt(tl.sum(d * d, 1)[:, None] / n_cols + eps_s)
    xhat = d * r
    sg = _grad_scale(g, WIDE)
    gw = (g.to(CT) / sg) * w
    b = gw - tl.sum(gw, 1)[:, None] / n_cols
    if TWO_COLS:
        b = b * eps_s * r * r
    else:
        b = b - xhat * (tl.sum(gw * xhat, 1)[:, None] / n_cols)
    dx = ((b * (r / s)) * sg).to(tl.float32)
    tl.store(dx_ptr + at(i0, i1, i2, cols, d_s0, d_s1, d_s2, d_sc), narrow(dx, dx_ptr.dtype.element_ty), mask=mask)
    return g.to(CT), xhat


@triton.jit
def _layernorm_bwd_chunked(g_ptr, x_ptr, w_ptr, dx_ptr, pw_ptr, pb_ptr, tile, n_rows, n_cols, n1, n2,
                           g_s0, g_s1, g_s2, g_sc, x_s0, x_s1, x_s2, x_sc, d_s0, d_s1, d_s2, d_sc, w_s, eps,
                           HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, WIDE: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One row tile of rows longer than a chunk, in three passes: (1) the running scales s (of x) and sg (of grad),
    the shifted sum of x and the sum of gw, each rescaled when its scale grows (by an exact power of two);
    (2) the sums of squared deviations and of gw d; (3) dx, and each chunk's sums of grad xhat and grad added
    into this program's partial rows pw, pb."""
    CT: tl.constexpr = tl.float64 if WIDE else tl.float32
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = (rows < n_rows)[:, None]
    i0, i1, i2 = lead_index(rows, n1, n2)
    i0, i1, i2 = i0[:, None], i1[:, None], i2[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    x0 = f32(tl.load(x_ptr + i0 * x_s0 + i1 * x_s1 + i2 * x_s2, mask=row_ok, other=0.0)).to(CT)
    s = tl.full((BLOCK_M, 1), 1.0, CT)
    sg = tl.full((BLOCK_M, 1), 1.0, CT)
    c_sum = tl.zeros((BLOCK_M, 1), CT)
    gw_sum = tl.zeros((BLOCK_M, 1), CT)
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        mask = row_ok & (c < n_cols)
        g = f32(tl.load(g_ptr + at(i0, i1, i2, c, g_s0, g_s1, g_s2, g_sc), mask=mask, other=0.0))
        x = f32(tl.load(x_ptr + at(i0, i1, i2, c, x_s0, x_s1, x_s2, x_sc), mask=mask, other=0.0))
        s_new = tl.maximum(s, pow2_scale(tl.max(tl.abs(x), 1))[:, None].to(CT))
        sg_new = tl.maximum(sg, _grad_scale(g, WIDE))
        c_sum = c_sum * (s / s_new) + tl.sum(tl.where(mask, x.to(CT) / s_new - x0 / s_new, 0.0), 1)[:, None]
        gw = (g.to(CT) / sg_new) * _weight(w_ptr, w_s, c, mask, HAS_WEIGHT).to(CT)
        gw_sum = gw_sum * (sg / sg_new) + tl.sum(gw, 1)[:, None]
        s = s_new
        sg = sg_new
    mean = c_sum / n_cols
    var_sum = tl.zeros((BLOCK_M, 1), CT)
    gwd_sum = tl.zeros((BLOCK_M, 1), CT)
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        mask = row_ok & (c < n_cols)
        g = f32(tl.load(g_ptr + at(i0, i1, i2, c, g_s0, g_s1, g_s2, g_sc), mask=mask, other=0.0))
        x = f32(tl.load(x_ptr + at(i0, i1, i2, c, x_s0, x_s1, x_s2, x_sc), mask=mask, other=0.0))
        d = tl.where(mask, (x.to(CT) / s - x0 / s) - mean, 0.0)
        var_sum += tl.sum(d * d, 1)[:, None]
        gwd_sum += tl.sum((g.to(CT) / sg) * _weight(w_ptr, w_s, c, mask, HAS_WEIGHT).to(CT) * d, 1)[:, None]
    r = _rsqrt(var_sum / n_cols + tl.maximum(eps / (s * s), FLT_MIN))
    mean_gw = gw_sum / n_cols
    mean_gwx = gwd_sum * r / n_cols
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        mask = row_ok & (c < n_cols)
        g = f32(tl.load(g_ptr + at(i0, i1, i2, c, g_s0, g_s1, g_s2, g_sc), mask=mask, other=0.0)).to(CT)
        x = f32(tl.load(x_ptr + at(i0, i1, i2, c, x_s0, x_s1, x_s2, x_sc), mask=mask, other=0.0))
        xhat = tl.where(mask, (x.to(CT) / s - x0 / s) - mean, 0.0) * r
        gw = (g / sg) * _weight(w_ptr, w_s, c, mask, HAS_WEIGHT).to(CT)
        dx = ((((gw - mean_gw) - xhat * mean_gwx) * (r / s)) * sg).to(tl.float32)
        tl.store(dx_ptr + at(i0, i1, i2, c, d_s0, d_s1, d_s2, d_sc), narrow(dx, dx_ptr.dtype.element_ty), mask=mask)
        col_ok = start + tl.arange(0, BLOCK_N) < n_cols
        if HAS_WEIGHT:
            p = pw_ptr + start + tl.arange(0, BLOCK_N)
            tl.store(p, tl.load(p, mask=col_ok, other=0.0) + tl.sum(g * xhat, 0), mask=col_ok)
        if HAS_BIAS:
            p = pb_ptr + start + tl.arange(0, BLOCK_N)
            tl.store(p, tl.load(p, mask=col_ok, other=0.0) + tl.sum(g, 0), mask=col_ok)


@triton.jit
def _grad_scale(g, WIDE: tl.constexpr):
    """Per row, the power of two near the largest finite |grad| that grad is divided by (16-bit inputs; 1 in float64,
    WIDE). Its finite values then never overflow where the reference's float64 ones do not: an inf in the row
    gives the reference's pattern of inf and NaN, not more of them."""
    if WIDE:
        return tl.full((g.shape[0], 1), 1.0, tl.float64)
    else:
        return pow2_scale(tl.max(tl.where(is_finite(g), tl.abs(g), 0.0), 1))[:, None]


@triton.jit
def _weight(w_ptr, w_s, cols, mask, HAS_WEIGHT: tl.constexpr):
    """The weight at `cols` in float32 (masked columns 0), or 1.0 without one."""
    if HAS_WEIGHT:
        return f32(tl.load(w_ptr + cols.to(tl.int64) * w_s, mask=mask, other=0.0))
    else:
        return tl.full((1, 1), 1.0, tl.float32)


@triton.jit
def _rsqrt(v):
    """1 / sqrt(v): tl.rsqrt in float32; in float64, IEEE sqrt and division (there is no accurate float64 rsqrt)."""
    if v.dtype == tl.float64:
        return 1.0 / tl.sqrt(v)
    else:
        return tl.rsqrt(v)


@impl(spec.backward_op, "cuda")
def layernorm_backward(grad: torch.Tensor, x: torch.Tensor, weight, bias, eps: float):
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    wide = x.dtype == torch.float32
    dw = None if weight is None else torch.zeros(x.shape[-1], dtype=weight.dtype, device=x.device)
    db = None if bias is None else torch.zeros(x.shape[-1], dtype=bias.dtype, device=x.device)
    if dx.numel() == 0:
        return dx, dw, db  # dweight, dbias: sums over no rows
    lay, (grad, x) = rows_layout([grad, x], dx)
    cfg = bwd_row_config(lay.n_rows, lay.n_cols, wide, spread=8 if wide else 2)  # float64 4 x 512 tiles spilled at 8 warps
    programs = partial_programs(cdiv(lay.n_rows, cfg.block_m), x.device)
    # chunked rows add into their program's partial rows, whole rows write them once
    new = torch.empty if cfg.single else torch.zeros
    acc = torch.float64 if wide else torch.float32
    pw = new((programs, lay.n_cols) if weight is not None else (1, 1), dtype=acc, device=x.device)
    pb = new((programs, lay.n_cols) if bias is not None else (1, 1), dtype=acc, device=x.device)
    w, w_s = (weight, weight.stride(0)) if weight is not None else (x, 0)
    _layernorm_bwd_kernel[(programs,)](
        grad, x, w, dx, pw, pb, lay.n_rows, lay.n_cols, lay.sizes[1], lay.sizes[2], *lay.args(0), *lay.args(1),
        *lay.args(2), w_s, eps, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, TWO_COLS=lay.n_cols == 2,
        WIDE=wide, **cfg.meta, num_warps=cfg.num_warps,
    )
    if weight is not None:
        sum_partials(pw, dw)
    if bias is not None:
        sum_partials(pb, db)
    return dx, dw, db
