"""cross_entropy on NKI: rows on the 128 partitions, an online logsumexp over vocabulary chunks on the free dimension."""

from __future__ import annotations

import math

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron._loss_rows import (
    column_hits,
    column_iota,
    declines,
    gradient_rows,
    loss_sum,
    mark_rows,
    shared_coefficient,
    store_loss,
    store_reduced_loss,
    target_tile,
    target_tiles,
    targets32,
)
from opport.backends.neuron._softmax_steps import online_step, running_state
from opport.backends.neuron._tiles import cdiv, spans
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.dispatch import impl
from opport.ops.cross_entropy import cross_entropy as spec

FMAX = 8192  # vocabulary chunk: logits chunk, column iota, fp32 exp scratch and predicate <= 104 KiB per partition
RESIDENT_BYTES = 64 * 1024  # the fused kernel keeps a row tile this small in SBUF for its second walk: beside the
# RESIDENT_CHUNK scratch and the column iota (32 KiB) it fits trn1's 176 KiB per partition (bf16 V <= 32768)
RESIDENT_CHUNK = 4096  # both walks' chunk beside a resident row: half FMAX's scratch (float32 exp, one-hot, copies)


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
    return _cross_entropy(logits_hbm, target_hbm, ignore_index, reduction, label_smoothing, False)


@nki.jit
def _cross_entropy_forward_kernel(logits_hbm, target_hbm, ignore_index, reduction, label_smoothing):
    """The training forward: _cross_entropy_kernel's loss plus each row's logsumexp, saved for the backward.

    Dimensions:
        N, V as in _cross_entropy_kernel.

    Args:
        as _cross_entropy_kernel.

    Returns:
        (out_hbm, lse_hbm): the loss as _cross_entropy_kernel's, and lse_hbm float32 [N, 1], the logsumexp of
        every row (whatever its target: -inf for a row of -inf logits, NaN for one holding NaN or +inf).

    Notes:
        The same single pass over the logits: the row's logsumexp is M + log(r e^(m - M) + e^(x_t - M)) with
        M = max(m, x_t), from the running max m and sum r that leave the target column out and the gathered
        target logit x_t, which the smoothed loss already forms. A target outside [0, V) masks no column and
        its clamped x_t is one the sum already holds, so its term is multiplied by 0 (in range: by 1, exact).
        The extra traffic is the [N] float32 lse, which the backward reads instead of a second pass.

    Pseudocode:
        as _cross_entropy_kernel, and per row tile: lse = M + log(r e^(m - M) + [0 <= t < V] e^(x_t - M))
    """
    return _cross_entropy(logits_hbm, target_hbm, ignore_index, reduction, label_smoothing, True)


