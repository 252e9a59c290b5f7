"""quantize_fp8 in Triton: per-group amax over finite |x|, a float32 scale, the saturated quotient cast to fp8.

A group is `group_w` consecutive columns of one row (a block, or the whole row for per-token scaling); one
program takes BLOCK_M rows of one group. Per-tensor scaling reduces in three launches of the same kernel:
each row's amax, the rows' amax, then the quantisation, which turns that amax into the scale.

fp8 in the interpreter: Triton 3.6's interpreter rounds float32 -> float8e4nv with ties away from zero, gets
e4m3 subnormals wrong and turns NaN into the e4m3 pattern 0x7C, so there the codes are made by exact bit
arithmetic (`fp8_bits`, round-to-nearest-even) and stored through a uint8 view; compiled kernels use the
hardware conversion (cvt.rn, after the clamp). docs/cuda.md lists both.
"""

import torch

from opport.arraymath import FP8_MAX, SCALE_FLOOR, scales_shape
from opport.backends.cuda._launch import (
    INTERPRET,
    INTERPRETED,
    at,
    cdiv,
    f32,
    is_finite,
    lead_index,
    next_pow2,
    rows_layout,
    tl,
    triton,
)
from opport.dispatch import impl
from opport.ops.quantize_fp8 import quantize_fp8 as spec

# (mantissa bits, exponent bias, NaN code) of each format: what the interpreter's bit path needs
FORMAT = {"float8_e4m3fn": (3, 7, 0x7F), "float8_e5m2": (2, 15, 0x7E)}
# the kernel's stages (see its docstring); constexpr so that jit code may read them
AMAX, DYNAMIC, FROM_AMAX, STATIC = (tl.constexpr(i) for i in range(4))
SCALE_MIN = tl.constexpr(SCALE_FLOOR)  # float32's smallest normal: the scale of an all-zero group
TILE = 1 << 16 if INTERPRET else 4096  # elements per program: interpreter ops amortise; a GPU keeps loads in flight


@triton.jit
def fp8_bits(v, MANT: tl.constexpr, BIAS: tl.constexpr, NAN_CODE: tl.constexpr, SUB_SCALE: tl.constexpr):
    """The fp8 code (uint8) of float32 v, |v| <= the format's max or NaN: round-to-nearest-even by integer
    arithmetic on v's bits (normal range) or by the 2^23 trick on v scaled to subnormal units (exact)."""
    b = v.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    shift: tl.constexpr = 23 - MANT
    normal = ((a + ((1 << (shift - 1)) - 1) + ((a >> shift) & 1)) >> shift) - ((127 - BIAS) << MANT)
    tiny = a < ((128 - BIAS) << 23)  # below the format's smallest normal
    t = tl.where(tiny, tl.abs(v), 0.0) * SUB_SCALE  # others (NaN included) to 0: the int cast stays in range
    sub = ((t + 8388608.0) - 8388608.0).to(tl.int32)
    mag = tl.where(tiny, sub, normal)
    mag = tl.where(v != v, NAN_CODE, mag)
    return (sign | mag).to(tl.uint8)


