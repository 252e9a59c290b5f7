"""cross_entropy on NKI: rows on the 128 partitions, an online logsumexp over vocabulary chunks on the free dimension."""

from __future__ import annotations

import math

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.dispatch import impl
from opport.ops.cross_entropy import cross_entropy as spec

FMAX = 8192  # vocabulary chunk: logits chunk, column iota, fp32 exp scratch and predicate <= 104 KiB per partition
NEG_BIG = -3.4028234663852886e38  # -FLT_MAX: a finite start for the running max, so exp(m_old - m_new) is never NaN
EXACT = 1 << 24  # integers up to 2^24 are exact in float32, where VectorE compares the targets
TARGET_CLIP = EXACT + 1  # targets are clipped to +-(2^24 + 1) on the host: still outside [0, V), still != ignore_index


@nki.jit
def _cross_entropy_kernel(logits_hbm, target_hbm, ignore_index, reduction, label_smoothing):
    """Softmax cross-entropy of [N, V] logits against int32 targets [N], float32 result.

    Dimensions:
        N: rows (tiled by 128 onto the partitions); V: vocabulary (free dim, chunks of FMAX).

    Args:
        logits_hbm: [N, V] in HBM, float32/float16/bfloat16.
        target_hbm: [N] int32 class indices (clipped to +-(2^24 + 1) by the host).
        ignore_index: compile-time int; rows with this target count 0 and leave the mean's count.
        reduction: compile-time "none" | "sum" | "mean".
        label_smoothing: compile-time float eps in [0, 1].

    Returns:
        out_hbm: float32 [N, 1] for "none", else [1, 1].

    Notes:
        The loss is log(1 + r / e_t) with r = sum over j != t of exp(x_j - m) and e_t = exp(x_t - m),
        evaluated as softplus(log(r) + m - x_t): a peaked row (loss ~ 1e-10) keeps its relative
        accuracy, where logsumexp - x_t would round 1 + 1e-10 to 1 and give 0. One pass over the
        logits: per chunk, an iota/is_equal predicate and a predicated copy put -inf at the target
        column, VectorE takes the chunk max, the running max m starts at -FLT_MAX (no
        exp(-inf + inf) NaN when leading chunks are all -inf), and one ScalarE activation computes
        exp(x - m') with its row sum, added to the running sum rescaled by exp(m - m'). The target
        logit itself comes from one indirect DMA per row tile at flat offset row * V + clamp(t, 0, V-1).
        Smoothing gives (1-eps) nll + eps (logsumexp - mean(x)), logsumexp = M + log(r e^(m-M) + e^(x_t-M))
        with M = max(m, x_t) (m leaves the target column out): both terms
        are >= 0, where the shorter nll + eps (x_t - mean(x)) is -inf - -inf = NaN for a -inf target logit
        in a row holding -inf (the loss is inf).
        Out-of-range targets become NaN and ignored rows 0 through predicated copies. "sum"/"mean"
        reduce across partitions on TensorE: a ones column times [loss, kept] accumulates over all row
        tiles in one PSUM entry; mean = sum * (1 / count), NaN when every row is ignored (0 * inf).

    Pseudocode:
        for each 128-row tile:
            x_t = logits[row, clamp(t, 0, V-1)]                      (indirect DMA)
            m = -FLT_MAX; r = 0
            for chunk c: x_c[t] = -inf; m' = max(m, max(x_c)); r = r * exp(m - m') + sum(exp(x_c - m')); m = m'
            loss = softplus(log(r) + m - x_t); smoothing: M = max(m, x_t),
                loss = (1 - eps) loss + eps (M + log(r e^(m - M) + e^(x_t - M)) - mean(x))
            loss[t outside [0, V)] = NaN; loss[t == ignore_index] = 0
            none: out[rows] = loss; else acc += [sum(loss), count(t != ignore_index)]
        sum: out = acc[0]; mean: out = acc[0] / acc[1]
    """
    N, V = logits_hbm.shape
    PMAX = nl.tile_size.pmax
    n_chunks = (V + FMAX - 1) // FMAX
    F0 = min(FMAX, V)
    eps = float(label_smoothing)
    per_row = reduction == "none"
    p_all = min(PMAX, N)
    out_hbm = nl.ndarray((N, 1) if per_row else (1, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    cols_sb = nl.ndarray((p_all, F0), dtype=nl.float32, buffer=nl.sbuf)  # 0..F0-1 on every partition
    nisa.iota(dst=cols_sb, pattern=[[1, F0]], offset=0, channel_multiplier=0)
    if not per_row:
        ones_sb = nl.ndarray((p_all, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=ones_sb, value=1.0)
        acc_psum = nl.ndarray((1, 2), dtype=nl.float32, buffer=nl.psum)

    for r0 in range(0, N, PMAX):
        p = min(PMAX, N - r0)
        # targets, as int32 and as float32 (exact: |t| <= 2^24 + 1)
        t_i_sb = nl.ndarray((p, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t_i_sb, src=target_hbm[r0:r0 + p])
        t_f_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=t_f_sb, src=t_i_sb)
        # target logit: flat index row * V + clamp(t, 0, V - 1), gathered by one indirect DMA
        tc_sb = nl.ndarray((p, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=tc_sb, data=t_f_sb, op0=nl.maximum, operand0=0.0, op1=nl.minimum, operand1=float(V - 1))
        row_sb = nl.ndarray((p, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.iota(dst=row_sb, pattern=[[0, 1]], offset=0, channel_multiplier=V)
        flat_sb = nl.ndarray((p, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=flat_sb, data1=row_sb, data2=tc_sb, op=nl.add)
        xt_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=xt_sb, src=logits_hbm.ap(pattern=[[1, p], [1, 1]], offset=r0 * V, vector_offset=flat_sb,
                                                   indirect_dim=0))

        # online sum of exp(x_j - m) over the non-target columns (and the row sum for smoothing)
        m_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=m_sb, value=NEG_BIG)
        r_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=r_sb, value=0.0)
        sums_sb = nl.ndarray((p, n_chunks), dtype=nl.float32, buffer=nl.sbuf)
        for c in range(n_chunks):
            c0 = c * FMAX
            f = min(FMAX, V - c0)
            x_sb = nl.ndarray((p, f), dtype=logits_hbm.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_sb, src=logits_hbm[r0:r0 + p, c0:c0 + f])
            if eps > 0.0:
                nisa.tensor_reduce(dst=sums_sb[0:p, c:c + 1], op=nl.add, data=x_sb, axis=1, keepdims=True)
            hit_sb = nl.ndarray((p, f), dtype=nl.uint8, buffer=nl.sbuf)  # column c0 + i == t
            nisa.tensor_scalar(dst=hit_sb, data=cols_sb[0:p, 0:f], op0=nl.add, operand0=float(c0), op1=nl.equal,
                               operand1=t_f_sb)
            nisa.tensor_copy_predicated(dst=x_sb, src=-math.inf, predicate=hit_sb)
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
            nisa.scalar_tensor_tensor(dst=r_sb, data=r_sb, op0=nl.multiply, operand0=corr_sb, op1=nl.add, operand1=csum_sb)
            m_sb = m_new_sb

        # loss = softplus(log(r) + m - x_t) [+ eps * (x_t - mean(x))]
        log_r_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=log_r_sb, op=nl.log, data=r_sb)
        gap_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # m - x_t
        nisa.tensor_tensor(dst=gap_sb, data1=m_sb, data2=xt_sb, op=nl.subtract)
        loss_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=loss_sb, op=nl.softplus, data=log_r_sb, bias=gap_sb)
        if eps > 0.0:  # (1 - eps) nll + eps (logsumexp - mean(x)): both terms >= 0, no inf - inf
            sumx_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=sumx_sb, op=nl.add, data=sums_sb, axis=1, keepdims=True)
            mt_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # M = max(m, x_t): the whole row's max
            nisa.tensor_tensor(dst=mt_sb, data1=m_sb, data2=xt_sb, op=nl.maximum)
            neg_mt_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=neg_mt_sb, data=mt_sb, op0=nl.multiply, operand0=-1.0)
            rall_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # r e^(m - M) + e^(x_t - M)
            nisa.activation(dst=rall_sb, op=nl.exp, data=m_sb, bias=neg_mt_sb)
            et_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=et_sb, op=nl.exp, data=xt_sb, bias=neg_mt_sb)
            nisa.scalar_tensor_tensor(dst=rall_sb, data=rall_sb, op0=nl.multiply, operand0=r_sb, op1=nl.add,
                                      operand1=et_sb)
            smooth_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # log(r_all) + M - mean(x)
            nisa.activation(dst=smooth_sb, op=nl.log, data=rall_sb)
            spread_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # M - mean(x)
            nisa.scalar_tensor_tensor(dst=spread_sb, data=sumx_sb, op0=nl.multiply, operand0=-1.0 / V, op1=nl.add,
                                      operand1=mt_sb)
            nisa.tensor_tensor(dst=smooth_sb, data1=smooth_sb, data2=spread_sb, op=nl.add)
            nisa.tensor_scalar(dst=smooth_sb, data=smooth_sb, op0=nl.multiply, operand0=eps)
            nisa.scalar_tensor_tensor(dst=loss_sb, data=loss_sb, op0=nl.multiply, operand0=1.0 - eps, op1=nl.add,
                                      operand1=smooth_sb)

        # NaN for a target outside [0, V) that is not ignore_index, 0 for ignored rows (in that order)
        below_sb = nl.ndarray((p, 1), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=below_sb, data=t_f_sb, op0=nl.less, operand0=0.0)
        nisa.tensor_copy_predicated(dst=loss_sb, src=math.nan, predicate=below_sb)
        above_sb = nl.ndarray((p, 1), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=above_sb, data=t_f_sb, op0=nl.greater_equal, operand0=float(V))
        nisa.tensor_copy_predicated(dst=loss_sb, src=math.nan, predicate=above_sb)
        ign_sb = nl.ndarray((p, 1), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=ign_sb, data=t_f_sb, op0=nl.equal, operand0=float(ignore_index))
        nisa.tensor_copy_predicated(dst=loss_sb, src=0.0, predicate=ign_sb)

        if per_row:
            nisa.dma_copy(dst=out_hbm[r0:r0 + p, 0:1], src=loss_sb)
        else:
            lk_sb = nl.ndarray((p, 2), dtype=nl.float32, buffer=nl.sbuf)  # [loss, kept]
            nisa.tensor_copy(dst=lk_sb[0:p, 0:1], src=loss_sb)
            nisa.tensor_scalar(dst=lk_sb[0:p, 1:2], data=t_f_sb, op0=nl.not_equal, operand0=float(ignore_index))
            nisa.nc_matmul(dst=acc_psum, stationary=ones_sb[0:p, 0:1], moving=lk_sb)

    if not per_row:
        acc_sb = nl.ndarray((1, 2), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=acc_sb, src=acc_psum)
        res_sb = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
        if reduction == "sum":
            nisa.tensor_copy(dst=res_sb, src=acc_sb[0:1, 0:1])
        else:
            inv_sb = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.reciprocal(dst=inv_sb, data=acc_sb[0:1, 1:2])
            nisa.tensor_tensor(dst=res_sb, data1=acc_sb[0:1, 0:1], data2=inv_sb, op=nl.multiply)
        nisa.dma_copy(dst=out_hbm, src=res_sb)
    return out_hbm