def _cross_entropy(logits_hbm, target_hbm, ignore_index, reduction, label_smoothing, with_lse, dx_hbm=None,
                   c_all_sb=None, resident=False):
    """The three kernels' body: the loss of every row tile, and its logsumexp when with_lse; with dx_hbm (the
    fused value-and-grad), each row tile's gradient for a unit upstream gradient right after its loss, every
    row scaled by c_all_sb (1, or 1 / kept rows for "mean"); resident: the row tile is loaded into SBUF once and
    both walks read it there."""
    N, V = logits_hbm.shape
    PMAX = nl.tile_size.pmax
    eps = float(label_smoothing)
    p_all = min(PMAX, N)
    out_hbm = nl.ndarray((N, 1) if reduction == "none" else (1, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    if with_lse:
        lse_hbm = nl.ndarray((N, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    cols_sb = column_iota(p_all, min(FMAX, V))
    acc = None if reduction == "none" else loss_sum(p_all)

    for r0, p in spans(N, PMAX):
        t_f_sb = target_tile(target_hbm, r0, p)
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

        row_sb = None
        if resident:  # the whole row tile, read from HBM once for both walks
            row_sb = nl.ndarray((p, V), dtype=logits_hbm.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=row_sb, src=logits_hbm[r0:r0 + p, 0:V])
        # online sum of exp(x_j - m) over the non-target columns (and the row sum for smoothing)
        m_sb, r_sb, sums_sb = _online_sums(logits_hbm, cols_sb, t_f_sb, r0, p, eps, row_sb)

        # loss = softplus(log(r) + m - x_t) [+ eps * (x_t - mean(x))]
        log_r_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=log_r_sb, op=nl.log, data=r_sb)
        gap_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # m - x_t
        nisa.tensor_tensor(dst=gap_sb, data1=m_sb, data2=xt_sb, op=nl.subtract)
        loss_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=loss_sb, op=nl.softplus, data=log_r_sb, bias=gap_sb)
        if eps > 0.0 or with_lse or dx_hbm != None:  # noqa: E711 (the whole row's logsumexp is log_rall + M)
            log_rall_sb, mt_sb, rall_sb = _row_logsumexp(m_sb, r_sb, xt_sb, t_f_sb, V, p)
        if eps > 0.0:  # (1 - eps) nll + eps (logsumexp - mean(x)): both terms >= 0, no inf - inf
            sumx_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=sumx_sb, op=nl.add, data=sums_sb, axis=1, keepdims=True)
            spread_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # M - mean(x)
            nisa.scalar_tensor_tensor(dst=spread_sb, data=sumx_sb, op0=nl.multiply, operand0=-1.0 / V, op1=nl.add,
                                      operand1=mt_sb)
            smooth_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # log(r_all) + M - mean(x)
            nisa.tensor_tensor(dst=smooth_sb, data1=log_rall_sb, data2=spread_sb, op=nl.add)
            nisa.tensor_scalar(dst=smooth_sb, data=smooth_sb, op0=nl.multiply, operand0=eps)
            nisa.scalar_tensor_tensor(dst=loss_sb, data=loss_sb, op0=nl.multiply, operand0=1.0 - eps, op1=nl.add,
                                      operand1=smooth_sb)
        if with_lse:
            lse_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=lse_sb, data1=log_rall_sb, data2=mt_sb, op=nl.add)
            nisa.dma_copy(dst=lse_hbm[r0:r0 + p, 0:1], src=lse_sb)
        if dx_hbm != None:  # noqa: E711 (p = exp(x - M) / r_all: no lse rounded to float32, an ulp of |M|, between)
            c_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=c_sb, src=c_all_sb[0:p, 0:1])
            ign_g_sb = mark_rows(c_sb, t_f_sb, ignore_index, V, p)
            neg_mt_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=neg_mt_sb, data=mt_sb, op0=nl.multiply, operand0=-1.0)
            inv_r_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.reciprocal(dst=inv_r_sb, data=rall_sb)
            for c0, f in spans(V, RESIDENT_CHUNK if resident else FMAX):
                _gradient_chunk(dx_hbm, logits_hbm, cols_sb, t_f_sb, c_sb, neg_mt_sb, ign_g_sb, r0, p, c0, f, eps,
                                inv_r_sb, row_sb)
        store_loss(out_hbm, acc, loss_sb, t_f_sb, ignore_index, V, r0, p)

    if reduction != "none":
        store_reduced_loss(out_hbm, acc, reduction)
    if dx_hbm != None:  # noqa: E711 (NKI kernels compare with None by value)
        return out_hbm, dx_hbm
    return (out_hbm, lse_hbm) if with_lse else out_hbm


def _online_sums(logits_hbm, cols_sb, t_f_sb, r0, p, eps, row_sb=None):
    """(m, r, per-chunk row sums) of a row tile: the running max m and sum r = sum exp(x_j - m) over the
    non-target columns, and each chunk's sum of x for smoothing. A function of its own so that its chunk
    tiles are dead when the fused kernel's gradient pass allocates its own (SBUF holds one set at a time).
    row_sb: the row tile already in SBUF (each chunk copied from it: the target column is overwritten)."""
    V = logits_hbm.shape[1]
    fw = FMAX if row_sb == None else RESIDENT_CHUNK  # noqa: E711 (NKI kernels compare with None by value)
    m_sb, r_sb = running_state(p)
    sums_sb = nl.ndarray((p, cdiv(V, fw)), dtype=nl.float32, buffer=nl.sbuf)
    for c, (c0, f) in enumerate(spans(V, fw)):
        x_sb = nl.ndarray((p, f), dtype=logits_hbm.dtype, buffer=nl.sbuf)
        if row_sb == None:  # noqa: E711
            nisa.dma_copy(dst=x_sb, src=logits_hbm[r0:r0 + p, c0:c0 + f])
        else:
            nisa.tensor_copy(dst=x_sb, src=row_sb[0:p, c0:c0 + f])
        if eps > 0.0:
            nisa.tensor_reduce(dst=sums_sb[0:p, c:c + 1], op=nl.add, data=x_sb, axis=1, keepdims=True)
        hit_sb = column_hits(cols_sb, t_f_sb, c0, p, f, nl.uint8)
        nisa.tensor_copy_predicated(dst=x_sb, src=-math.inf, predicate=hit_sb)
        m_sb = online_step(m_sb, r_sb, x_sb)[0]  # e is dead at once: only its row sum is kept
    return m_sb, r_sb, sums_sb


