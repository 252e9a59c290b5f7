"""sample on NKI (and sampling_probs, whose file launches this kernel): rows on the partitions, the vocabulary on
the free dim, no sort.

Every filter keeps a prefix of the row's order (descending logit, ties to the lowest index), so each is a pair of
thresholds, a logit value and an index among the tokens tied at it, found by radix searches: the value's 32 bits
from the top (each candidate built with integer bit operations on a [p, 1] tile, viewed as a float32 threshold:
float compares are exact), then the index's bits (small integers, exact in float32). One pass over the row per
bit, as FlashInfer's sorting-free sampling counts and sums over the row instead of sorting it.
"""

from __future__ import annotations

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron._tiles import spans
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.dispatch import impl
from opport.ops.sample import sample as spec

V_MAX = 8192  # a row is held in SBUF: about eight [128, V] float32 tiles live, 32 KiB a partition each at 8K
BIG = 1048576.0  # 2^20 > any index
NEG_INF = float("-inf")  # the max skips NaN set to it; a threshold below every order bits candidate
SIGN = -2147483648  # 0x80000000 as int32


def _col(p, dtype=nl.float32):
    return nl.ndarray((p, 1), dtype=dtype, buffer=nl.sbuf)


def _row(p, V, dtype=nl.float32):
    return nl.ndarray((p, V), dtype=dtype, buffer=nl.sbuf)


def _masked_sum(on_sb, meas_sb, p, V):
    """[p, 1]: sum of meas where on (0/1)."""
    prod_sb = _row(p, V)
    nisa.tensor_tensor(dst=prod_sb, data1=on_sb, data2=meas_sb, op=nl.multiply)
    s_sb = _col(p)
    nisa.tensor_reduce(dst=s_sb, op=nl.add, data=prod_sb, axis=1)
    return s_sb


def _threshold(cand_sb, p):
    """The float32 threshold of an order-bits candidate c (uint32 order of the float: sign-flipped bits): the
    smallest float whose order bits start with c's set bits, i.e. bits = c ^ (c < 0 as int32 ? 0x80000000 :
    0xFFFFFFFF); a candidate below -inf's order (a negative NaN pattern) becomes -inf (every token passes), one
    above +inf's (a positive NaN) stays NaN (none passes)."""
    s_sb = _col(p, nl.int32)
    nisa.tensor_scalar(dst=s_sb, data=cand_sb, op0=nl.right_shift, operand0=31)  # -1 (top bit set) or 0
    mask_sb = _col(p, nl.int32)
    nisa.tensor_scalar(dst=mask_sb, data=s_sb, op0=nl.bitwise_xor, operand0=-1, op1=nl.bitwise_or, operand1=SIGN)
    fb_sb = _col(p, nl.int32)
    nisa.tensor_tensor(dst=fb_sb, data1=cand_sb, data2=mask_sb, op=nl.bitwise_xor)
    f_sb = _col(p)
    nisa.tensor_copy(dst=f_sb, src=fb_sb.view(nl.float32))
    neg_nan_sb = _col(p, nl.uint8)
    nisa.tensor_tensor(dst=neg_nan_sb, data1=f_sb, data2=f_sb, op=nl.not_equal)
    top_sb = _col(p)
    nisa.tensor_copy(dst=top_sb, src=s_sb)  # -1.0 or 0.0, exact
    nisa.scalar_tensor_tensor(dst=neg_nan_sb, data=top_sb, op0=nl.equal, operand0=0.0, op1=nl.multiply,
                              operand1=neg_nan_sb)
    nisa.tensor_copy_predicated(dst=f_sb, src=NEG_INF, predicate=neg_nan_sb)
    return f_sb


def _value_search(x_sb, meas_sb, target_sb, p, V):
    """[p, 1] float32: the largest logit value v of the row with sum(meas where x >= v) >= target (the value at
    which the order's running measure first reaches the target): 32 radix steps over the order bits."""
    prefix_sb = _col(p, nl.int32)
    nisa.memset(dst=prefix_sb, value=0)
    ge_sb = _row(p, V)
    for b in range(31, -1, -1):
        cand_sb = _col(p, nl.int32)
        nisa.tensor_scalar(dst=cand_sb, data=prefix_sb, op0=nl.bitwise_or, operand0=SIGN if b == 31 else 1 << b)
        f_sb = _threshold(cand_sb, p)
        nisa.tensor_scalar(dst=ge_sb, data=x_sb, op0=nl.greater_equal, operand0=f_sb)
        s_sb = _masked_sum(ge_sb, meas_sb, p, V)
        ok_sb = _col(p)
        nisa.tensor_tensor(dst=ok_sb, data1=s_sb, data2=target_sb, op=nl.greater_equal)
        ok_i_sb = _col(p, nl.int32)
        nisa.tensor_copy(dst=ok_i_sb, src=ok_sb)  # 1 or 0
        nisa.tensor_scalar(dst=ok_i_sb, data=ok_i_sb, op0=nl.left_shift, operand0=b)
        nisa.tensor_tensor(dst=prefix_sb, data1=prefix_sb, data2=ok_i_sb, op=nl.bitwise_or)
    return _threshold(prefix_sb, p)


