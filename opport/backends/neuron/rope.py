"""rope on NKI: positions on the 128 partitions, (heads, head_dim) on the free dimension."""

from __future__ import annotations

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron._tiles import spans
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.dispatch import impl
from opport.ops.rope import rope as spec

HD_MAX = 4096  # heads x head_dim per tile: x, out and four fp32 products stay <= 64 KiB per partition


@nki.jit
def _rope_kernel(x_hbm, cos_hbm, sin_hbm, interleaved):
    """Rotary embedding of x [B, H, S, D] by cos/sin tables [S, D/2] or [B, S, D/2].

    Dimensions:
        B: batch; H: heads (free dim, groups of HB); S: positions (tiled by 128 onto the partitions);
        D: head dim (free dim), D/2 rotated pairs.

    Args:
        x_hbm: [B, H, S, D] input in HBM, float32/float16/bfloat16.
        cos_hbm, sin_hbm: [S, D/2] or [B, S, D/2] tables, float32/float16/bfloat16 (the host passes a
            [1, S, D/2] table as the [S, D/2] table it is).
        interleaved: compile-time bool; pairs (2i, 2i+1) if True, else (i, i + D/2).

    Returns:
        out_hbm: [B, H, S, D] in x's dtype: (x1 cos - x2 sin, x2 cos + x1 sin) per pair.

    Notes:
        One DMA per (batch, position tile, head group) brings x in as [positions, heads, D] through an
        HBM access pattern (no host transpose). The cos/sin rows of the tile are loaded once (once for
        every batch entry when the table is shared) and broadcast over the heads with stride-0 views
        (expand_dim + broadcast), as nki-library's RoPE does. Pair members are strided views of the
        same tile (halves, or step-2 slices when interleaved), so the rotation is six VectorE
        tensor_tensor instructions per tile, in float32 with one rounding to x's dtype on the write.

    Pseudocode:
        for each 128-position tile, b, each head group:
            c, s = cos[b?, pos], sin[b?, pos] broadcast over heads (a shared table's tile loaded once)
            out1 = x1 * c - x2 * s; out2 = x2 * c + x1 * s
    """
    return _rotate(x_hbm, cos_hbm, sin_hbm, interleaved, False)


@nki.jit
def _rope_backward_kernel(grad_hbm, cos_hbm, sin_hbm, interleaved):
    """The gradient of rope for x: grad [B, H, S, D] rotated back by the same angles (the inverse rotation).

    Dimensions:
        B, H, S, D as in _rope_kernel: positions tiled by 128 onto the partitions, (heads, D) on the free dim.

    Args:
        grad_hbm: [B, H, S, D] upstream gradient in HBM, float32/float16/bfloat16 (x's dtype).
        cos_hbm, sin_hbm: the forward's tables, [S, D/2] or [B, S, D/2].
        interleaved: compile-time bool, as in the forward.

    Returns:
        dx_hbm: [B, H, S, D] in grad's dtype: (g1 cos + g2 sin, g2 cos - g1 sin) per pair.

    Notes:
        The rotation is orthogonal, so its transpose is the rotation by -angle: the forward's tile loop
        (_rotate) with the subtract and the add swapped, which is bit for bit the forward run on -sin
        (negation is exact) without negating a table anywhere. Traffic is the forward's: grad and the
        tables read once, dx written once.

    Pseudocode:
        for each 128-position tile, b, each head group:
            c, s = cos[b?, pos], sin[b?, pos] broadcast over heads (a shared table's tile loaded once)
            dx1 = g1 * c + g2 * s; dx2 = g2 * c - g1 * s
    """
    return _rotate(grad_hbm, cos_hbm, sin_hbm, interleaved, True)