def _row_logsumexp(m_sb, r_sb, xt_sb, t_f_sb, V, p):
    """(log(r_all), M, r_all), r_all = r e^(m - M) + [0 <= t < V] e^(x_t - M), M = max(m, x_t): the row's
    logsumexp is log(r_all) + M.

    m and r leave the target column out (where the target is in range), x_t is the gathered target logit."""
    mt_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # M = max(m, x_t): the whole row's max
    nisa.tensor_tensor(dst=mt_sb, data1=m_sb, data2=xt_sb, op=nl.maximum)
    neg_mt_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=neg_mt_sb, data=mt_sb, op0=nl.multiply, operand0=-1.0)
    rall_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # r e^(m - M) + e^(x_t - M) [t in range]
    nisa.activation(dst=rall_sb, op=nl.exp, data=m_sb, bias=neg_mt_sb)
    et_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=et_sb, op=nl.exp, data=xt_sb, bias=neg_mt_sb)
    inr_sb = _in_range(t_f_sb, V, p)
    nisa.tensor_tensor(dst=et_sb, data1=et_sb, data2=inr_sb, op=nl.multiply)
    nisa.scalar_tensor_tensor(dst=rall_sb, data=rall_sb, op0=nl.multiply, operand0=r_sb, op1=nl.add, operand1=et_sb)
    log_rall_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=log_rall_sb, op=nl.log, data=rall_sb)
    return log_rall_sb, mt_sb, rall_sb


def _in_range(t_f_sb, V, p):
    """1.0 where 0 <= t < V, else 0.0 (float32 [p, 1])."""
    ge_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=ge_sb, data=t_f_sb, op0=nl.greater_equal, operand0=0.0)
    inr_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=inr_sb, data=t_f_sb, op0=nl.less, operand0=float(V))
    nisa.tensor_tensor(dst=inr_sb, data1=inr_sb, data2=ge_sb, op=nl.multiply)
    return inr_sb


def _supports(logits, target, ignore_index, reduction, label_smoothing):
    return declines(logits.shape[1], ignore_index)


@impl(spec, "neuron", supports=_supports)
def cross_entropy(logits: np.ndarray, target: np.ndarray, ignore_index: int, reduction: str,
                  label_smoothing: float) -> np.ndarray:
    """Host side: targets to int32 (clipped so out-of-range stays out of range), launch, float32 out."""
    n = logits.shape[0]
    if n == 0:  # no rows: nothing to launch; an empty "none", an empty sum (0) and a mean over no kept row (NaN, as torch)
        if reduction == "none":
            return np.empty(0, np.float32)
        return np.full((), 0.0 if reduction == "sum" else np.nan, np.float32)
    out = _host.run(_cross_entropy_kernel, _host.contiguous(logits), targets32(target), int(ignore_index), reduction,
                    float(label_smoothing))
    return _host.as_dtype(out, "float32", (n,) if reduction == "none" else ())


@impl(spec.train_forward, "neuron", supports=_supports)
def cross_entropy_forward(logits: np.ndarray, target: np.ndarray, ignore_index: int, reduction: str,
                          label_smoothing: float) -> tuple:
    """Host side of the training forward: as cross_entropy's, plus the per-row logsumexp [N] (float32)."""
    n = logits.shape[0]
    if n == 0:
        return cross_entropy(logits, target, ignore_index, reduction, label_smoothing), np.empty(0, np.float32)
    out, lse = _host.run(_cross_entropy_forward_kernel, _host.contiguous(logits), targets32(target), int(ignore_index),
                         reduction, float(label_smoothing))
    return (_host.as_dtype(out, "float32", (n,) if reduction == "none" else ()), _host.as_dtype(lse, "float32", (n,)))


# --------------------------------------------------------------------------- backward


