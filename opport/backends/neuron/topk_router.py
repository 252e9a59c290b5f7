"""topk_router on NKI: token rows on the partitions, experts on the free dim; k passes of a VectorE max and an iota
min (the lowest index among the row's best) choose the experts."""

from __future__ import annotations

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron._tiles import load_row_broadcast, spans
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.dispatch import impl
from opport.ops.topk_router import topk_router as spec

E_MAX = 2048  # experts per row: about twelve [128, E] float32 tiles live, 8 KiB per partition each at E = 2048
BIG = 1048576.0  # 2^20 > any expert index: iota + BIG marks a column out of the running; sums stay exact in float32
NEG_INF = float("-inf")  # the key of a chosen (or NaN) expert: below every number, so max skips it


def _scores(x_sb, p, E, sigmoid):
    """sigmoid(x) in float32 (ScalarE), or None for softmax scoring."""
    if not sigmoid:
        return None
    s_sb = nl.ndarray((p, E), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=s_sb, op=nl.sigmoid, data=x_sb)
    return s_sb


def _expert_ids(p, E):
    """[p, E] float32: each column's expert index (exact), the same on every partition."""
    ids_sb = nl.ndarray((p, E), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=ids_sb, pattern=[[1, E]], offset=0, channel_multiplier=0)
    return ids_sb


def _lowest(ids_sb, mask_sb, p, E):
    """[p, 1] float32: the lowest expert index where mask (0/1) is 1, else BIG: min(ids + BIG (1 - mask))."""
    off_sb = nl.ndarray((p, E), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=off_sb, data=mask_sb, op0=nl.multiply, operand0=-BIG, op1=nl.add, operand1=BIG)
    nisa.tensor_tensor(dst=off_sb, data1=off_sb, data2=ids_sb, op=nl.add)
    low_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=low_sb, op=nl.minimum, data=off_sb, axis=1)
    return low_sb