def _rotate(x_hbm, cos_hbm, sin_hbm, interleaved, inverse):
    """The tile loop of both kernels: rotate x's pairs by +angle (forward) or -angle (inverse, the backward)."""
    B, H, S, D = x_hbm.shape
    half = D // 2
    out_hbm = nl.ndarray((B, H, S, D), dtype=x_hbm.dtype, buffer=nl.shared_hbm)
    PMAX = nl.tile_size.pmax
    HB = max(1, min(H, HD_MAX // D))
    per_batch = len(cos_hbm.shape) == 3

    for s0, p in spans(S, PMAX):  # positions outside, batch inside: a shared table tile is loaded once, not B times
        for b in range(B):
            if per_batch or b == 0:
                c_sb = nl.ndarray((p, half), dtype=cos_hbm.dtype, buffer=nl.sbuf)
                s_sb = nl.ndarray((p, half), dtype=sin_hbm.dtype, buffer=nl.sbuf)
                if per_batch:
                    nisa.dma_copy(dst=c_sb, src=cos_hbm[b, s0:s0 + p, 0:half])
                    nisa.dma_copy(dst=s_sb, src=sin_hbm[b, s0:s0 + p, 0:half])
                else:
                    nisa.dma_copy(dst=c_sb, src=cos_hbm[s0:s0 + p, 0:half])
                    nisa.dma_copy(dst=s_sb, src=sin_hbm[s0:s0 + p, 0:half])
            for h0, hb in spans(H, HB):
                base = ((b * H + h0) * S + s0) * D
                # [positions, heads, D] view of x[b, h0:h0+hb, s0:s0+p, :]
                x_sb = nl.ndarray((p, hb, D), dtype=x_hbm.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=x_sb, src=x_hbm.ap(pattern=[[D, p], [S * D, hb], [1, D]], offset=base))
                cb = c_sb.expand_dim(1).broadcast(1, hb)
                sb = s_sb.expand_dim(1).broadcast(1, hb)
                out_sb = nl.ndarray((p, hb, D), dtype=x_hbm.dtype, buffer=nl.sbuf)
                if interleaved:
                    x1, x2 = x_sb[0:p, 0:hb, 0:D:2], x_sb[0:p, 0:hb, 1:D:2]
                    o1, o2 = out_sb[0:p, 0:hb, 0:D:2], out_sb[0:p, 0:hb, 1:D:2]
                else:
                    x1, x2 = x_sb[0:p, 0:hb, 0:half], x_sb[0:p, 0:hb, half:D]
                    o1, o2 = out_sb[0:p, 0:hb, 0:half], out_sb[0:p, 0:hb, half:D]
                t1_sb = nl.ndarray((p, hb, half), dtype=nl.float32, buffer=nl.sbuf)
                t2_sb = nl.ndarray((p, hb, half), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=t1_sb, data1=x1, data2=cb, op=nl.multiply)
                nisa.tensor_tensor(dst=t2_sb, data1=x2, data2=sb, op=nl.multiply)
                nisa.tensor_tensor(dst=o1, data1=t1_sb, data2=t2_sb, op=nl.add if inverse else nl.subtract)
                t3_sb = nl.ndarray((p, hb, half), dtype=nl.float32, buffer=nl.sbuf)
                t4_sb = nl.ndarray((p, hb, half), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=t3_sb, data1=x2, data2=cb, op=nl.multiply)
                nisa.tensor_tensor(dst=t4_sb, data1=x1, data2=sb, op=nl.multiply)
                nisa.tensor_tensor(dst=o2, data1=t3_sb, data2=t4_sb, op=nl.subtract if inverse else nl.add)
                nisa.dma_copy(dst=out_hbm.ap(pattern=[[D, p], [S * D, hb], [1, D]], offset=base), src=out_sb)
    return out_hbm


@impl(spec, "neuron")
def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """Host side: contiguous x, tables in a dtype NKI has (float64 tables rounded to float32), a [1, S, D/2]
    table as the [S, D/2] table it is for every batch entry, launch."""
    if x.size == 0:
        return np.empty(x.shape, x.dtype)
    if cos.ndim == 3 and cos.shape[0] == 1:
        cos, sin = cos[0], sin[0]
    out = _host.run(_rope_kernel, _host.contiguous(x), _host.float32_table(cos), _host.float32_table(sin), bool(interleaved))
    return _host.as_dtype(out, x.dtype.name, x.shape)


@impl(spec.backward_op, "neuron")
def rope_backward(grad: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool):
    """Host side, as the forward's: contiguous grad (a strided upstream gradient is copied), tables in a dtype NKI
    has, a [1, S, D/2] table as the [S, D/2] one, launch."""
    if grad.size == 0:
        return (np.empty(grad.shape, grad.dtype),)
    if cos.ndim == 3 and cos.shape[0] == 1:
        cos, sin = cos[0], sin[0]
    dx = _host.run(_rope_backward_kernel, _host.contiguous(grad), _host.float32_table(cos), _host.float32_table(sin),
                   bool(interleaved))
    return (_host.as_dtype(dx, grad.dtype.name, grad.shape),)
