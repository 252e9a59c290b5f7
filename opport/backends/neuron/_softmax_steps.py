"""The online softmax's steps, shared by the neuron kernels that fold scores into a running max and sum
(softmax, cross_entropy, linear_cross_entropy, attention, paged_attention).

Rows lie on the partitions: a running max m and a running sum l are float32 [p, 1] tiles, and each tile of
scores x [p, f] is folded in by one step (VectorE max, ScalarE exp with its row sum, one VectorE update).
Plain helper functions of NKI instructions, which the NKI compiler inlines into the kernels that call them.
"""

from __future__ import annotations

from opport.backends.neuron.nki_compat import nisa, nl

NEG_BIG = -3.4028234663852886e38  # -FLT_MAX: a finite start for the running max, so exp(m_old - m_new) is never NaN
TINY = 1.1754943508222875e-38  # FLT_MIN: 1 / max(l, TINY) keeps a row that saw no score at 0 * huge = 0


def running_state(p):
    """(m, l) for p rows before the first step: m = -FLT_MAX, l = 0 (float32 [p, 1] each)."""
    m_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=m_sb, value=NEG_BIG)
    l_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=l_sb, value=0.0)
    return m_sb, l_sb


def online_step(m_sb, l_sb, x_sb, e_dtype=nl.float32):
    """Folds the scores x [p, f] into the running max m and sum l: returns (m', corr, e) with m' = max(m, max x),
    corr = exp(m - m') (what earlier terms are rescaled by) and e = exp(x - m') in e_dtype, and updates l in place
    to l corr + sum e. m itself is left as it was: the caller rebinds (or copies) m' over it."""
    p, f = x_sb.shape
    xmax_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=xmax_sb, op=nl.maximum, data=x_sb, axis=1, keepdims=True)
    m_new_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=m_new_sb, data1=m_sb, data2=xmax_sb, op=nl.maximum)
    neg_m_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=neg_m_sb, data=m_new_sb, op0=nl.multiply, operand0=-1.0)
    corr_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=corr_sb, op=nl.exp, data=m_sb, bias=neg_m_sb)
    e_sb = nl.ndarray((p, f), dtype=e_dtype, buffer=nl.sbuf)
    esum_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=e_sb, op=nl.exp, data=x_sb, bias=neg_m_sb, reduce_op=nl.add, reduce_res=esum_sb,
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)
    nisa.scalar_tensor_tensor(dst=l_sb, data=l_sb, op0=nl.multiply, operand0=corr_sb, op1=nl.add, operand1=esum_sb)
    return m_new_sb, corr_sb, e_sb


def inverse_sum(l_sb):
    """1 / max(l, FLT_MIN) per row (float32 [p, 1]): the output scale, 0 * huge = 0 for a row that saw nothing."""
    p = l_sb.shape[0]
    lc_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=lc_sb, data=l_sb, op0=nl.maximum, operand0=TINY)
    inv_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=inv_sb, data=lc_sb)
    return inv_sb
