"""rmsnorm in Triton: one program normalises BLOCK_M rows, statistics in float32. Its backward recomputes them,
and sums dweight without atomics: per-program partial sums, added up in a fixed order (`sum_partials`).

add_rmsnorm (cuda/add_rmsnorm.py) runs the same two kernels with ADD set: the forward adds the residual as it
loads x, writes the sum rounded to the dtype and normalises that rounded sum; the backward adds grad_sum to dx."""

import torch

from opport.backends.cuda._launch import (
    at,
    bwd_row_config,
    cdiv,
    f32,
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
from opport.ops.rmsnorm import rmsnorm as spec


@triton.jit
def _rmsnorm_kernel(
    # pointers
    x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr,
    # shapes, strides
    n_rows, n_cols, n1, n2,
    x_s0, x_s1, x_s2, x_sc,
    r_s0, r_s1, r_s2, r_sc,
    o_s0, o_s1, o_s2, o_sc,
    s_s0, s_s1, s_s2, s_sc,
    w_s, eps, offset,
    # meta-parameters
    HAS_WEIGHT: tl.constexpr, ADD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SINGLE: tl.constexpr,
):
    """y = x / sqrt(mean(x**2) + eps) * (offset + w) over each row (offset + w in float32: rmsnorm's offset, 0 for
    add_rmsnorm); with ADD, x is the sum x + r rounded to the dtype (add_rmsnorm), written to `sum` as well.

    Dimensions: x, r, out, sum [n_rows, n_cols] as strided views (leading dims n0 x n1 x n2); w [n_cols]
    (r and sum unused without ADD).
    Notes: SINGLE keeps the whole row in registers (reads x once); otherwise pass 1 sums squares
    chunk by chunk and pass 2 re-reads (from L2 for rows up to a few MB) to scale. Masked columns
    load 0, neutral for the sum of squares. The squares are taken of x / s, s a power of two near
    max|x| when that is >= 2 (exact scaling), so float32 statistics do not overflow where the float64
    reference does not (|x| > 1.8e19/sqrt(n)); the chunked pass rescales its running sum when a chunk
    raises s, like an online softmax. With ADD the chunked pass 2 recomputes the rounded sum from x and r
    (the same bits) rather than re-reading `sum`, which other threads of the program wrote.
    Pseudocode: for each row: [x = round(x + r); sum = x]; s = pow2_scale(max|x|); r = rsqrt(mean((x/s)**2) + eps/s**2);
                out = (x/s) * r * (offset + w)
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = (rows < n_rows)[:, None]
    i0, i1, i2 = lead_index(rows, n1, n2)
    i0, i1, i2 = i0[:, None], i1[:, None], i2[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    if SINGLE:
        mask = row_ok & (cols < n_cols)
        x = _load_x(x_ptr, r_ptr, sum_ptr, i0, i1, i2, cols, mask, x_s0, x_s1, x_s2, x_sc, r_s0, r_s1, r_s2, r_sc,
                    s_s0, s_s1, s_s2, s_sc, ADD, True)
        s = pow2_scale(tl.max(tl.abs(x), 1))[:, None]
        xs = x / s
        r = tl.rsqrt(tl.sum(xs * xs, 1)[:, None] / n_cols + eps / (s * s))
        _scale_store(xs, r, w_ptr, w_s, offset, cols, mask, out_ptr + at(i0, i1, i2, cols, o_s0, o_s1, o_s2, o_sc),
                     HAS_WEIGHT)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        s = tl.full((BLOCK_M, 1), 1.0, tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            mask = row_ok & (start + cols < n_cols)
            x = _load_x(x_ptr, r_ptr, sum_ptr, i0, i1, i2, start + cols, mask, x_s0, x_s1, x_s2, x_sc,
                        r_s0, r_s1, r_s2, r_sc, s_s0, s_s1, s_s2, s_sc, ADD, True)
            s_new = tl.maximum(s, pow2_scale(tl.max(tl.abs(x), 1))[:, None])
            ratio = s / s_new  # a power of two <= 1: exact rescale of the running sum
            xs = x / s_new
            acc = acc * (ratio * ratio) + xs * xs
            s = s_new
        r = tl.rsqrt(tl.sum(acc, 1)[:, None] / n_cols + eps / (s * s))
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = row_ok & (c < n_cols)
            x = _load_x(x_ptr, r_ptr, sum_ptr, i0, i1, i2, c, mask, x_s0, x_s1, x_s2, x_sc, r_s0, r_s1, r_s2, r_sc,
                        s_s0, s_s1, s_s2, s_sc, ADD, False)
            _scale_store(x / s, r, w_ptr, w_s, offset, c, mask, out_ptr + at(i0, i1, i2, c, o_s0, o_s1, o_s2, o_sc),
                         HAS_WEIGHT)


@triton.jit
def _load_x(x_ptr, r_ptr, sum_ptr, i0, i1, i2, cols, mask, x_s0, x_s1, x_s2, x_sc, r_s0, r_s1, r_s2, r_sc,
            s_s0, s_s1, s_s2, s_sc, ADD: tl.constexpr, STORE: tl.constexpr):
    """x at `cols` in float32 (masked 0); with ADD, x + r rounded to sum's dtype (a float32 add rounded once more
    to 16 bits is the correctly rounded 16-bit sum), stored to `sum` where STORE."""
    x = f32(tl.load(x_ptr + at(i0, i1, i2, cols, x_s0, x_s1, x_s2, x_sc), mask=mask, other=0.0))
    if ADD:
        t = narrow(x + f32(tl.load(r_ptr + at(i0, i1, i2, cols, r_s0, r_s1, r_s2, r_sc), mask=mask, other=0.0)),
                   sum_ptr.dtype.element_ty)
        if STORE:
            tl.store(sum_ptr + at(i0, i1, i2, cols, s_s0, s_s1, s_s2, s_sc), t, mask=mask)
        x = f32(t)
    return x


@triton.jit
def _scale_store(xs, r, w_ptr, w_s, offset, cols, mask, out_ptrs, HAS_WEIGHT: tl.constexpr):
    y = xs * r
    if HAS_WEIGHT:
        y = y * (offset + f32(tl.load(w_ptr + cols.to(tl.int64) * w_s, mask=mask, other=0.0)))
    tl.store(out_ptrs, narrow(y, out_ptrs.dtype.element_ty), mask=mask)


@impl(spec, "cuda")
def rmsnorm(x: torch.Tensor, weight, eps: float, offset: float = 0.0) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    return launch_forward(x, None, weight, eps, out, None, offset)


def launch_forward(x, residual, weight, eps: float, out, total, offset: float = 0.0):
    """The forward kernel on non-empty rows: rmsnorm of x into out, or (residual given) add_rmsnorm: the rounded
    sum x + residual into `total` and its rmsnorm into out. The scale is offset + weight (rmsnorm's offset)."""
    add = residual is not None
    lay, ins = rows_layout([x, residual] if add else [x], out)  # total: allocated like out, so out's strides
    x, r = ins if add else (ins[0], ins[0])
    cfg = row_config(lay.n_rows, lay.n_cols)
    w, w_s = (weight, weight.stride(0)) if weight is not None else (x, 0)
    strides = (lay.args(0), lay.args(1), lay.args(2), lay.args(2)) if add else (lay.args(0), (0,) * 4, lay.args(1), (0,) * 4)
    _rmsnorm_kernel[(cdiv(lay.n_rows, cfg.block_m),)](
        x, r, w, out, total if add else out, lay.n_rows, lay.n_cols, lay.sizes[1], lay.sizes[2],
        *(v for st in strides for v in st), w_s, eps, float(offset),
        HAS_WEIGHT=weight is not None, ADD=add, **cfg.meta, num_warps=cfg.num_warps,
    )
    return out


# --------------------------------------------------------------------------- backward


@triton.jit
def _rmsnorm_bwd_kernel(
    # pointers
    g_ptr, h_ptr, x_ptr, w_ptr, dx_ptr, part_ptr,
    # shapes, strides
    n_rows, n_cols, n1, n2,
    g_s0, g_s1, g_s2, g_sc,
    h_s0, h_s1, h_s2, h_sc,
    x_s0, x_s1, x_s2, x_sc,
    d_s0, d_s1, d_s2, d_sc,
    w_s, eps, offset,
    # meta-parameters
    HAS_WEIGHT: tl.constexpr, ONE_COL: tl.constexpr, ADD: tl.constexpr, WIDE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, SINGLE: tl.constexpr,
):
    """dx = r (gw - xhat mean(gw xhat)) per row, gw = grad * (offset + w), xhat = x r, r = 1/rms(x); dweight partials
    (sum of grad * xhat: the offset does not enter them).
    With ADD (add_rmsnorm: x is the saved sum, grad is grad_normed) dx += h, the sum output's gradient.
    WIDE (add_rmsnorm's float32 inputs) computes in float64, statistics, partials and all: dx + h cancels where
    the sum is small (x ~ -residual), leaving dx ~100x smaller than the norm's term, whose float32 roundings
    (~1e-7 of it) then exceed dx's float32 tolerance (measured: 6.4e-5 against 1.2e-5 allowed).

    Dimensions: grad, h, x, dx [n_rows, n_cols] strided views (h unused without ADD); w [n_cols];
    part [programs, n_cols] float32.
    Notes: a fixed grid of programs, each taking row tiles pid, pid + programs, ...; its sum of grad * xhat over
    them goes to row pid of `part` (no atomics: the same bits every run). r is recomputed from x (the saved
    tensors are the inputs), of x / s with s the forward's power of two near max|x| (exact), so float32 squares
    do not overflow. SINGLE holds whole rows in registers (one read of grad and x) and the program's dweight
    partial too; otherwise pass 1 sums squares and gw * x chunk by chunk (rescaled when s grows, as the
    forward's), pass 2 re-reads to write dx and adds each chunk's dweight sum into the program's partial row.
    ONE_COL: a one-element row's bracket is gw eps r^2 exactly (the general form cancels to float32 noise).
    Pseudocode: s = pow2_scale(max|x|); r = rsqrt(mean((x/s)^2) + eps/s^2); xhat = (x/s) r;
                dx = (gw - xhat mean(gw xhat)) r / s; part[pid] += sum over rows of grad * xhat
    """
    CT: tl.constexpr = tl.float64 if WIDE else tl.float32
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)[None, :]
    if SINGLE:
        w = _weight(w_ptr, w_s, offset, cols, cols < n_cols, HAS_WEIGHT, CT)
        dw = tl.zeros((BLOCK_M, BLOCK_N), CT)
        for tile in range(pid, tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0)):
            rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            i0, i1, i2 = lead_index(rows, n1, n2)
            i0, i1, i2 = i0[:, None], i1[:, None], i2[:, None]
            mask = (rows < n_rows)[:, None] & (cols < n_cols)
            g = f32(tl.load(g_ptr + at(i0, i1, i2, cols, g_s0, g_s1, g_s2, g_sc), mask=mask, other=0.0))
            x = f32(tl.load(x_ptr + at(i0, i1, i2, cols, x_s0, x_s1, x_s2, x_sc), mask=mask, other=0.0))
            s = pow2_scale(tl.max(tl.abs(x), 1))[:, None].to(CT)
            g, x = g.to(CT), x.to(CT)
            xs = x / s
            eps_s = eps / (s * s)
            r = _rsqrt(tl.sum(xs * xs, 1)[:, None] / n_cols + eps_s)
            xhat = xs * r
            dw += g * xhat
            gw = g * w
            dx = _bracket(gw, x, xhat, tl.sum(gw * xhat, 1)[:, None] / n_cols, eps_s, r, ONE_COL) * (r / s)
            if ADD:
                dx += f32(tl.load(h_ptr + at(i0, i1, i2, cols, h_s0, h_s1, h_s2, h_sc), mask=mask, other=0.0)).to(CT)
            dx = dx.to(tl.float32)
            tl.store(dx_ptr + at(i0, i1, i2, cols, d_s0, d_s1, d_s2, d_sc), narrow(dx, dx_ptr.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:
            tl.store(part_ptr + pid.to(tl.int64) * n_cols + cols, tl.sum(dw, 0)[None, :], mask=cols < n_cols)
    else:
        for tile in range(pid, tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0)):
            _rmsnorm_bwd_chunked(g_ptr, h_ptr, x_ptr, w_ptr, dx_ptr, part_ptr + pid.to(tl.int64) * n_cols, tile, n_rows,
                                 n_cols, n1, n2, g_s0, g_s1, g_s2, g_sc, h_s0, h_s1, h_s2, h_sc, x_s0, x_s1, x_s2, x_sc,
                                 d_s0, d_s1, d_s2, d_sc, w_s, eps, offset, HAS_WEIGHT, ADD, WIDE, BLOCK_M, BLOCK_N)


@triton.jit
def _rmsnorm_bwd_chunked(g_ptr, h_ptr, x_ptr, w_ptr, dx_ptr, part_ptr, tile, n_rows, n_cols, n1, n2,
                         g_s0, g_s1, g_s2, g_sc, h_s0, h_s1, h_s2, h_sc, x_s0, x_s1, x_s2, x_sc, d_s0, d_s1, d_s2, d_sc,
                         w_s, eps, offset, HAS_WEIGHT: tl.constexpr, ADD: tl.constexpr, WIDE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One row tile of rows longer than a chunk: two passes over L2-resident chunks (see the kernel)."""
    CT: tl.constexpr = tl.float64 if WIDE else tl.float32
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = (rows < n_rows)[:, None]
    i0, i1, i2 = lead_index(rows, n1, n2)
    i0, i1, i2 = i0[:, None], i1[:, None], i2[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    ss = tl.zeros((BLOCK_M, 1), CT)  # per-row sums, not [BLOCK_M, BLOCK_N] tiles: 16K-column chunks spilled
    gx = tl.zeros((BLOCK_M, 1), CT)
    s = tl.full((BLOCK_M, 1), 1.0, CT)
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        mask = row_ok & (c < n_cols)
        g = f32(tl.load(g_ptr + at(i0, i1, i2, c, g_s0, g_s1, g_s2, g_sc), mask=mask, other=0.0))
        x = f32(tl.load(x_ptr + at(i0, i1, i2, c, x_s0, x_s1, x_s2, x_sc), mask=mask, other=0.0))
        s_new = tl.maximum(s, pow2_scale(tl.max(tl.abs(x), 1))[:, None].to(CT))
        ratio = s / s_new  # a power of two <= 1: exact rescale of the running sums
        xs = x.to(CT) / s_new
        ss = ss * (ratio * ratio) + tl.sum(xs * xs, 1)[:, None]
        gx = gx * ratio + tl.sum(g.to(CT) * _weight(w_ptr, w_s, offset, c, mask, HAS_WEIGHT, CT) * xs, 1)[:, None]
        s = s_new
    r = _rsqrt(ss / n_cols + eps / (s * s))
    mean_gx = gx * r / n_cols  # mean(gw xhat)
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        mask = row_ok & (c < n_cols)
        g = f32(tl.load(g_ptr + at(i0, i1, i2, c, g_s0, g_s1, g_s2, g_sc), mask=mask, other=0.0))
        x = f32(tl.load(x_ptr + at(i0, i1, i2, c, x_s0, x_s1, x_s2, x_sc), mask=mask, other=0.0)).to(CT)
        g = g.to(CT)
        xhat = (x / s) * r
        dx = (g * _weight(w_ptr, w_s, offset, c, mask, HAS_WEIGHT, CT) - xhat * mean_gx) * (r / s)
        if ADD:
            dx += f32(tl.load(h_ptr + at(i0, i1, i2, c, h_s0, h_s1, h_s2, h_sc), mask=mask, other=0.0)).to(CT)
        dx = dx.to(tl.float32)
        tl.store(dx_ptr + at(i0, i1, i2, c, d_s0, d_s1, d_s2, d_sc), narrow(dx, dx_ptr.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:
            col_ok = start + tl.arange(0, BLOCK_N) < n_cols
            p = part_ptr + start + tl.arange(0, BLOCK_N)
            tl.store(p, tl.load(p, mask=col_ok, other=0.0) + tl.sum(g * xhat, 0), mask=col_ok)


@triton.jit
def _rsqrt(v):
    """1 / sqrt(v): tl.rsqrt in float32; in float64, IEEE sqrt and division (there is no accurate float64 rsqrt)."""
    if v.dtype == tl.float64:
        return 1.0 / tl.sqrt(v)
    else:
        return tl.rsqrt(v)


@triton.jit
def _weight(w_ptr, w_s, offset, cols, mask, HAS_WEIGHT: tl.constexpr, CT: tl.constexpr = tl.float32):
    """offset + the weight at `cols`, in float32 or CT (masked columns offset: their gradient terms are 0), or 1.0
    without one."""
    if HAS_WEIGHT:
        return offset + f32(tl.load(w_ptr + cols.to(tl.int64) * w_s, mask=mask, other=0.0)).to(CT)
    else:
        return 1.0


@triton.jit
def _bracket(gw, x, xhat, mean_gx, eps_s, r, ONE_COL: tl.constexpr):
    """gw - xhat mean(gw xhat); for one-element rows gw (1 - xhat^2) = gw eps_s r^2 exactly, + x * 0 for the NaN
    of a non-finite x (the general form would cancel to ~6e-8 x^2 / eps relative)."""
    if ONE_COL:
        return gw * eps_s * r * r + x * 0.0
    else:
        return gw - xhat * mean_gx


@impl(spec.backward_op, "cuda")
def rmsnorm_backward(grad: torch.Tensor, x: torch.Tensor, weight, eps: float, offset: float = 0.0):
    return launch_backward(grad, None, x, weight, eps, offset)


def launch_backward(grad, grad_sum, x, weight, eps: float, offset: float = 0.0):
    """(dx, dweight) of rmsnorm at x, scaled by offset + weight; with grad_sum (add_rmsnorm: x is the saved sum)
    dx + grad_sum."""
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dw = None if weight is None else torch.zeros(x.shape[-1], dtype=weight.dtype, device=x.device)
    if dx.numel() == 0:
        return dx, dw  # dweight: a sum over no rows
    add = grad_sum is not None
    lay, ins = rows_layout([grad, grad_sum, x] if add else [grad, x], dx)
    grad, h, x = ins if add else (ins[0], ins[0], ins[1])
    strides = [lay.args(i) for i in range(4)] if add else [lay.args(0), (0,) * 4, lay.args(1), lay.args(2)]
    wide = add and x.dtype == torch.float32
    cfg = bwd_row_config(lay.n_rows, lay.n_cols, wide, spread=8 if wide else 2)  # as layernorm's float64 backward
    programs = partial_programs(cdiv(lay.n_rows, cfg.block_m), x.device)
    # chunked rows add into their program's partial row, whole rows write it once
    part = (torch.empty if cfg.single else torch.zeros)((programs, lay.n_cols) if weight is not None else (1, 1),
                                                        dtype=torch.float64 if wide else torch.float32, device=x.device)
    w, w_s = (weight, weight.stride(0)) if weight is not None else (x, 0)
    _rmsnorm_bwd_kernel[(programs,)](
        grad, h, x, w, dx, part, lay.n_rows, lay.n_cols, lay.sizes[1], lay.sizes[2], *(v for st in strides for v in st),
        w_s, eps, float(offset), HAS_WEIGHT=weight is not None, ONE_COL=lay.n_cols == 1, ADD=add, WIDE=wide, **cfg.meta,
        num_warps=cfg.num_warps,
    )
    if weight is not None:
        sum_partials(part, dw)
    return dx, dw
