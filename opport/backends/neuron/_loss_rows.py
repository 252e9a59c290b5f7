"""The row setup the cross-entropy kernels share (cross_entropy and linear_cross_entropy).

Rows (tokens) lie on the 128 partitions and each row's target is compared with column indices in float32 on
VectorE: the targets as a float32 [p, 1] tile per row tile, the column iota, the one-hot of a vocabulary tile,
the NaN / ignored-row marks, the upstream gradient per row (a reduced loss's on every partition, divided by the
kept rows for "mean") and the loss's reduction across partitions on TensorE. Plain helper functions of NKI
instructions, which the NKI compiler inlines into the kernels that call them; targets32 and declines are host
side.
"""

from __future__ import annotations

import math

import numpy as np

from opport.backends.neuron._tiles import spans
from opport.backends.neuron.nki_compat import nisa, nl

EXACT = 1 << 24  # integers up to 2^24 are exact in float32, where VectorE compares the targets
TARGET_CLIP = EXACT + 1  # targets are clipped to +-(2^24 + 1) on the host: still outside [0, V), still != ignore_index


def declines(vocabulary: int, ignore_index: int) -> str | None:
    """Why the kernels cannot take this vocabulary or ignore_index (compared in float32), else None."""
    if vocabulary > EXACT:
        return f"vocabulary {vocabulary} > 2^24: class indices are compared in float32, exact only up to 2^24"
    if abs(int(ignore_index)) > EXACT:
        return f"|ignore_index| = {abs(int(ignore_index))} > 2^24: compared in float32, exact only up to 2^24"
    return None


def targets32(target: np.ndarray) -> np.ndarray:
    """Targets as int32, clipped so that out-of-range stays out of range (and != ignore_index)."""
    return np.clip(target.astype(np.int64), -TARGET_CLIP, TARGET_CLIP).astype(np.int32)


def column_iota(p, f):
    """0..f-1 on each of p partitions (float32 [p, f]): the column numbers a vocabulary tile is compared by."""
    cols_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=cols_sb, pattern=[[1, f]], offset=0, channel_multiplier=0)
    return cols_sb


def column_hits(cols_sb, t_f_sb, c0, p, f, dtype=nl.float32):
    """1 where column c0 + i is the row's target, else 0 ([p, f] in dtype: float32 to compute with, uint8 as a
    predicate)."""
    hit_sb = nl.ndarray((p, f), dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=hit_sb, data=cols_sb[0:p, 0:f], op0=nl.add, operand0=float(c0), op1=nl.equal,
                       operand1=t_f_sb)
    return hit_sb


def target_tile(target_hbm, r0, p):
    """Targets r0:r0+p as a float32 [p, 1] tile (VectorE compares in float32; exact: |t| <= 2^24 + 1)."""
    t_i_sb = nl.ndarray((p, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t_i_sb, src=target_hbm[r0:r0 + p])
    t_f_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=t_f_sb, src=t_i_sb)
    return t_f_sb


def target_tiles(target_hbm):
    """target_tile of every 128-row tile, loaded once."""
    tiles = []
    for r0, p in spans(target_hbm.shape[0], nl.tile_size.pmax):
        tiles.append(target_tile(target_hbm, r0, p))
    return tiles


def mark_rows(c_sb, t_f_sb, ignore_index, V, p):
    """c = NaN for a target outside [0, V) (its loss is NaN); returns the ignored-row predicate (uint8 [p, 1])."""
    for op, bound in ((nl.less, 0.0), (nl.greater_equal, float(V))):
        out_sb = nl.ndarray((p, 1), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=out_sb, data=t_f_sb, op0=op, operand0=bound)
        nisa.tensor_copy_predicated(dst=c_sb, src=math.nan, predicate=out_sb)
    ign_sb = nl.ndarray((p, 1), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=ign_sb, data=t_f_sb, op0=nl.equal, operand0=float(ignore_index))
    return ign_sb


