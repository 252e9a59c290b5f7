"""dequantize_fp8 in Triton: fp8 codes widened to float32, times their group's scale, rounded once.

In the interpreter the codes are read through a uint8 view and decoded by bits (`fp8_value`: Triton 3.6's
interpreter has no exact fp8 widening, see quantize_fp8.py); compiled kernels widen with the hardware cvt.
"""

import torch

from opport.backends.cuda._launch import INTERPRET, INTERPRETED, at, cdiv, lead_index, narrow, next_pow2, rows_layout, tl, triton
from opport.backends.cuda.quantize_fp8 import FORMAT, TILE
from opport.dispatch import impl
from opport.ops.dequantize_fp8 import dequantize_fp8 as spec


@triton.jit
def fp8_value(c, MANT: tl.constexpr, BIAS: tl.constexpr, E5M2: tl.constexpr, SUB_UNIT: tl.constexpr):
    """float32 value of fp8 codes `c` (uint8), exactly: normals by rebuilding float32 bits, subnormals as
    mantissa x 2^(1 - BIAS - MANT); e4m3fn's 0x7F / 0xFF are NaN, e5m2's exponent 31 is inf or NaN."""
    c = c.to(tl.int32) & 0xFF
    e = (c >> MANT) & ((1 << (7 - MANT)) - 1)
    m = c & ((1 << MANT) - 1)
    neg = (c & 0x80) != 0
    bits = ((c & 0x80) << 24) | ((e + (127 - BIAS)) << 23) | (m << (23 - MANT))
    val = bits.to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * SUB_UNIT
    val = tl.where(e == 0, tl.where(neg, -sub, sub), val)
    if E5M2:
        inf = tl.where(neg, -float("inf"), float("inf"))
        val = tl.where(e == 31, tl.where(m == 0, inf, float("nan")), val)
    else:
        val = tl.where((c & 0x7F) == 0x7F, float("nan"), val)
    return val


@triton.jit
def _dequantize_fp8_kernel(
    # pointers
    q_ptr, s_ptr, out_ptr,
    # shapes, strides
    n_rows, n_cols, n1, n2, q_s0, q_s1, q_s2, q_sc, o_s0, o_s1, o_s2, o_sc, s_row, s_grp, group_w,
    # meta-parameters
    MANT: tl.constexpr, BIAS: tl.constexpr, E5M2: tl.constexpr, SUB_UNIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out = float32(q) * scale of the element's group, rounded once to out's dtype.

    Dimensions: q, out [n_rows, n_cols] as strided views; scales at s_ptr + row * s_row + (col // group_w) * s_grp.
    Args: MANT, BIAS, E5M2: the fp8 format (interpreter decoding).
    Returns: out.
    Notes: one read of q (1 byte) and of the scales (from L1/L2: one per group), one write of out.
    Pseudocode: out[r, c] = f32(q[r, c]) * s[r, c // group_w]
    """
    pid = tl.program_id(0).to(tl.int64)
    tiles_n = tl.cdiv(n_cols, BLOCK_N)
    rows = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    i0, i1, i2 = lead_index(rows, n1, n2)
    i0, i1, i2 = i0[:, None], i1[:, None], i2[:, None]
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    c2 = cols[None, :]
    code = tl.load(q_ptr + at(i0, i1, i2, c2, q_s0, q_s1, q_s2, q_sc), mask=mask)  # masked lanes are never stored
    if INTERPRETED:
        v = fp8_value(code, MANT, BIAS, E5M2, SUB_UNIT)
    else:
        v = code.to(tl.float32)
    s = tl.load(s_ptr + rows.to(tl.int64)[:, None] * s_row + (c2 // group_w).to(tl.int64) * s_grp, mask=mask, other=1.0)
    tl.store(out_ptr + at(i0, i1, i2, c2, o_s0, o_s1, o_s2, o_sc), narrow(v * s, out_ptr.dtype.element_ty), mask=mask)


@impl(spec, "cuda")
def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, granularity: str, block: int, out_dtype: str):
    out = torch.empty(q.shape, dtype=getattr(torch, out_dtype), device=q.device)
    if out.numel() == 0:
        return out
    mant, bias, _ = FORMAT[str(q.dtype).removeprefix("torch.")]
    qv = q.view(torch.uint8) if INTERPRET else q
    lay, (qv,) = rows_layout([qv], out)
    s = scales.contiguous()  # one value per group: small next to q
    if granularity == "tensor":
        s_row, s_grp, group_w = 0, 0, lay.n_cols
    elif granularity == "token":
        s_row, s_grp, group_w = 1, 0, lay.n_cols
    else:
        s_row, s_grp, group_w = lay.n_cols // block, 1, block
    block_n = min(next_pow2(lay.n_cols), TILE)
    block_m = max(1, min(next_pow2(lay.n_rows), TILE // block_n))
    grid = (cdiv(lay.n_rows, block_m) * cdiv(lay.n_cols, block_n),)
    _dequantize_fp8_kernel[grid](
        qv, s, out, lay.n_rows, lay.n_cols, lay.sizes[1], lay.sizes[2], *lay.args(0), *lay.args(1),
        s_row, s_grp, group_w,
        MANT=mant, BIAS=bias, E5M2=mant == 2, SUB_UNIT=2.0 ** (1 - bias - mant),
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4 if block_m * block_n <= 2048 else 8,
    )
    return out
