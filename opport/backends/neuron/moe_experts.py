"""moe_experts on NKI: per expert hit, 128-row tiles of its picks gathered by indirect DMA, both GEMMs on TensorE.

The host sorts the T * k picks (flat slot t * k + j) by expert, stably (NKI has no sort; the index is on the host
for the value check anyway), and passes each sorted row's token and slot ([T k, 1] int32) and the experts hit with
their row ranges (a compile-time tuple: the kernel is traced for that routing histogram). Everything else is in the
kernel: x rows and router weights gathered by indirect DMA (`.ap(vector_offset=...)`), transposes and GEMMs on
TensorE with float32 PSUM accumulation, SwiGLU on ScalarE / VectorE, the per-pick outputs scattered to their slots
in an HBM scratch by indirect DMA, and each token's k rows summed in pick order.
"""

from __future__ import annotations

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron._tiles import spans
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.dispatch import impl
from opport.dtypes import np_dtype
from opport.ops.moe_experts import moe_experts as spec

TILE = 128  # partitions: the rows of a tile and the contraction of every nc_matmul
PSUM_N = 512  # moving free size: one 2 KiB PSUM bank of float32 (nl.tile_size.gemm_moving_fmax)
SUM_FMAX = 2048  # columns per chunk of the sum over k: two float32 [128, 2048] tiles, 16 KiB per partition
NEG_BIG = -3.4028234663852886e38  # -FLT_MAX stands in for a gate of -inf: silu(-inf) * up = -0.0 * up (swiglu's)