def shared_coefficient(grad_hbm, t_tiles, mean, ignore_index, p_all):
    """The upstream gradient of a reduced loss on every partition [p_all, 1], divided by the rows kept for "mean"
    (grad_hbm None: a unit upstream gradient, the fused value-and-grad's).

    Both cross partitions on TensorE: grad by a K = 1 matmul against a ones row, the kept count by an all-ones
    stationary against each tile's kept flags, accumulated over the row tiles in one PSUM entry."""
    ones_sb = nl.ndarray((p_all, p_all), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones_sb, value=1.0)
    c_sb = nl.ndarray((p_all, 1), dtype=nl.float32, buffer=nl.sbuf)
    if grad_hbm == None:  # noqa: E711 (NKI kernels compare with None by value)
        nisa.memset(dst=c_sb, value=1.0)
    else:
        g_sb = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=g_sb, src=grad_hbm[0:1])
        g_psum = nl.ndarray((p_all, 1), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=g_psum, stationary=ones_sb[0:1, 0:p_all], moving=g_sb)
        nisa.tensor_copy(dst=c_sb, src=g_psum)
    if mean:
        cnt_psum = nl.ndarray((p_all, 1), dtype=nl.float32, buffer=nl.psum)
        for t_f_sb in t_tiles:
            p = t_f_sb.shape[0]
            kept_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=kept_sb, data=t_f_sb, op0=nl.not_equal, operand0=float(ignore_index))
            nisa.nc_matmul(dst=cnt_psum, stationary=ones_sb[0:p, 0:p_all], moving=kept_sb)
        inv_sb = nl.ndarray((p_all, 1), dtype=nl.float32, buffer=nl.sbuf)  # 1 / max(kept, 1): none kept, all rows 0
        nisa.tensor_scalar(dst=inv_sb, data=cnt_psum, op0=nl.maximum, operand0=1.0)
        nisa.reciprocal(dst=inv_sb, data=inv_sb)
        nisa.tensor_tensor(dst=c_sb, data1=c_sb, data2=inv_sb, op=nl.multiply)
    return c_sb


def gradient_rows(grad_hbm, target_hbm, lse_hbm, ignore_index, reduction, V):
    """Per 128-row tile of a backward from the saved lse: (r0, p, t, c, ignored, -lse), float32 [p, 1] tiles but
    the uint8 ignored-row predicate. c is grad[i] ("none") or the shared coefficient, NaN where the target is
    outside [0, V) (mark_rows)."""
    N = target_hbm.shape[0]
    t_tiles = target_tiles(target_hbm)
    if reduction != "none":
        c_all_sb = shared_coefficient(grad_hbm, t_tiles, reduction == "mean", ignore_index, t_tiles[0].shape[0])
    rows = []
    for i, (r0, p) in enumerate(spans(N, nl.tile_size.pmax)):
        c_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        if reduction == "none":
            nisa.dma_copy(dst=c_sb, src=grad_hbm[r0:r0 + p])
        else:
            nisa.tensor_copy(dst=c_sb, src=c_all_sb[0:p, 0:1])
        ign_sb = mark_rows(c_sb, t_tiles[i], ignore_index, V, p)
        lse_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=lse_sb, src=lse_hbm[r0:r0 + p])
        nisa.tensor_scalar(dst=lse_sb, data=lse_sb, op0=nl.multiply, operand0=-1.0)
        rows.append((r0, p, t_tiles[i], c_sb, ign_sb, lse_sb))
    return rows


def loss_sum(p_all):
    """What a reduced loss accumulates into: (ones [p_all, 1], [sum of losses, kept rows] [1, 2] in PSUM)."""
    ones_sb = nl.ndarray((p_all, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones_sb, value=1.0)
    acc_psum = nl.ndarray((1, 2), dtype=nl.float32, buffer=nl.psum)
    return ones_sb, acc_psum


def store_loss(out_hbm, acc, loss_sb, t_f_sb, ignore_index, V, r0, p):
    """A row tile's loss, NaN for a target outside [0, V) and 0 for ignored rows (in that order): written per row
    (acc None, reduction "none") or added with the tile's kept rows into acc on TensorE (ones^T [loss, kept])."""
    ign_sb = mark_rows(loss_sb, t_f_sb, ignore_index, V, p)
    nisa.tensor_copy_predicated(dst=loss_sb, src=0.0, predicate=ign_sb)
    if acc == None:  # noqa: E711
        nisa.dma_copy(dst=out_hbm[r0:r0 + p, 0:1], src=loss_sb)
    else:
        ones_sb, acc_psum = acc
        lk_sb = nl.ndarray((p, 2), dtype=nl.float32, buffer=nl.sbuf)  # [loss, kept]
        nisa.tensor_copy(dst=lk_sb[0:p, 0:1], src=loss_sb)
        nisa.tensor_scalar(dst=lk_sb[0:p, 1:2], data=t_f_sb, op0=nl.not_equal, operand0=float(ignore_index))
        nisa.nc_matmul(dst=acc_psum, stationary=ones_sb[0:p, 0:1], moving=lk_sb)


def store_reduced_loss(out_hbm, acc, reduction):
    """out [1, 1] = the sum, or the sum * (1 / kept) for "mean": NaN when every row is ignored (0 * inf), as torch."""
    acc_sb = nl.ndarray((1, 2), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=acc_sb, src=acc[1])
    res_sb = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    if reduction == "sum":
        nisa.tensor_copy(dst=res_sb, src=acc_sb[0:1, 0:1])
    else:
        inv_sb = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=inv_sb, data=acc_sb[0:1, 1:2])
        nisa.tensor_tensor(dst=res_sb, data1=acc_sb[0:1, 0:1], data2=inv_sb, op=nl.multiply)
    nisa.dma_copy(dst=out_hbm, src=res_sb)