@nki.jit
def _topk_router_kernel(x_hbm, bias_hbm, k, renormalize, sigmoid, biased):
    """Each token's k best experts and their weights, best first; tokens on the partitions.

    Dimensions:
        T: tokens (tiled by 128 onto the partitions); E: experts (free dim, <= E_MAX); k: experts per token.

    Args:
        x_hbm: [T, E] router logits, float32/float16/bfloat16.
        bias_hbm: [E] float32 bias of the sigmoid ranking (read only when biased).
        k, renormalize, sigmoid, biased: compile-time choices (see topk_router).

    Returns:
        w_hbm: [T, k] weights in x's dtype; idx_hbm: [T, k] int32 expert indices.

    Notes:
        The ranking key is the logit (softmax, unbiased sigmoid: the order of their exact scores) or sigmoid(x) +
        bias (the bias row replicated on the partitions by a K = 1 matmul). NaN keys rank first: a 0/1 NaN mask,
        and each pass takes the lowest untaken NaN if there is one. Otherwise the pass's VectorE max over the keys
        (NaN and taken keys set to -inf) and, among the untaken experts equal to it, the lowest index from an iota
        row (min of ids + BIG off-candidates): lowest index on ties, -0 == +0, -inf experts in index order once
        nothing larger is left. The chosen expert is then taken (its key -inf, its alive bit 0) and its logit read
        by a predicated copy onto zeros and an add reduction (one term: exact, NaN and inf kept). Weights in
        float32 from the chosen logits: exp(v - max) / sum (ScalarE exp with its row sum), or exp(v - v_0)
        renormalized, or sigmoid(v) (renormalized by its sum); one rounding to x's dtype. Logits read once, outputs
        written once.

    Pseudocode:
        for each 128-token tile: key = x or sigmoid(x) + bias; alive = 1
            for j < k: i = lowest alive NaN, else lowest alive argmax(key); v_j = x[i]; take i
            w = f(v); store w, i
    """
    T, E = x_hbm.shape
    w_hbm = nl.ndarray((T, k), dtype=x_hbm.dtype, buffer=nl.shared_hbm)
    idx_hbm = nl.ndarray((T, k), dtype=nl.int32, buffer=nl.shared_hbm)
    for t0, p in spans(T, nl.tile_size.pmax):
        x_sb = nl.ndarray((p, E), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_sb, src=x_hbm[t0:t0 + p, 0:E])
        s_sb = _scores(x_sb, p, E, sigmoid)
        key_sb = nl.ndarray((p, E), dtype=nl.float32, buffer=nl.sbuf)
        if biased:
            bias_sb = nl.ndarray((p, E), dtype=nl.float32, buffer=nl.sbuf)
            load_row_broadcast(bias_sb, bias_hbm, 0, E, p)
            nisa.tensor_tensor(dst=key_sb, data1=s_sb, data2=bias_sb, op=nl.add)
        else:
            nisa.tensor_copy(dst=key_sb, src=x_sb)
        ids_sb = _expert_ids(p, E)
        nan_sb = nl.ndarray((p, E), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=nan_sb, data1=key_sb, data2=key_sb, op=nl.not_equal)
        nisa.tensor_copy_predicated(dst=key_sb, src=NEG_INF, predicate=nan_sb)
        nan_alive_sb = nl.ndarray((p, E), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=nan_alive_sb, src=nan_sb)
        alive_sb = nl.ndarray((p, E), dtype=nl.float32, buffer=nl.sbuf)  # untaken numbers (NaN keys have their own)
        nisa.tensor_scalar(dst=alive_sb, data=nan_alive_sb, op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=1.0)
        idxf_sb = nl.ndarray((p, k), dtype=nl.float32, buffer=nl.sbuf)
        v_sb = nl.ndarray((p, k), dtype=nl.float32, buffer=nl.sbuf)
        for j in range(k):
            nan_low_sb = _lowest(ids_sb, nan_alive_sb, p, E)
            best_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=best_sb, op=nl.maximum, data=key_sb, axis=1)
            cand_sb = nl.ndarray((p, E), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=cand_sb, data=key_sb, op0=nl.equal, operand0=best_sb)
            nisa.tensor_tensor(dst=cand_sb, data1=cand_sb, data2=alive_sb, op=nl.multiply)
            num_low_sb = _lowest(ids_sb, cand_sb, p, E)
            # a NaN left (nan_low < BIG) wins: i = num_low + [nan_low < BIG] (nan_low - num_low), exact small integers
            has_nan_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=has_nan_sb, data=nan_low_sb, op0=nl.less, operand0=BIG)
            step_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=step_sb, data1=nan_low_sb, data2=num_low_sb, op=nl.subtract)
            nisa.scalar_tensor_tensor(dst=idxf_sb[0:p, j:j + 1], data=step_sb, op0=nl.multiply, operand0=has_nan_sb,
                                      op1=nl.add, operand1=num_low_sb)
            hit_sb = nl.ndarray((p, E), dtype=nl.uint8, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=hit_sb, data=ids_sb, op0=nl.equal, operand0=idxf_sb[0:p, j:j + 1])
            pick_sb = nl.ndarray((p, E), dtype=nl.float32, buffer=nl.sbuf)  # the chosen logit among zeros: its sum
            nisa.memset(dst=pick_sb, value=0.0)
            nisa.tensor_copy_predicated(dst=pick_sb, src=x_sb, predicate=hit_sb)
            nisa.tensor_reduce(dst=v_sb[0:p, j:j + 1], op=nl.add, data=pick_sb, axis=1)
            nisa.tensor_copy_predicated(dst=key_sb, src=NEG_INF, predicate=hit_sb)
            nisa.tensor_copy_predicated(dst=alive_sb, src=0.0, predicate=hit_sb)
            nisa.tensor_copy_predicated(dst=nan_alive_sb, src=0.0, predicate=hit_sb)
        w_sb = _weights(x_sb, v_sb, p, E, k, renormalize, sigmoid)
        wo_sb = nl.ndarray((p, k), dtype=x_hbm.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=wo_sb, src=w_sb)
        nisa.dma_copy(dst=w_hbm[t0:t0 + p, 0:k], src=wo_sb)
        io_sb = nl.ndarray((p, k), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=io_sb, src=idxf_sb)
        nisa.dma_copy(dst=idx_hbm[t0:t0 + p, 0:k], src=io_sb)
    return w_hbm, idx_hbm