@nki.jit
def _cross_entropy_backward_kernel(grad_hbm, logits_hbm, target_hbm, lse_hbm, ignore_index, reduction,
                                   label_smoothing):
    """The gradient of cross_entropy for the logits: c (exp(x - lse) - eps/V - (1 - eps) onehot(t)) per row.

    Dimensions:
        N: rows (tiled by 128 onto the partitions); V: vocabulary (free dim, chunks of FMAX).

    Args:
        grad_hbm: float32 upstream gradient, [N] for "none", else [1].
        logits_hbm: [N, V] in HBM, float32/float16/bfloat16.
        target_hbm: [N] int32 class indices (clipped to +-(2^24 + 1) by the host).
        lse_hbm: [N] float32, the training forward's per-row logsumexp.
        ignore_index, reduction, label_smoothing: compile-time, as in the forward.

    Returns:
        dx_hbm: [N, V] in the logits' dtype; ignored rows exactly 0, rows with a target outside [0, V) NaN.

    Notes:
        One pass over the logits: the softmax comes from the saved lse (one ScalarE exp per chunk with -lse
        as its bias), so the vocabulary is read once and the gradient written once, the minimum traffic. The
        one-hot term is the forward's iota/is_equal column test, folded in by one VectorE instruction, and
        (y - eps/V) * c with the cast to the logits' dtype is one more. Each row's coefficient c is grad[i],
        grad, or grad / (rows not ignored) for "mean": that count sums over every row tile, on TensorE (an
        all-ones stationary against the kept flags accumulates in one PSUM entry on every partition), from
        the targets loaded once before the main loop. A target out of range makes c NaN (the row's loss is
        NaN); ignored rows are overwritten with 0 by a predicated copy, so NaN or inf logits there cannot leak.

    Pseudocode:
        c_all = grad, or grad / max(1, sum over rows of [t != ignore_index])        (TensorE)
        for each 128-row tile:
            c = grad[rows] or c_all; c[t outside [0, V)] = NaN
            for chunk: e = exp(x - lse); y = e - (1 - eps) [col == t]; dx = (y - eps/V) c; dx[ignored] = 0
    """
    N, V = logits_hbm.shape
    dx_hbm = nl.ndarray((N, V), dtype=logits_hbm.dtype, buffer=nl.shared_hbm)
    cols_sb = column_iota(min(nl.tile_size.pmax, N), min(FMAX, V))
    for r0, p, t_f_sb, c_sb, ign_sb, neg_lse_sb in gradient_rows(grad_hbm, target_hbm, lse_hbm, ignore_index,
                                                                 reduction, V):
        for c0, f in spans(V, FMAX):
            _gradient_chunk(dx_hbm, logits_hbm, cols_sb, t_f_sb, c_sb, neg_lse_sb, ign_sb, r0, p, c0, f,
                            float(label_smoothing))
    return dx_hbm


def _gradient_chunk(dx_hbm, logits_hbm, cols_sb, t_f_sb, c_sb, neg_lse_sb, ign_sb, r0, p, c0, f, eps, inv_r_sb=None,
                    row_sb=None):
    """dx[rows, c0:c0+f] = (exp(x - lse) - (1 - eps) [col == t] - eps/V) * c, ignored rows 0; with inv_r_sb, the
    softmax is exp(x - M) * (1 / r_all) (neg_lse_sb holding -M); with row_sb, x is read from that SBUF row tile."""
    V = logits_hbm.shape[1]
    if row_sb == None:  # noqa: E711 (NKI kernels compare with None by value)
        x_sb = nl.ndarray((p, f), dtype=logits_hbm.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_sb, src=logits_hbm[r0:r0 + p, c0:c0 + f])
    else:
        x_sb = row_sb[0:p, c0:c0 + f]
    e_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=e_sb, op=nl.exp, data=x_sb, bias=neg_lse_sb)
    if inv_r_sb != None:  # noqa: E711 (NKI kernels compare with None by value)
        nisa.tensor_scalar(dst=e_sb, data=e_sb, op0=nl.multiply, operand0=inv_r_sb)
    hit_sb = column_hits(cols_sb, t_f_sb, c0, p, f)
    nisa.scalar_tensor_tensor(dst=e_sb, data=hit_sb, op0=nl.multiply, operand0=eps - 1.0, op1=nl.add, operand1=e_sb)
    dx_sb = nl.ndarray((p, f), dtype=logits_hbm.dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=dx_sb, data=e_sb, op0=nl.subtract, operand0=eps / V, op1=nl.multiply, operand1=c_sb)
    nisa.tensor_copy_predicated(dst=dx_sb, src=0.0, predicate=ign_sb.broadcast(1, f))
    nisa.dma_copy(dst=dx_hbm[r0:r0 + p, c0:c0 + f], src=dx_sb)


def _supports_backward(grad, logits, target, lse, ignore_index, reduction, label_smoothing):
    return _supports(logits, target, ignore_index, reduction, label_smoothing)