@nki.jit
def _moe_experts_kernel(x_hbm, w1_hbm, w2_hbm, rw_hbm, tok_hbm, slot_hbm, groups):
    """Routed experts: out[t] = sum over t's picks j of w[t, j] down_e(silu(gate_e(x[t])) * up_e(x[t])).

    Dimensions:
        T: tokens; H: hidden (128-wide contraction tiles, 512-wide output chunks); I: expert intermediate (128-wide
        tiles); E: experts; k: picks per token; T k sorted rows in 128-row tiles per expert.

    Args:
        x_hbm: [T, H] tokens, float32/float16/bfloat16.
        w1_hbm: [E, 2I, H] gate_up_proj (gate rows, then up rows); w2_hbm: [E, H, I] down_proj; x's dtype.
        rw_hbm: [T k, 1] router weights by slot, x's dtype.
        tok_hbm, slot_hbm: [T k, 1] int32: the token and the slot of each row in expert-sorted order.
        groups: compile-time ((e, first row, rows), ...) for every expert hit, in expert order.

    Returns:
        out_hbm: [T, H] in x's dtype.

    Notes:
        Per 128-row tile of an expert: x rows gathered by one indirect DMA and transposed on TensorE (the
        contraction H onto the partitions). gate^T and up^T [I tile, rows] come out of PSUM with I on the
        partitions (stationary: W1 tiles transposed on TensorE, moving: x^T), so a^T = silu(gate^T) up^T is the
        stationary operand of the down projection as it stands, after one rounding to x's dtype (TensorE pairs
        16-bit with 16-bit; transformers rounds a as well). y [rows, 512 columns of H] accumulates over I tiles
        in one PSUM bank, is scaled by each row's router weight (a per-partition scalar) on eviction, and is
        scattered to its slot's row of a float32 [T k, H] HBM scratch by an indirect DMA. Finally each token's
        k rows (slots t k .. t k + k - 1: one strided DMA per pick) are summed in pick order in float32 and
        rounded once. silu(gate) up is gate (sigmoid(gate) up) with a gate of -inf taken as -FLT_MAX; unlike
        `swiglu`'s kernel there is no fix-up for |gate| > 64 against an up near the float maximum.
        Weight tiles are transposed per 128-row tile (an expert with many rows transposes them again).

    Pseudocode:
        for (e, first, n) in groups, each 128-row tile r of first..first+n:
            x_r = x[tok[r]]; w_r = rw[slot[r]]
            for each I tile i: aT_i = swiglu(W1g[e, i] x_r^T, W1u[e, i] x_r^T)      (PSUM over H tiles)
            for each 512 columns c of H: ys[slot[r], c] = w_r * sum_i aT_i^T W2[e, c, i]^T
        for each 128 tokens t: out[t] = sum_j ys[t k + j]
    """
    T, H = x_hbm.shape
    I = w1_hbm.shape[1] // 2  # noqa: E741 (the contract's name)
    k = tok_hbm.shape[0] // T
    out_hbm = nl.ndarray((T, H), dtype=x_hbm.dtype, buffer=nl.shared_hbm)
    # per-slot outputs: an HBM scratch, not a kernel output (shared_hbm tensors other than inputs and outputs are named)
    ys_hbm = nl.ndarray((T * k, H), dtype=nl.float32, buffer=nl.shared_hbm, name="moe_experts_ys")
    for e, first, n in groups:
        for r0, p in spans(first + n, TILE, first):
            tok_sb, slot_sb = row_indices(tok_hbm, slot_hbm, r0, p)
            xT_tiles = gathered_transposed(x_hbm, tok_sb, p)
            rw_sb = router_weights(rw_hbm, slot_sb, p)
            aT_tiles = []
            for i0, it in spans(I, TILE):
                g_sb, u_sb = gate_up_tile(w1_hbm, xT_tiles, e, i0, it, p)
                a_sb = nl.ndarray((it, p), dtype=x_hbm.dtype, buffer=nl.sbuf)
                swiglu_tile(a_sb, g_sb, u_sb, it, p)
                aT_tiles.append(a_sb)
            for c0, c in spans(H, PSUM_N):
                y_psum = nl.ndarray((p, c), dtype=nl.float32, buffer=nl.psum)
                for j, (i0, it) in enumerate(spans(I, TILE)):
                    nisa.nc_matmul(dst=y_psum, stationary=aT_tiles[j], moving=transposed_block(w2_hbm, e, c0, c, i0, it))
                y_sb = nl.ndarray((p, c), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_scalar(dst=y_sb, data=y_psum, op0=nl.multiply, operand0=rw_sb)
                nisa.dma_copy(dst=ys_hbm.ap([[H, p], [1, c]], offset=c0, vector_offset=slot_sb, indirect_dim=0), src=y_sb)
    sum_over_k(ys_hbm, out_hbm, k)
    return out_hbm


def row_indices(tok_hbm, slot_hbm, r0, p):
    """The tokens and slots [p, 1] int32 of sorted rows r0..r0+p, one per partition (indirect DMA offsets)."""
    tok_sb = nl.ndarray((p, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=tok_sb, src=tok_hbm[r0:r0 + p, 0:1])
    slot_sb = nl.ndarray((p, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=slot_sb, src=slot_hbm[r0:r0 + p, 0:1])
    return tok_sb, slot_sb


def gather_rows(src_hbm, idx_sb, p, c0, c):
    """src[idx[r], c0:c0+c] for the p rows r, onto the partitions by one indirect DMA (src [N, C] in HBM)."""
    C = src_hbm.shape[1]
    dst_sb = nl.ndarray((p, c), dtype=src_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=dst_sb, src=src_hbm.ap([[C, p], [1, c]], offset=c0, vector_offset=idx_sb, indirect_dim=0))
    return dst_sb


def router_weights(rw_hbm, slot_sb, p):
    """The rows' router weights [p, 1] in float32 (a per-partition scalar operand), gathered by slot."""
    w_sb = gather_rows(rw_hbm, slot_sb, p, 0, 1)
    w32_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=w32_sb, src=w_sb)
    return w32_sb


def transposed(t_sb):
    """t^T in SBUF through a TensorE transpose (bit-exact) and PSUM (t [P <= 128, F <= 128])."""
    p, f = t_sb.shape[0], t_sb.shape[1]
    tT_psum = nl.ndarray((f, p), dtype=t_sb.dtype, buffer=nl.psum)
    nisa.nc_transpose(dst=tT_psum, data=t_sb)
    tT_sb = nl.ndarray((f, p), dtype=t_sb.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=tT_sb, src=tT_psum)
    return tT_sb


def gathered_transposed(x_hbm, tok_sb, p):
    """x[tok]^T as one [<= 128 H, p] tile per 128 columns of H: the rows gathered by one indirect DMA, then
    transposed on TensorE (H becomes the contraction, on the partitions)."""
    H = x_hbm.shape[1]
    x_sb = gather_rows(x_hbm, tok_sb, p, 0, H)
    tiles = []
    for h0, kt in spans(H, TILE):
        tiles.append(transposed(x_sb[0:p, h0:h0 + kt]))
    return tiles


def weight_tile_transposed(w_hbm, e, r0, r, c0, c):
    """w[e, r0:r0+r, c0:c0+c]^T [c, r]: a row-major DMA and a TensorE transpose."""
    w_sb = nl.ndarray((r, c), dtype=w_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=w_sb, src=w_hbm[e, r0:r0 + r, c0:c0 + c])
    return transposed(w_sb)


def transposed_block(w2_hbm, e, c0, c, i0, it):
    """down_proj[e, c0:c0+c, i0:i0+it]^T [it, c]: 128-row pieces transposed on TensorE side by side."""
    block_sb = nl.ndarray((it, c), dtype=w2_hbm.dtype, buffer=nl.sbuf)
    for h0, ht in spans(c0 + c, TILE, c0):
        piece_sb = weight_tile_transposed(w2_hbm, e, h0, ht, i0, it)
        nisa.tensor_copy(dst=block_sb[0:it, h0 - c0:h0 - c0 + ht], src=piece_sb)
    return block_sb


def gate_up_tile(w1_hbm, xT_tiles, e, i0, it, p):
    """gate^T and up^T [it, p] float32 in SBUF for I columns i0..i0+it: W1 tiles (transposed) as stationary, x^T
    as moving, accumulated over H tiles in two PSUM banks."""
    H = w1_hbm.shape[2]
    I = w1_hbm.shape[1] // 2  # noqa: E741
    g_psum = nl.ndarray((it, p), dtype=nl.float32, buffer=nl.psum)
    u_psum = nl.ndarray((it, p), dtype=nl.float32, buffer=nl.psum)
    for j, (h0, kt) in enumerate(spans(H, TILE)):
        nisa.nc_matmul(dst=g_psum, stationary=weight_tile_transposed(w1_hbm, e, i0, it, h0, kt), moving=xT_tiles[j])
        nisa.nc_matmul(dst=u_psum, stationary=weight_tile_transposed(w1_hbm, e, I + i0, it, h0, kt), moving=xT_tiles[j])
    g_sb = nl.ndarray((it, p), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=g_sb, src=g_psum)
    u_sb = nl.ndarray((it, p), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=u_sb, src=u_psum)
    return g_sb, u_sb


def swiglu_tile(a_sb, g_sb, u_sb, pp, f):
    """a = gate (sigmoid(gate) up) into a_sb (its dtype: one rounding), a gate of -inf taken as -FLT_MAX (so
    silu(-inf) up = -0.0 up, NaN against an infinite up, as swiglu's reference)."""
    su_sb = nl.ndarray((pp, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=su_sb, op=nl.sigmoid, data=g_sb)
    nisa.tensor_tensor(dst=su_sb, data1=su_sb, data2=u_sb, op=nl.multiply)
    nisa.scalar_tensor_tensor(dst=a_sb, data=g_sb, op0=nl.maximum, operand0=NEG_BIG, op1=nl.multiply, operand1=su_sb)


def sum_over_k(ys_hbm, out_hbm, k):
    """out[t] = sum over j of ys[t k + j] (float32 [T k, N] per slot), in pick order, rounded once to out's dtype.
    The rows of pick j for 128 tokens are one strided DMA (stride k rows)."""
    T, N = out_hbm.shape
    for t0, p in spans(T, TILE):
        for c0, c in spans(N, SUM_FMAX):
            acc_sb = nl.ndarray((p, c), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=acc_sb, src=ys_hbm.ap([[k * N, p], [1, c]], offset=t0 * k * N + c0))
            for j in range(1, k):
                part_sb = nl.ndarray((p, c), dtype=nl.float32, buffer=nl.sbuf)
                nisa.dma_copy(dst=part_sb, src=ys_hbm.ap([[k * N, p], [1, c]], offset=(t0 * k + j) * N + c0))
                nisa.tensor_tensor(dst=acc_sb, data1=acc_sb, data2=part_sb, op=nl.add)
            res_sb = nl.ndarray((p, c), dtype=out_hbm.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=res_sb, src=acc_sb)
            nisa.dma_copy(dst=out_hbm[t0:t0 + p, c0:c0 + c], src=res_sb)


def sorted_picks(top_k_index: np.ndarray, n_experts: int) -> tuple:
    """Host side: (tok [T k, 1], slot [T k, 1] int32 in expert-sorted order (stable), groups ((e, first, rows), ...)
    of the experts hit)."""
    k = top_k_index.shape[1]
    flat = np.asarray(top_k_index).reshape(-1).astype(np.int64)
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=n_experts)
    firsts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    groups = tuple((int(e), int(firsts[e]), int(counts[e])) for e in np.flatnonzero(counts))
    slot = order.astype(np.int32).reshape(-1, 1)
    return np.ascontiguousarray(slot // k), slot, groups


@impl(spec, "neuron")
def moe_experts(x, gate_up_proj, down_proj, top_k_index, top_k_weights) -> np.ndarray:
    """Host side: the expert sort (sorted_picks), contiguous operands, router weights as [T k, 1]; T = 0 returns
    an empty output without a launch."""
    t, h = x.shape
    if t == 0:
        return np.empty((0, h), np_dtype(x.dtype.name))
    tok, slot, groups = sorted_picks(top_k_index, gate_up_proj.shape[0])
    rw = _host.contiguous(top_k_weights).reshape(-1, 1)
    out = _host.run(_moe_experts_kernel, _host.contiguous(x), _host.contiguous(gate_up_proj),
                    _host.contiguous(down_proj), rw, tok, slot, groups)
    return _host.as_dtype(out, x.dtype.name, (t, h))