def _index_search(ids_sb, on_sb, meas_sb, base_sb, target_sb, p, V, n_bits, at_most):
    """[p, 1] float32: the largest index c in [0, 2^n_bits) with base + sum(meas where on and id < c) < target
    (at_most: <= target): radix steps over the index bits, in float32 (exact small integers)."""
    c_sb = _col(p)
    nisa.memset(dst=c_sb, value=0.0)
    lt_sb = _row(p, V)
    for b in range(n_bits - 1, -1, -1):
        cand_sb = _col(p)
        nisa.tensor_scalar(dst=cand_sb, data=c_sb, op0=nl.add, operand0=float(1 << b))
        nisa.tensor_scalar(dst=lt_sb, data=ids_sb, op0=nl.less, operand0=cand_sb)
        nisa.tensor_tensor(dst=lt_sb, data1=lt_sb, data2=on_sb, op=nl.multiply)
        s_sb = _masked_sum(lt_sb, meas_sb, p, V)
        nisa.tensor_tensor(dst=s_sb, data1=s_sb, data2=base_sb, op=nl.add)
        ok_sb = _col(p)
        nisa.tensor_tensor(dst=ok_sb, data1=s_sb, data2=target_sb, op=nl.less_equal if at_most else nl.less)
        nisa.scalar_tensor_tensor(dst=c_sb, data=ok_sb, op0=nl.multiply, operand0=float(1 << b), op1=nl.add,
                                  operand1=c_sb)
    return c_sb


def _prefix(x_sb, ids_sb, meas_sb, target_sb, p, V, n_bits):
    """[p, V] 0/1: the shortest prefix of the order whose measure reaches target (the value threshold, then the
    index among the tokens tied at it: those up to the one where the running measure reaches the target)."""
    v_sb = _value_search(x_sb, meas_sb, target_sb, p, V)
    gt_sb = _row(p, V)
    nisa.tensor_scalar(dst=gt_sb, data=x_sb, op0=nl.greater, operand0=v_sb)
    base_sb = _masked_sum(gt_sb, meas_sb, p, V)
    eq_sb = _row(p, V)
    nisa.tensor_scalar(dst=eq_sb, data=x_sb, op0=nl.equal, operand0=v_sb)
    c_sb = _index_search(ids_sb, eq_sb, meas_sb, base_sb, target_sb, p, V, n_bits, False)
    le_sb = _row(p, V)
    nisa.tensor_scalar(dst=le_sb, data=ids_sb, op0=nl.less_equal, operand0=c_sb)
    nisa.tensor_tensor(dst=le_sb, data1=le_sb, data2=eq_sb, op=nl.multiply)
    nisa.tensor_tensor(dst=gt_sb, data1=gt_sb, data2=le_sb, op=nl.maximum)
    return gt_sb


def _load_col(hbm, t0, p, dtype=nl.float32):
    """A [p, 1] float32 tile of a per-row [B, 1] setting (int32 converted exactly)."""
    raw_sb = _col(p, hbm.dtype)
    nisa.dma_copy(dst=raw_sb, src=hbm[t0:t0 + p, 0:1])
    if hbm.dtype == dtype:
        return raw_sb
    f_sb = _col(p, dtype)
    nisa.tensor_copy(dst=f_sb, src=raw_sb)
    return f_sb


