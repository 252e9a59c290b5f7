"""rope in Triton: both pair layouts through one [rows, pairs, 2] tile, tables shared over heads.

The backward is the same kernel rotating by the opposite angles (sin negated inside the kernel, which is
exact), so dx = (g1 cos + g2 sin, g2 cos - g1 sin) comes out as the reference writes it.
"""

import torch

from opport.backends.cuda._launch import at, cdiv, f32, lead_index, narrow, next_pow2, tile_elements, tl, triton, warps_for
from opport.dispatch import impl
from opport.ops.rope import rope as spec


@triton.jit
def _rope_kernel(
    # pointers
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    # shapes, strides
    n_rows, n_heads, seq, half,
    x_sb, x_sh, x_ss, x_sd,
    o_sb, o_sh, o_ss, o_sd,
    c_sb, c_ss, c_sj, s_sb, s_ss, s_sj,
    pair_step, pair_gap,
    # meta-parameters
    COMPUTE: tl.constexpr, INVERSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """out pair (x1, x2) -> (x1*cos - x2*sin, x2*cos + x1*sin) for each (b, h, s) row.

    Dimensions: x, out [B, H, S, D] strided; cos, sin [B or 1, S, D/2] (batch stride 0 for [S, D/2] and [1, S, D/2]).
    Notes: member k of pair j sits at column j*pair_step + k*pair_gap: (2, 1) interleaved, (1, D/2)
    rotate-half. Loading the [BLOCK_M, BLOCK_H, 2] tile and splitting it keeps the interleaved loads
    contiguous. Math runs in float32 (float64 when the tables are float64); x is read and written
    once, the tables once per row (L2-resident across the heads of one position).
    The store goes through float32 (the interpreter's float64 -> bfloat16 cast is wrong).
    INVERSE rotates by -angle (rope's backward: x is the upstream gradient): sin is negated, exactly.
    Pseudocode: x1, x2 = split(x[row, pairs]); out[row, pairs] = join(x1*c - x2*s, x2*c + x1*s)
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    b, h, s = lead_index(rows, n_heads, seq)
    b, h, s = b[:, None], h[:, None], s[:, None]
    j = tl.arange(0, BLOCK_H)[None, :]
    tmask = (rows < n_rows)[:, None] & (j < half)
    c = tl.load(cos_ptr + b * c_sb + s * c_ss + j.to(tl.int64) * c_sj, mask=tmask, other=0.0)
    sn = tl.load(sin_ptr + b * s_sb + s * s_ss + j.to(tl.int64) * s_sj, mask=tmask, other=0.0)
    c, sn = _widen(c, COMPUTE), _widen(sn, COMPUTE)
    if INVERSE:
        sn = -sn
    cols = (j * pair_step)[:, :, None] + tl.arange(0, 2)[None, None, :] * pair_gap  # [1, BLOCK_H, 2]
    b, h, s, mask = b[:, :, None], h[:, :, None], s[:, :, None], tmask[:, :, None]
    x = tl.load(x_ptr + at(b, h, s, cols, x_sb, x_sh, x_ss, x_sd), mask=mask, other=0.0)
    x = _widen(x, COMPUTE)
    x1, x2 = tl.split(x)
    y = tl.join(x1 * c - x2 * sn, x2 * c + x1 * sn)
    y = narrow(y.to(tl.float32), out_ptr.dtype.element_ty)
    tl.store(out_ptr + at(b, h, s, cols, o_sb, o_sh, o_ss, o_sd), y, mask=mask)


@triton.jit
def _widen(t, COMPUTE: tl.constexpr):
    """t in the compute dtype; float64 tables stay float64 (never rounded through float32)."""
    if t.dtype == tl.float64:
        return t
    else:
        return f32(t).to(COMPUTE)


def _table_strides(t: torch.Tensor) -> tuple:
    """(batch, seq, pair) strides; a [S, D/2] or [1, S, D/2] table is shared by every batch (stride 0)."""
    if t.dim() == 2:
        return (0, *t.stride())
    return (0 if t.shape[0] == 1 else t.stride(0), *t.stride()[1:])


@impl(spec, "cuda")
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return _rotate(x, cos, sin, interleaved, inverse=False)


@impl(spec.backward_op, "cuda")
def rope_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool):
    """dx: grad rotated back by the same tables (the forward kernel with -sin); strided grads read in place."""
    return (_rotate(grad, cos, sin, interleaved, inverse=True),)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, inverse: bool) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    bsz, heads, seq, d = x.shape
    half = d // 2
    block_h = next_pow2(half)
    block_m = max(1, min(next_pow2(bsz * heads * seq), tile_elements() // (2 * block_h)))
    step, gap = (2, 1) if interleaved else (1, half)
    compute = tl.float64 if cos.dtype == torch.float64 else tl.float32
    _rope_kernel[(cdiv(bsz * heads * seq, block_m),)](
        x, cos, sin, out, bsz * heads * seq, heads, seq, half, *x.stride(), *out.stride(),
        *_table_strides(cos), *_table_strides(sin), step, gap,
        COMPUTE=compute, INVERSE=inverse, BLOCK_M=block_m, BLOCK_H=block_h, num_warps=warps_for(block_m * block_h * 2),
    )
    return out