@triton.jit
def _quantize_fp8_kernel(
    # pointers
    x_ptr, q_ptr, a_ptr, s_ptr,
    # shapes, strides
    n_rows, n_cols, n1, n2, x_s0, x_s1, x_s2, x_sc, q_s0, q_s1, q_s2, q_sc,
    a_row, a_grp, s_row, s_grp, group_w, fmax, static_scale,
    # meta-parameters
    STAGE: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, NAN_CODE: tl.constexpr, SUB_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Quantise BLOCK_M rows of one column group (program axis 1) to fp8.

    Dimensions: x, q [n_rows, n_cols] as strided views (leading dims n0 x n1 x n2); groups of `group_w`
    columns; per-group values at `a_ptr` / `s_ptr` + row * row stride + group * group stride.
    Args: STAGE AMAX writes each group's amax to a_ptr (no q); DYNAMIC computes amax, writes the scale and q;
    FROM_AMAX reads the amax at a_ptr (strides 0: per tensor) and writes q, program (0, 0) writes the scale;
    STATIC divides by `static_scale`.
    Returns: q (and scales or amax) through the pointers.
    Notes: amax ignores NaN and ±inf; scale = max(amax / fmax, 2^-126) so an all-zero group gets a finite
    scale. A group wider than BLOCK_N is read twice (amax loop, then quantise loop), from L2 at LLM row sizes.
    Pseudocode: amax = max(|x| finite); s = max(amax / fmax, 2^-126); q = fp8(clamp(x / s, -fmax, fmax))
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    row_ok = rows < n_rows
    i0, i1, i2 = lead_index(rows, n1, n2)
    i0, i1, i2 = i0[:, None], i1[:, None], i2[:, None]
    lanes = tl.arange(0, BLOCK_N)
    r64 = rows.to(tl.int64)
    if STAGE == AMAX or STAGE == DYNAMIC:
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for c in range(0, group_w, BLOCK_N):
            cols = (g * group_w + c + lanes)[None, :]
            mask = row_ok[:, None] & ((c + lanes) < group_w)[None, :]
            x = f32(tl.load(x_ptr + at(i0, i1, i2, cols, x_s0, x_s1, x_s2, x_sc), mask=mask, other=0.0))
            amax = tl.maximum(amax, tl.max(tl.where(is_finite(x), tl.abs(x), 0.0), 1))
        if STAGE == AMAX:
            tl.store(a_ptr + r64 * a_row + g * a_grp, amax, mask=row_ok)
        else:
            s = tl.maximum(amax / fmax, SCALE_MIN)
            tl.store(s_ptr + r64 * s_row + g * s_grp, s, mask=row_ok)
    elif STAGE == FROM_AMAX:
        s = tl.maximum(tl.load(a_ptr + r64 * a_row + g * a_grp, mask=row_ok, other=0.0) / fmax, SCALE_MIN)
        tl.store(s_ptr + r64 * s_row + g * s_grp, s, mask=row_ok & (rows == 0) & (g == 0))
    else:
        s = tl.zeros([BLOCK_M], dtype=tl.float32) + static_scale
    if STAGE != AMAX:
        for c in range(0, group_w, BLOCK_N):
            cols = (g * group_w + c + lanes)[None, :]
            mask = row_ok[:, None] & ((c + lanes) < group_w)[None, :]
            x = f32(tl.load(x_ptr + at(i0, i1, i2, cols, x_s0, x_s1, x_s2, x_sc), mask=mask, other=0.0))
            v = x / s[:, None]
            v = tl.where(v != v, v, tl.minimum(tl.maximum(v, -fmax), fmax))  # NaN kept (min/max would drop it)
            q_at = q_ptr + at(i0, i1, i2, cols, q_s0, q_s1, q_s2, q_sc)
            if INTERPRETED:
                tl.store(q_at, fp8_bits(v, MANT, BIAS, NAN_CODE, SUB_SCALE), mask=mask)
            else:
                tl.store(q_at, v.to(q_ptr.dtype.element_ty), mask=mask)



def _launch(x, q, a, s, lay, stage: int, group_w: int, n_groups: int, fmt: tuple, fmax: float,
            a_strides=(0, 0), s_strides=(0, 0), static_scale: float = 1.0):
    mant, bias, nan_code = fmt
    block_n = min(next_pow2(group_w), TILE)
    block_m = max(1, min(next_pow2(lay.n_rows), TILE // block_n))
    grid = (cdiv(lay.n_rows, block_m), n_groups)
    _quantize_fp8_kernel[grid](
        x, q, a, s, lay.n_rows, lay.n_cols, lay.sizes[1], lay.sizes[2], *lay.args(0), *lay.args(1),
        *a_strides, *s_strides, group_w, fmax, static_scale,
        STAGE=int(stage), MANT=mant, BIAS=bias, NAN_CODE=nan_code, SUB_SCALE=2.0 ** (bias - 1 + mant),
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4 if block_m * block_n <= 2048 else 8,
    )


@impl(spec, "cuda")
def quantize_fp8(x: torch.Tensor, granularity: str, block: int, dtype: str, scale):
    """Token and block scaling: one launch (each program reads its rows' group, once when it fits BLOCK_N).
    Tensor scaling: amax per row, amax of those, then q (three launches, x read twice)."""
    q = torch.empty(x.shape, dtype=getattr(torch, dtype), device=x.device)
    sshape = scales_shape(tuple(x.shape), granularity, block)
    fmax = FP8_MAX[dtype]
    if scale is not None:
        s = torch.full(sshape, scale, dtype=torch.float32, device=x.device)
    elif x.numel() == 0:
        return q, torch.full(sshape, SCALE_FLOOR, dtype=torch.float32, device=x.device)
    else:
        s = torch.empty(sshape, dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return q, s
    qv = q.view(torch.uint8) if INTERPRET else q
    lay, (x,) = rows_layout([x], qv)
    fmt = FORMAT[dtype]
    if scale is not None:
        _launch(x, qv, s, s, lay, STATIC, lay.n_cols, 1, fmt, fmax, static_scale=float(scale))
    elif granularity == "tensor":
        amax_rows = torch.empty(lay.n_rows, dtype=torch.float32, device=x.device)
        _launch(x, qv, amax_rows, s, lay, AMAX, lay.n_cols, 1, fmt, fmax, a_strides=(1, 0))
        amax = torch.empty(1, dtype=torch.float32, device=x.device)
        one = type(lay)(1, lay.n_rows, (1, 1, 1), ((0, 0, 0, 1), (0, 0, 0, 1)))
        _launch(amax_rows, qv, amax, s, one, AMAX, lay.n_rows, 1, fmt, fmax, a_strides=(0, 0))
        _launch(x, qv, amax, s, lay, FROM_AMAX, lay.n_cols, 1, fmt, fmax, s_strides=(0, 0))
    else:
        group_w = lay.n_cols if granularity == "token" else block
        n_groups = lay.n_cols // group_w
        _launch(x, qv, s, s, lay, DYNAMIC, group_w, n_groups, fmt, fmax, s_strides=(n_groups, 1))
    return q, s