def _supports(logits, target, ignore_index, reduction, label_smoothing):
    if logits.shape[1] > EXACT:
        return f"vocabulary {logits.shape[1]} > 2^24: class indices are compared in float32, exact only up to 2^24"
    if abs(int(ignore_index)) > EXACT:
        return f"|ignore_index| = {abs(int(ignore_index))} > 2^24: compared in float32, exact only up to 2^24"
    return None


@impl(spec, "neuron", dtypes=("float32", "float16", "bfloat16"), supports=_supports)
def cross_entropy(logits: np.ndarray, target: np.ndarray, ignore_index: int, reduction: str,
                  label_smoothing: float) -> np.ndarray:
    """Host side: targets to int32 (clipped so out-of-range stays out of range), launch, float32 out."""
    n = logits.shape[0]
    if n == 0:  # no rows: nothing to launch; an empty "none", an empty sum (0) and a mean over no kept row (NaN, as torch)
        if reduction == "none":
            return np.empty(0, np.float32)
        return np.full((), 0.0 if reduction == "sum" else np.nan, np.float32)
    t32 = np.clip(target.astype(np.int64), -TARGET_CLIP, TARGET_CLIP).astype(np.int32)
    out = _host.run(_cross_entropy_kernel, _host.contiguous(logits), t32, int(ignore_index), reduction,
                    float(label_smoothing))
    return _host.as_dtype(out, "float32", (n,) if reduction == "none" else ())