@nki.jit
def _sample_kernel(x_hbm, u_hbm, t_hbm, k_hbm, tp_hbm, mp_hbm, probs):
    """Each row's token (probs=False) or its filtered, renormalised probabilities (probs=True); rows on partitions.

    Dimensions:
        B: rows (tiled by 128); V: vocabulary (free dim, <= V_MAX).

    Args:
        x_hbm: [B, V] logits, float32/float16/bfloat16.
        u_hbm, t_hbm, tp_hbm, mp_hbm: [B, 1] float32 uniforms (unread for probs), temperature, top_p, min_p.
        k_hbm: [B, 1] int32 top_k.
        probs: compile-time: write probabilities instead of a token.

    Returns:
        [B, 1] int32 tokens, or [B, V] float32 probabilities.

    Notes:
        -0 becomes +0 (x + 0); NaN and +inf are counted (a row with either, or all -inf, is invalid: -1 or NaN);
        m = max, g = its lowest index (greedy, T = 0). w = exp((x - m) * (1 / T)) (ScalarE exp; reciprocal and a
        multiply, no divide on hardware). top-k: the prefix of the order of k tokens (count measure; k off: V),
        top-p: the prefix of what top-k kept whose mass reaches top_p times that mass (off rows keep all),
        min-p: w >= min_p; kept = the three. Each prefix is a value threshold found by 32 radix steps on the
        order bits of the logits and an index threshold among the tokens tied at it (ceil(log2 V) steps).
        The token is the largest index whose preceding kept mass is at most u * S (an index search), clamped
        to the last kept token of positive weight. Sums are float32 (a boundary within their rounding may fall
        either way).

    Pseudocode:
        for each 128-row tile: x, m, g, invalid; w = exp((x - m) / T)
            kept_k = prefix(count, k); kept_p = prefix(w * kept_k, top_p * S_k); kept = kept_k kept_p [w >= min_p]
            token = index_search(w * kept, u * S) | probs = w * kept / S
    """
    B, V = x_hbm.shape
    n_bits = max(1, int(np.ceil(np.log2(V + 1))))
    if probs:
        out_hbm = nl.ndarray((B, V), dtype=nl.float32, buffer=nl.shared_hbm)
    else:
        out_hbm = nl.ndarray((B, 1), dtype=nl.int32, buffer=nl.shared_hbm)
    for t0, p in spans(B, nl.tile_size.pmax):
        x_sb = _row(p, V)
        nisa.dma_copy(dst=x_sb, src=x_hbm[t0:t0 + p, 0:V])
        nisa.tensor_scalar(dst=x_sb, data=x_sb, op0=nl.add, operand0=0.0)  # -0 + 0 = +0: -0 ties +0
        t_sb = _load_col(t_hbm, t0, p)
        k_sb = _load_col(k_hbm, t0, p)
        tp_sb = _load_col(tp_hbm, t0, p)
        mp_sb = _load_col(mp_hbm, t0, p)
        ids_sb = _row(p, V)
        nisa.iota(dst=ids_sb, pattern=[[1, V]], offset=0, channel_multiplier=0)
        # invalid rows and the max
        bad_sb = _row(p, V, nl.uint8)
        nisa.tensor_tensor(dst=bad_sb, data1=x_sb, data2=x_sb, op=nl.not_equal)
        nisa.tensor_copy_predicated(dst=x_sb, src=NEG_INF, predicate=bad_sb)  # NaN out of the max (row invalid)
        badf_sb = _row(p, V)
        nisa.tensor_copy(dst=badf_sb, src=bad_sb)
        inf_sb = _row(p, V)
        nisa.tensor_scalar(dst=inf_sb, data=x_sb, op0=nl.equal, operand0=float("inf"))
        nisa.tensor_tensor(dst=badf_sb, data1=badf_sb, data2=inf_sb, op=nl.maximum)
        nbad_sb = _col(p)
        nisa.tensor_reduce(dst=nbad_sb, op=nl.maximum, data=badf_sb, axis=1)
        m_sb = _col(p)
        nisa.tensor_reduce(dst=m_sb, op=nl.maximum, data=x_sb, axis=1)
        allneg_sb = _col(p)
        nisa.tensor_scalar(dst=allneg_sb, data=m_sb, op0=nl.equal, operand0=NEG_INF)
        invalid_sb = _col(p)
        nisa.tensor_tensor(dst=invalid_sb, data1=nbad_sb, data2=allneg_sb, op=nl.maximum)
        # greedy: the lowest index of the max
        hit_sb = _row(p, V)
        nisa.tensor_scalar(dst=hit_sb, data=x_sb, op0=nl.equal, operand0=m_sb, op1=nl.multiply, operand1=-BIG)
        nisa.tensor_tensor(dst=hit_sb, data1=hit_sb, data2=ids_sb, op=nl.add)  # ids - BIG at the max
        g_sb = _col(p)
        nisa.tensor_reduce(dst=g_sb, op=nl.minimum, data=hit_sb, axis=1)
        nisa.tensor_scalar(dst=g_sb, data=g_sb, op0=nl.add, operand0=BIG)
        # live rows: T > 0 and valid; m of the valid rows, 1/T of the live ones (else 0 and 1; overwritten at the end)
        live_sb = _col(p)
        nisa.tensor_scalar(dst=live_sb, data=t_sb, op0=nl.greater, operand0=0.0)
        nisa.scalar_tensor_tensor(dst=live_sb, data=invalid_sb, op0=nl.equal, operand0=0.0, op1=nl.multiply,
                                  operand1=live_sb)
        live_u8_sb = _col(p, nl.uint8)
        nisa.tensor_copy(dst=live_u8_sb, src=live_sb)
        valid_u8_sb = _col(p, nl.uint8)
        nisa.tensor_scalar(dst=valid_u8_sb, data=invalid_sb, op0=nl.equal, operand0=0.0)
        ms_sb = _col(p)
        nisa.memset(dst=ms_sb, value=0.0)
        nisa.tensor_copy_predicated(dst=ms_sb, src=m_sb, predicate=valid_u8_sb)
        ts_sb = _col(p)
        nisa.memset(dst=ts_sb, value=1.0)
        nisa.tensor_copy_predicated(dst=ts_sb, src=t_sb, predicate=live_u8_sb)
        inv_t_sb = _col(p)
        nisa.reciprocal(dst=inv_t_sb, data=ts_sb)
        w_sb = _row(p, V)
        nisa.tensor_scalar(dst=w_sb, data=x_sb, op0=nl.subtract, operand0=ms_sb, op1=nl.multiply, operand1=inv_t_sb)
        nisa.activation(dst=w_sb, op=nl.exp, data=w_sb)
        # top-k: k tokens of the order (k = 0 or >= V: all V)
        on_sb = _col(p)
        nisa.tensor_scalar(dst=on_sb, data=k_sb, op0=nl.greater, operand0=0.0)
        lt_v_sb = _col(p)
        nisa.tensor_scalar(dst=lt_v_sb, data=k_sb, op0=nl.less, operand0=float(V))
        nisa.tensor_tensor(dst=on_sb, data1=on_sb, data2=lt_v_sb, op=nl.multiply)
        on_u8_sb = _col(p, nl.uint8)
        nisa.tensor_copy(dst=on_u8_sb, src=on_sb)
        kk_sb = _col(p)
        nisa.memset(dst=kk_sb, value=float(V))
        nisa.tensor_copy_predicated(dst=kk_sb, src=k_sb, predicate=on_u8_sb)
        ones_sb = _row(p, V)
        nisa.memset(dst=ones_sb, value=1.0)
        kept_k_sb = _prefix(x_sb, ids_sb, ones_sb, kk_sb, p, V, n_bits)
        # top-p on what top-k kept (top_p = 1: every token)
        wk_sb = _row(p, V)
        nisa.tensor_tensor(dst=wk_sb, data1=w_sb, data2=kept_k_sb, op=nl.multiply)
        sk_sb = _col(p)
        nisa.tensor_reduce(dst=sk_sb, op=nl.add, data=wk_sb, axis=1)
        target_sb = _col(p)
        nisa.tensor_tensor(dst=target_sb, data1=tp_sb, data2=sk_sb, op=nl.multiply)
        kept_sb = _prefix(x_sb, ids_sb, wk_sb, target_sb, p, V, n_bits)
        off_sb = _col(p, nl.uint8)
        nisa.tensor_scalar(dst=off_sb, data=tp_sb, op0=nl.greater_equal, operand0=1.0)
        nisa.tensor_copy_predicated(dst=kept_sb, src=ones_sb, predicate=off_sb.broadcast(1, V))
        nisa.tensor_tensor(dst=kept_sb, data1=kept_sb, data2=kept_k_sb, op=nl.multiply)
        # min-p
        mpk_sb = _row(p, V)
        nisa.tensor_scalar(dst=mpk_sb, data=w_sb, op0=nl.greater_equal, operand0=mp_sb)
        nisa.tensor_tensor(dst=kept_sb, data1=kept_sb, data2=mpk_sb, op=nl.multiply)
        nisa.tensor_tensor(dst=wk_sb, data1=w_sb, data2=kept_sb, op=nl.multiply)
        s_sb = _col(p)
        nisa.tensor_reduce(dst=s_sb, op=nl.add, data=wk_sb, axis=1)
        if probs:
            inv_s_sb = _col(p)
            nisa.reciprocal(dst=inv_s_sb, data=s_sb)
            pr_sb = _row(p, V)
            nisa.tensor_scalar(dst=pr_sb, data=wk_sb, op0=nl.multiply, operand0=inv_s_sb)
            onehot_sb = _row(p, V)
            nisa.tensor_scalar(dst=onehot_sb, data=ids_sb, op0=nl.equal, operand0=g_sb)
            greedy_sb = _col(p, nl.uint8)
            nisa.tensor_scalar(dst=greedy_sb, data=live_sb, op0=nl.equal, operand0=0.0)
            nisa.tensor_copy_predicated(dst=pr_sb, src=onehot_sb, predicate=greedy_sb.broadcast(1, V))
            inv_u8_sb = _col(p, nl.uint8)
            nisa.tensor_copy(dst=inv_u8_sb, src=invalid_sb)
            nisa.tensor_copy_predicated(dst=pr_sb, src=float("nan"), predicate=inv_u8_sb.broadcast(1, V))
            nisa.dma_copy(dst=out_hbm[t0:t0 + p, 0:V], src=pr_sb)
        else:
            u_sb = _load_col(u_hbm, t0, p)
            us_sb = _col(p)
            nisa.tensor_tensor(dst=us_sb, data1=u_sb, data2=s_sb, op=nl.multiply)
            zero_sb = _col(p)
            nisa.memset(dst=zero_sb, value=0.0)
            c_sb = _index_search(ids_sb, kept_sb, w_sb, zero_sb, us_sb, p, V, n_bits, True)
            # the last kept token of positive weight: past the end by rounding
            pos_sb = _row(p, V)
            nisa.tensor_scalar(dst=pos_sb, data=wk_sb, op0=nl.greater, operand0=0.0, op1=nl.multiply,
                               operand1=BIG)
            nisa.tensor_tensor(dst=pos_sb, data1=pos_sb, data2=ids_sb, op=nl.add)
            last_sb = _col(p)
            nisa.tensor_reduce(dst=last_sb, op=nl.maximum, data=pos_sb, axis=1)
            nisa.tensor_scalar(dst=last_sb, data=last_sb, op0=nl.subtract, operand0=BIG)
            tok_sb = _col(p)
            nisa.tensor_tensor(dst=tok_sb, data1=c_sb, data2=last_sb, op=nl.minimum)
            greedy_sb = _col(p, nl.uint8)
            nisa.tensor_scalar(dst=greedy_sb, data=live_sb, op0=nl.equal, operand0=0.0)
            nisa.tensor_copy_predicated(dst=tok_sb, src=g_sb, predicate=greedy_sb)
            inv_u8_sb = _col(p, nl.uint8)
            nisa.tensor_copy(dst=inv_u8_sb, src=invalid_sb)
            nisa.tensor_copy_predicated(dst=tok_sb, src=-1.0, predicate=inv_u8_sb)
            tok_i_sb = _col(p, nl.int32)
            nisa.tensor_copy(dst=tok_i_sb, src=tok_sb)
            nisa.dma_copy(dst=out_hbm[t0:t0 + p, 0:1], src=tok_i_sb)
    return out_hbm


def supports(logits, *rest):
    if logits.shape[1] > V_MAX:
        return f"V = {logits.shape[1]}: a row of [128, V] float32 tiles is held in SBUF (at most {V_MAX})"
    return None


def launch(logits: np.ndarray, uniforms, temperature, top_k, top_p, min_p, probs: bool) -> np.ndarray:
    """Host side: contiguous logits, each setting as a contiguous [B, 1] column, launch."""
    b, v = logits.shape
    if b == 0:
        return np.empty((0, v), np.float32) if probs else np.empty(0, np.int32)

    def col(a):
        return _host.contiguous(np.asarray(a).reshape(b, 1))

    u = col(uniforms if uniforms is not None else temperature)
    out = _host.run(_sample_kernel, _host.contiguous(logits), u, col(temperature), col(top_k), col(top_p),
                    col(min_p), bool(probs))
    return _host.as_dtype(out, "float32", (b, v)) if probs else _host.as_dtype(out, "int32", (b,))


@impl(spec, "neuron", supports=supports)
def sample(logits: np.ndarray, uniforms, temperature, top_k, top_p, min_p):
    return launch(logits, uniforms, temperature, top_k, top_p, min_p, probs=False)
