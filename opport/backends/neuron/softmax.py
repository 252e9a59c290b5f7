"""softmax on NKI: rows on the 128 partitions, the softmax axis on the free dimension."""

from __future__ import annotations

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.dispatch import impl
from opport.ops.softmax import softmax as spec

FMAX = 4096  # free-dim chunk: a 4096-wide input chunk plus its fp32 exp is <= 32 KiB per partition
RESIDENT = 16384  # rows up to this length stay in SBUF between the two passes (<= 64 KiB fp32)
NEG_BIG = -3.4028234663852886e38  # -FLT_MAX: a finite start for the running max, so exp(m_old - m_new) is never NaN


@nki.jit
def _softmax_kernel(x_hbm):
    """Row softmax of a [R, N] tensor, rows on partitions, N on the free dimension.

    Dimensions:
        R: rows (tiled by 128 onto the partitions); N: softmax length (free dim, chunks of FMAX).

    Args:
        x_hbm: [R, N] input in HBM, float32/float16/bfloat16.

    Returns:
        out_hbm: [R, N] in x's dtype, exp(x - max) / sum(exp(x - max)) per row.

    Notes:
        Statistics are float32. A row that fits one chunk takes one pass: max (negated for free on
        VectorE), then one ScalarE activation computing exp(x - max) and its row sum together, then
        a multiply by the reciprocal. Longer rows use an online pass that keeps a running max and a
        rescaled running sum, then a second pass writing exp(x - m) / s; rows up to RESIDENT
        elements stay in SBUF so the input is read from HBM once. A row of all -inf gives NaN
        (0/0, as torch.softmax); a +inf gives NaN through inf - inf, as the reference.

    Pseudocode:
        for each 128-row tile:
            if N <= FMAX: m = max(x); e = exp(x - m); s = sum(e); out = e * (1/s)
            else:
                m = -FLT_MAX; s = 0
                for each chunk c: m' = max(m, max(x_c)); s = s * exp(m - m') + sum(exp(x_c - m')); m = m'
                for each chunk c: out_c = exp(x_c - m) * (1/s)
    """
    R, N = x_hbm.shape
    out_hbm = nl.ndarray((R, N), dtype=x_hbm.dtype, buffer=nl.shared_hbm)
    PMAX = nl.tile_size.pmax
    n_chunks = (N + FMAX - 1) // FMAX

    for r0 in range(0, R, PMAX):
        p = min(PMAX, R - r0)
        if n_chunks == 1:
            x_sb = nl.ndarray((p, N), dtype=x_hbm.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_sb, src=x_hbm[r0:r0 + p, 0:N])
            neg_max_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=neg_max_sb, op=nl.maximum, data=x_sb, axis=1, negate=True, keepdims=True)
            e_sb = nl.ndarray((p, N), dtype=nl.float32, buffer=nl.sbuf)
            sum_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=e_sb, op=nl.exp, data=x_sb, bias=neg_max_sb, reduce_op=nl.add, reduce_res=sum_sb,
                            reduce_cmd=nisa.reduce_cmd.reset_reduce)
            inv_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.reciprocal(dst=inv_sb, data=sum_sb)
            out_sb = nl.ndarray((p, N), dtype=x_hbm.dtype, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=out_sb, data=e_sb, op0=nl.multiply, operand0=inv_sb)
            nisa.dma_copy(dst=out_hbm[r0:r0 + p, 0:N], src=out_sb)
        else:
            # pass 1: online max and rescaled sum over the chunks
            resident = N <= RESIDENT
            x_tiles = []
            m_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.memset(dst=m_sb, value=NEG_BIG)
            s_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.memset(dst=s_sb, value=0.0)
            for c in range(n_chunks):
                c0 = c * FMAX
                f = min(FMAX, N - c0)
                x_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=x_sb, src=x_hbm[r0:r0 + p, c0:c0 + f])
                if resident:
                    x_tiles.append(x_sb)
                cmax_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_reduce(dst=cmax_sb, op=nl.maximum, data=x_sb, axis=1, keepdims=True)
                m_new_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=m_new_sb, data1=m_sb, data2=cmax_sb, op=nl.maximum)
                neg_m_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_scalar(dst=neg_m_sb, data=m_new_sb, op0=nl.multiply, operand0=-1.0)
                corr_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
                nisa.activation(dst=corr_sb, op=nl.exp, data=m_sb, bias=neg_m_sb)
                e_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
                csum_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
                nisa.activation(dst=e_sb, op=nl.exp, data=x_sb, bias=neg_m_sb, reduce_op=nl.add, reduce_res=csum_sb,
                                reduce_cmd=nisa.reduce_cmd.reset_reduce)
                nisa.scalar_tensor_tensor(dst=s_sb, data=s_sb, op0=nl.multiply, operand0=corr_sb, op1=nl.add,
                                          operand1=csum_sb)
                m_sb = m_new_sb
            # pass 2: out = exp(x - m) * (1/s)
            neg_m_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=neg_m_sb, data=m_sb, op0=nl.multiply, operand0=-1.0)
            inv_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.reciprocal(dst=inv_sb, data=s_sb)
            for c in range(n_chunks):
                c0 = c * FMAX
                f = min(FMAX, N - c0)
                if resident:
                    x_sb = x_tiles[c]
                else:
                    x_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
                    nisa.dma_copy(dst=x_sb, src=x_hbm[r0:r0 + p, c0:c0 + f])
                e_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
                nisa.activation(dst=e_sb, op=nl.exp, data=x_sb, bias=neg_m_sb)
                out_sb = nl.ndarray((p, f), dtype=x_hbm.dtype, buffer=nl.sbuf)
                nisa.tensor_scalar(dst=out_sb, data=e_sb, op0=nl.multiply, operand0=inv_sb)
                nisa.dma_copy(dst=out_hbm[r0:r0 + p, c0:c0 + f], src=out_sb)
    return out_hbm


@impl(spec, "neuron", dtypes=("float32", "float16", "bfloat16"))
def softmax(x: np.ndarray, axis: int) -> np.ndarray:
    """Host side: move `axis` last (a copy when it is not already last), flatten to rows, launch."""
    if x.ndim == 0:
        x1 = x.reshape(1, 1)
        return _host.as_dtype(_host.run(_softmax_kernel, x1), x.dtype.name, ())
    last = np.moveaxis(x, axis, -1)
    if last.size == 0:
        return np.empty(x.shape, x.dtype)
    out = _host.as_dtype(_host.run(_softmax_kernel, _host.rows(last)), x.dtype.name, last.shape)
    return np.ascontiguousarray(np.moveaxis(out, -1, axis))