def _neg(v_sb, p):
    """-v for a [p, 1] tile (an exp bias)."""
    n_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=n_sb, data=v_sb, op0=nl.multiply, operand0=-1.0)
    return n_sb


def _scale_rows(w_sb, total_sb, p):
    """w / total per row, as the reciprocal times w (VectorE's reciprocal; no divide on hardware)."""
    inv_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=inv_sb, data=total_sb)
    nisa.tensor_scalar(dst=w_sb, data=w_sb, op0=nl.multiply, operand0=inv_sb)


def _weights(x_sb, v_sb, p, E, k, renormalize, sigmoid):
    """float32 [p, k] weights of the chosen logits v (the reference's formulas, see the kernel)."""
    w_sb = nl.ndarray((p, k), dtype=nl.float32, buffer=nl.sbuf)
    total_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    if sigmoid:
        nisa.activation(dst=w_sb, op=nl.sigmoid, data=v_sb, reduce_op=nl.add, reduce_res=total_sb,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
    elif renormalize:  # exp(v - v_0): v_0 is the first chosen, the row's max (or NaN/inf: the row's NaN anyway)
        nisa.activation(dst=w_sb, op=nl.exp, data=v_sb, bias=_neg(v_sb[0:p, 0:1], p), reduce_op=nl.add,
                        reduce_res=total_sb, reduce_cmd=nisa.reduce_cmd.reset_reduce)
    else:
        m_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=m_sb, op=nl.maximum, data=x_sb, axis=1)
        neg_m_sb = _neg(m_sb, p)
        z_sb = nl.ndarray((p, E), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=z_sb, op=nl.exp, data=x_sb, bias=neg_m_sb, reduce_op=nl.add, reduce_res=total_sb,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.activation(dst=w_sb, op=nl.exp, data=v_sb, bias=neg_m_sb)
    if renormalize or not sigmoid:
        _scale_rows(w_sb, total_sb, p)
    return w_sb


@nki.jit
def _topk_router_backward_kernel(g_hbm, x_hbm, idx_hbm, renormalize, sigmoid):
    """dlogits of topk_router from the upstream gradient of its weights and its indices; tokens on the partitions.

    Dimensions:
        T: tokens (tiled by 128); E: experts (free dim, <= E_MAX); k: experts per token.

    Args:
        g_hbm: [T, k] upstream gradient of the weights, x's dtype.
        x_hbm: [T, E] the forward's logits, float32/float16/bfloat16.
        idx_hbm: [T, k] int32 the forward's indices (k distinct experts in [0, E), checked on the host).
        renormalize, sigmoid: compile-time, as the forward's.

    Returns:
        d_hbm: [T, E] in x's dtype.

    Notes:
        G, the upstream gradient on the chosen experts ([T, E], 0 elsewhere), and the chosen mask come from k
        compares of an iota row with the indices and predicated copies (a NaN or inf gradient stays at its
        expert). Then the reference's formulas in float32: softmax p (G - c), c = sum(G p); renormalized
        w (G - c) on the chosen (w = exp(x - top) / sum over the chosen); sigmoid s s(-x) G, renormalized
        s s(-x) (G - c) / S on the chosen (s(-x) = 1 - s without its cancellation). Off the chosen experts a
        predicated copy writes exact zeros. Logits and indices read once, dlogits written once.

    Pseudocode:
        for each 128-token tile: G, chosen = scatter(g, idx); scores from x; c = sum(G w); d = slope (G - c)
    """
    T, E = x_hbm.shape
    k = g_hbm.shape[1]
    d_hbm = nl.ndarray((T, E), dtype=x_hbm.dtype, buffer=nl.shared_hbm)
    for t0, p in spans(T, nl.tile_size.pmax):
        x_sb = nl.ndarray((p, E), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_sb, src=x_hbm[t0:t0 + p, 0:E])
        g_sb = nl.ndarray((p, k), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=g_sb, src=g_hbm[t0:t0 + p, 0:k])
        idx_sb = nl.ndarray((p, k), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=idx_sb, src=idx_hbm[t0:t0 + p, 0:k])
        idxf_sb = nl.ndarray((p, k), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=idxf_sb, src=idx_sb)
        ids_sb = _expert_ids(p, E)
        big_g_sb = nl.ndarray((p, E), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=big_g_sb, value=0.0)
        chosen_sb = nl.ndarray((p, E), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.memset(dst=chosen_sb, value=0)
        for j in range(k):
            hit_sb = nl.ndarray((p, E), dtype=nl.uint8, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=hit_sb, data=ids_sb, op0=nl.equal, operand0=idxf_sb[0:p, j:j + 1])
            nisa.tensor_copy_predicated(dst=big_g_sb, src=g_sb[0:p, j:j + 1].broadcast(1, E), predicate=hit_sb)
            nisa.tensor_tensor(dst=chosen_sb, data1=chosen_sb, data2=hit_sb, op=nl.maximum)
        d_sb = _dlogits(x_sb, big_g_sb, chosen_sb, p, E, renormalize, sigmoid)
        do_sb = nl.ndarray((p, E), dtype=x_hbm.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=do_sb, src=d_sb)
        nisa.dma_copy(dst=d_hbm[t0:t0 + p, 0:E], src=do_sb)
    return d_hbm


def _row_sum(data_sb, chosen_sb, p, E):
    """[p, 1]: the sum of data over the chosen experts (a predicated copy onto zeros, then an add reduction)."""
    on_sb = nl.ndarray((p, E), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=on_sb, value=0.0)
    nisa.tensor_copy_predicated(dst=on_sb, src=data_sb, predicate=chosen_sb)
    total_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=total_sb, op=nl.add, data=on_sb, axis=1)
    return total_sb


def _dlogits(x_sb, big_g_sb, chosen_sb, p, E, renormalize, sigmoid):
    """float32 [p, E] dlogits (see _topk_router_backward_kernel)."""
    d_sb = nl.ndarray((p, E), dtype=nl.float32, buffer=nl.sbuf)
    slope_sb = nl.ndarray((p, E), dtype=nl.float32, buffer=nl.sbuf)
    centred_sb = nl.ndarray((p, E), dtype=nl.float32, buffer=nl.sbuf)
    prod_sb = nl.ndarray((p, E), dtype=nl.float32, buffer=nl.sbuf)
    if sigmoid:
        s_sb = nl.ndarray((p, E), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=s_sb, op=nl.sigmoid, data=x_sb)
        nisa.activation(dst=slope_sb, op=nl.sigmoid, data=x_sb, scale=-1.0)
        nisa.tensor_tensor(dst=slope_sb, data1=slope_sb, data2=s_sb, op=nl.multiply)
        if renormalize:
            total_sb = _row_sum(s_sb, chosen_sb, p, E)
            inv_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.reciprocal(dst=inv_sb, data=total_sb)
            nisa.tensor_tensor(dst=prod_sb, data1=big_g_sb, data2=s_sb, op=nl.multiply)
            c_sb = _row_sum(prod_sb, chosen_sb, p, E)
            nisa.tensor_scalar(dst=c_sb, data=c_sb, op0=nl.multiply, operand0=inv_sb)
            nisa.tensor_scalar(dst=centred_sb, data=big_g_sb, op0=nl.subtract, operand0=c_sb)
            nisa.tensor_tensor(dst=centred_sb, data1=centred_sb, data2=slope_sb, op=nl.multiply)
            nisa.tensor_scalar(dst=centred_sb, data=centred_sb, op0=nl.multiply, operand0=inv_sb)
        else:
            nisa.tensor_tensor(dst=centred_sb, data1=slope_sb, data2=big_g_sb, op=nl.multiply)
    else:
        m_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        if renormalize:  # the max over the chosen logits (the others as -inf)
            xm_sb = nl.ndarray((p, E), dtype=nl.float32, buffer=nl.sbuf)
            nisa.memset(dst=xm_sb, value=NEG_INF)
            nisa.tensor_copy_predicated(dst=xm_sb, src=x_sb, predicate=chosen_sb)
            nisa.tensor_reduce(dst=m_sb, op=nl.maximum, data=xm_sb, axis=1)
            z_src = xm_sb
        else:
            nisa.tensor_reduce(dst=m_sb, op=nl.maximum, data=x_sb, axis=1)
            z_src = x_sb
        neg_m_sb = _neg(m_sb, p)
        total_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=slope_sb, op=nl.exp, data=z_src, bias=neg_m_sb, reduce_op=nl.add, reduce_res=total_sb,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        _scale_rows(slope_sb, total_sb, p)  # p (softmax) or w (renormalized over the chosen)
        nisa.tensor_tensor(dst=prod_sb, data1=big_g_sb, data2=slope_sb, op=nl.multiply)
        c_sb = _row_sum(prod_sb, chosen_sb, p, E)
        nisa.tensor_scalar(dst=centred_sb, data=big_g_sb, op0=nl.subtract, operand0=c_sb)
        nisa.tensor_tensor(dst=centred_sb, data1=centred_sb, data2=slope_sb, op=nl.multiply)
        if not renormalize:
            return centred_sb
    nisa.memset(dst=d_sb, value=0.0)
    nisa.tensor_copy_predicated(dst=d_sb, src=centred_sb, predicate=chosen_sb)
    return d_sb


def _supports(logits, k, renormalize, scoring, bias):
    if logits.shape[1] > E_MAX:
        return f"E = {logits.shape[1]} experts: a row of [128, E] float32 tiles is held in SBUF (at most {E_MAX})"
    return None


@impl(spec, "neuron", supports=_supports)
def topk_router(logits: np.ndarray, k: int, renormalize: bool, scoring: str, bias):
    """Host side: contiguous logits, the bias as float32 (a zero-length placeholder when there is none), launch."""
    t = logits.shape[0]
    if t == 0:
        return np.empty((0, k), logits.dtype), np.empty((0, k), np.int32)
    b = _host.contiguous(bias) if bias is not None else np.zeros(logits.shape[1], np.float32)
    w, idx = _host.run(_topk_router_kernel, _host.contiguous(logits), b, int(k), bool(renormalize),
                       scoring == "sigmoid", bias is not None)
    return _host.as_dtype(w, logits.dtype.name, (t, k)), _host.as_dtype(idx, "int32", (t, k))


@impl(spec.backward_op, "neuron", supports=lambda grad_weights, logits, indices, k, renormalize, scoring:
      _supports(logits, k, renormalize, scoring, None))
def topk_router_backward(grad_weights: np.ndarray, logits: np.ndarray, indices: np.ndarray, k: int, renormalize: bool,
                         scoring: str):
    """Host side: contiguous grad_weights, logits and indices, launch."""
    if logits.shape[0] == 0:
        return (np.empty(logits.shape, logits.dtype),)
    d = _host.run(_topk_router_backward_kernel, _host.contiguous(grad_weights), _host.contiguous(logits),
                  _host.contiguous(indices), bool(renormalize), scoring == "sigmoid")
    return (_host.as_dtype(d, logits.dtype.name, logits.shape),)