@impl(spec.backward_op, "neuron", supports=_supports_backward)
def cross_entropy_backward(grad: np.ndarray, logits: np.ndarray, target: np.ndarray, lse: np.ndarray,
                           ignore_index: int, reduction: str, label_smoothing: float) -> tuple:
    """Host side: grad as a float32 vector ([N], or [1] for a reduced loss), targets to int32, launch."""
    if logits.shape[0] == 0:
        return (np.empty(logits.shape, logits.dtype),)
    g = _host.contiguous(np.asarray(grad, np.float32).reshape(-1))
    dx = _host.run(_cross_entropy_backward_kernel, g, _host.contiguous(logits), targets32(target),
                   _host.contiguous(lse), int(ignore_index), reduction, float(label_smoothing))
    return (_host.as_dtype(dx, logits.dtype.name, logits.shape),)


# --------------------------------------------------------------------------- forward fused with the backward


@nki.jit
def _cross_entropy_value_and_grad_kernel(logits_hbm, target_hbm, ignore_index, reduction, label_smoothing, resident):
    """The loss and dlogits for a unit upstream gradient, each row tile's gradient written right after its loss.

    Dimensions:
        N: rows (tiled by 128 onto the partitions); V: vocabulary (free dim, chunks of FMAX).

    Args:
        as _cross_entropy_kernel, and
        resident: compile-time; True when a row tile (V x itemsize bytes per partition) fits RESIDENT_BYTES.

    Returns:
        (out_hbm, dx_hbm): the loss as _cross_entropy_kernel's, and dx_hbm [N, V] in the logits' dtype, the
        backward kernel's result for grad = 1: ignored rows exactly 0, rows with a target outside [0, V) NaN.

    Notes:
        The forward's single pass per row tile (running max m and sum r, the gathered target logit), then a
        second walk over the same tile's chunks writes c (exp(x - M) / r_all - (1 - eps) [col == t] - eps/V)
        with M and r_all from _row_logsumexp: no float32 lse sits between them, so p keeps its relative
        accuracy at large logits. c is 1, or 1 / (rows not ignored) for "mean", counted on TensorE from the
        targets before the first tile (as the backward's shared_coefficient with a unit gradient). Memory
        traffic: with a resident row tile (V x itemsize <= 64 KiB per partition: bf16 V <= 32768) the logits
        are read from HBM once and dlogits written once, the minimum; a larger vocabulary is read twice (SBUF
        holds one FMAX chunk, not the 128 x V tile), what the training forward plus the backward read, less
        the lse round trip.

    Pseudocode:
        c = 1, or 1 / max(1, sum over rows of [t != ignore_index])                    (TensorE)
        for each 128-row tile:
            loss as _cross_entropy_kernel (M, r_all from the same pass)
            for chunk: e = exp(x - M) / r_all; dx = (e - (1 - eps) [col == t] - eps/V) c; dx[ignored] = 0
    """
    N, V = logits_hbm.shape
    dx_hbm = nl.ndarray((N, V), dtype=logits_hbm.dtype, buffer=nl.shared_hbm)
    t_tiles = target_tiles(target_hbm)
    c_all_sb = shared_coefficient(None, t_tiles, reduction == "mean", ignore_index, t_tiles[0].shape[0])
    return _cross_entropy(logits_hbm, target_hbm, ignore_index, reduction, label_smoothing, False, dx_hbm, c_all_sb,
                          resident)


@impl(spec.value_and_grad_op, "neuron", supports=_supports)
def cross_entropy_value_and_grad(logits: np.ndarray, target: np.ndarray, ignore_index: int, reduction: str,
                                 label_smoothing: float) -> tuple:
    """Host side of the fused value-and-grad: the loss (float32) and dlogits [N, V] in the logits' dtype."""
    n = logits.shape[0]
    if n == 0:
        return cross_entropy(logits, target, ignore_index, reduction, label_smoothing), np.empty(logits.shape,
                                                                                                 logits.dtype)
    resident = logits.shape[1] * logits.dtype.itemsize <= RESIDENT_BYTES
    out, dx = _host.run(_cross_entropy_value_and_grad_kernel, _host.contiguous(logits), targets32(target),
                        int(ignore_index), reduction, float(label_smoothing), resident)
    return (_host.as_dtype(out, "float32", (n,) if reduction == "none" else ()),
            _host.as_dtype(dx, logits.dtype.name, logits.shape))
