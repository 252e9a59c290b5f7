"""dequantize_fp8 on NKI: one scaling group per partition, fp8 codes times the group's scale on VectorE."""

from __future__ import annotations

import numpy as np

from opport.arraymath import grouped
from opport.backends.neuron import _host
from opport.backends.neuron._tiles import spans
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.backends.neuron.quantize_fp8 import fp8_unsupported
from opport.dispatch import impl
from opport.ops.dequantize_fp8 import dequantize_fp8 as spec

FMAX = 8192  # free-dim chunk: the fp8 codes and the output (<= 4 bytes) <= 40 KiB per partition


@nki.jit
def _dequantize_fp8_kernel(q_hbm, s_hbm, out_dtype):
    """out = float32(q) * s per row (one scaling group), cast once to out_dtype on the write.

    Dimensions:
        G: groups, on partitions (tiled by 128); L: elements per group, on the free dimension (chunks of FMAX).

    Args:
        q_hbm: [G, L] fp8 codes in HBM; s_hbm: [G, 1] float32 scales; out_dtype: the nl dtype of the output.

    Returns:
        out_hbm: [G, L] in out_dtype.

    Notes:
        VectorE widens the codes to float32 (exactly), multiplies by the [P, 1] scale operand and casts on
        the write: one read of q, one write of out.

    Pseudocode:
        for each [128, FMAX] tile: out = q * s
    """
    G, L = q_hbm.shape
    out_hbm = nl.ndarray((G, L), dtype=out_dtype, buffer=nl.shared_hbm)
    PMAX = nl.tile_size.pmax
    for r0, p in spans(G, PMAX):
        s_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=s_sb, src=s_hbm[r0:r0 + p, 0:1])
        for c0, f in spans(L, FMAX):
            q_sb = nl.ndarray((p, f), dtype=q_hbm.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=q_sb, src=q_hbm[r0:r0 + p, c0:c0 + f])
            out_sb = nl.ndarray((p, f), dtype=out_dtype, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=out_sb, data=q_sb, op0=nl.multiply, operand0=s_sb)
            nisa.dma_copy(dst=out_hbm[r0:r0 + p, c0:c0 + f], src=out_sb)
    return out_hbm


def _supports(q, scales, granularity, block, out_dtype):
    return fp8_unsupported(q.dtype)


@impl(spec, "neuron", supports=_supports)
def dequantize_fp8(q: np.ndarray, scales: np.ndarray, granularity: str, block: int, out_dtype: str):
    """Host side: q as [groups, group elements] (rows for "tensor"), contiguous (a copy only for a strided view),
    scales as [groups, 1] float32 (the per-tensor scale repeated per row: 4 bytes a row)."""
    q = _host.contiguous(q)
    if granularity == "tensor":
        g = q.reshape(-1, q.shape[-1])
        s = np.full((g.shape[0], 1), scales.reshape(-1)[0], np.float32)
    else:
        gq = grouped(q, granularity, block)
        g = gq.reshape(-1, gq.shape[-1])
        s = _host.contiguous(scales).reshape(-1, 1)
    if g.size == 0:
        return np.empty(q.shape, _host.np_dtype(out_dtype))
    out = _host.run(_dequantize_fp8_kernel, g, s, getattr(nl, out_dtype))
    return _host.as_dtype(out, out_dtype, q.shape)
