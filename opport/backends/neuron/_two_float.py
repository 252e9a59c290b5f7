"""Two-float arithmetic on VectorE, shared by the neuron kernels whose float32 sums are not enough (the
backward kernels of softmax, rmsnorm, add_rmsnorm and layernorm).

float32 has no wider accumulator on any engine, so exact sums are built from error-free transformations:
a product as the sum of two floats (Dekker), a sum of two floats as a rounded sum plus its exact error (Knuth).
Plain helper functions of NKI instructions, which the NKI compiler inlines into the kernels that call them.
"""

from __future__ import annotations

from opport.backends.neuron.nki_compat import nisa, nl

SPLIT_MASK = -4096  # 0xFFFFF000 as int32: sign, exponent and the top 12 significand bits, so halves multiply exactly


def split_halves(v_sb, p, f):
    """(hi, lo) with v = hi + lo exactly, each of at most 12 significant bits (hi: v's top bits by a mask on
    its int32 view, lo = v - hi exact): products of two halves fit float32's 24 bits."""
    hi_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=hi_sb.view(nl.int32), data=v_sb.view(nl.int32), op0=nl.bitwise_and, operand0=SPLIT_MASK)
    lo_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=lo_sb, data1=v_sb, data2=hi_sb, op=nl.subtract)
    return hi_sb, lo_sb


def two_product(ph_sb, pl_sb, a_sb, b_sb, p, f):
    """ph + pl = a * b exactly (Dekker's TwoProduct, halves from split_halves): ph = fl(a b) and pl its rounding
    error (((ah bh - ph) + ah bl) + al bh) + al bl, every step exact for finite products clear of underflow."""
    ah_sb, al_sb = split_halves(a_sb, p, f)
    bh_sb, bl_sb = split_halves(b_sb, p, f)
    nisa.tensor_tensor(dst=ph_sb, data1=a_sb, data2=b_sb, op=nl.multiply)
    t_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=pl_sb, data1=ah_sb, data2=bh_sb, op=nl.multiply)
    nisa.tensor_tensor(dst=pl_sb, data1=pl_sb, data2=ph_sb, op=nl.subtract)
    for u_sb, v_sb in ((ah_sb, bl_sb), (al_sb, bh_sb), (al_sb, bl_sb)):
        nisa.tensor_tensor(dst=t_sb, data1=u_sb, data2=v_sb, op=nl.multiply)
        nisa.tensor_tensor(dst=pl_sb, data1=pl_sb, data2=t_sb, op=nl.add)


def two_sum(s_sb, e_sb, a_sb, b_sb, u_sb):
    """s + e = a + b exactly (Knuth's TwoSum, any magnitudes): s = fl(a + b), e = (a - (s - bb)) + (b - bb) with
    bb = s - a. u is scratch; s, e, u must not alias a or b."""
    nisa.tensor_tensor(dst=s_sb, data1=a_sb, data2=b_sb, op=nl.add)
    nisa.tensor_tensor(dst=u_sb, data1=s_sb, data2=a_sb, op=nl.subtract)  # bb
    nisa.tensor_tensor(dst=e_sb, data1=s_sb, data2=u_sb, op=nl.subtract)
    nisa.tensor_tensor(dst=e_sb, data1=a_sb, data2=e_sb, op=nl.subtract)
    nisa.tensor_tensor(dst=u_sb, data1=b_sb, data2=u_sb, op=nl.subtract)
    nisa.tensor_tensor(dst=e_sb, data1=e_sb, data2=u_sb, op=nl.add)


def fold_two_float(h_sb, e_sb, p, n):
    """Sums the two-float values h[:, j] + e[:, j], j < n, into h[:, 0] + e[:, 0] per partition: a pairwise
    tree of TwoSums on halves of the free dim (log2 n levels), each level's exact errors added into e. h
    alone is then the plain pairwise float32 sum (inf and NaN as a float32 sum has them); h + e carries the
    digits float32 drops, to about n 2^-48 relative of sum |h| (the e's own float32 rounding)."""
    half_max = max(n // 2, 1)
    s_sb = nl.ndarray((p, half_max), dtype=nl.float32, buffer=nl.sbuf)
    d_sb = nl.ndarray((p, half_max), dtype=nl.float32, buffer=nl.sbuf)
    u_sb = nl.ndarray((p, half_max), dtype=nl.float32, buffer=nl.sbuf)
    size = n
    while size > 1:
        half = size // 2
        two_sum(s_sb[0:p, 0:half], d_sb[0:p, 0:half], h_sb[0:p, 0:half], h_sb[0:p, half:2 * half], u_sb[0:p, 0:half])
        nisa.tensor_tensor(dst=e_sb[0:p, 0:half], data1=e_sb[0:p, 0:half], data2=e_sb[0:p, half:2 * half], op=nl.add)
        nisa.tensor_tensor(dst=e_sb[0:p, 0:half], data1=e_sb[0:p, 0:half], data2=d_sb[0:p, 0:half], op=nl.add)
        nisa.tensor_copy(dst=h_sb[0:p, 0:half], src=s_sb[0:p, 0:half])
        if size % 2:  # the odd last pair member moves down to the end of the next level
            nisa.tensor_copy(dst=h_sb[0:p, half:half + 1], src=h_sb[0:p, size - 1:size])
            nisa.tensor_copy(dst=e_sb[0:p, half:half + 1], src=e_sb[0:p, size - 1:size])
        size = half + size % 2


def fast_two_sum(s_sb, lo_sb, h_sb, e_sb, p):
    """s + lo = h + e with s = fl(h + e) and lo = e - (s - h) (exact for |h| >= |e|, as a folded sum's parts are)."""
    nisa.tensor_tensor(dst=s_sb, data1=h_sb, data2=e_sb, op=nl.add)
    nisa.tensor_tensor(dst=lo_sb, data1=s_sb, data2=h_sb, op=nl.subtract)
    nisa.tensor_tensor(dst=lo_sb, data1=e_sb, data2=lo_sb, op=nl.subtract)



def two_sum_col(s_sb, e_sb, a_sb, b_col, p, f):
    """s + e = a + b exactly for a [p, f] tile and a [p, 1] column b (Knuth's TwoSum, as two_sum)."""
    u_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=s_sb, data=a_sb, op0=nl.add, operand0=b_col)
    nisa.tensor_tensor(dst=u_sb, data1=s_sb, data2=a_sb, op=nl.subtract)  # bb
    nisa.tensor_tensor(dst=e_sb, data1=s_sb, data2=u_sb, op=nl.subtract)
    nisa.tensor_tensor(dst=e_sb, data1=a_sb, data2=e_sb, op=nl.subtract)
    nisa.tensor_scalar(dst=u_sb, data=u_sb, op0=nl.subtract, operand0=b_col, reverse0=True)  # b - bb
    nisa.tensor_tensor(dst=e_sb, data1=e_sb, data2=u_sb, op=nl.add)


def two_product_col(ph_sb, pl_sb, a_sb, b_col, p, f):
    """ph + pl = a * b exactly for a [p, f] tile and a [p, 1] column b (one value per row), as two_product."""
    ah_sb, al_sb = split_halves(a_sb, p, f)
    bh_sb, bl_sb = split_halves(b_col, p, 1)
    nisa.tensor_scalar(dst=ph_sb, data=a_sb, op0=nl.multiply, operand0=b_col)
    nisa.tensor_scalar(dst=pl_sb, data=ah_sb, op0=nl.multiply, operand0=bh_sb)
    nisa.tensor_tensor(dst=pl_sb, data1=pl_sb, data2=ph_sb, op=nl.subtract)
    for u_sb, v_col in ((ah_sb, bl_sb), (al_sb, bh_sb), (al_sb, bl_sb)):
        nisa.scalar_tensor_tensor(dst=pl_sb, data=u_sb, op0=nl.multiply, operand0=v_col, op1=nl.add, operand1=pl_sb)


def dot_two_float(h_col, e_col, a_sb, al_sb, b_sb, bl_sb, p, f):
    """h_col + e_col [p, 1] = sum over the free dim of (a + al) (b + bl): a b as exact products (two_product), the
    cross terms a bl + al b in float32 (they are the small parts), folded by TwoSums (fold_two_float). al_sb and
    bl_sb may be None (a, b exact as they are)."""
    h_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    e_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    two_product(h_sb, e_sb, a_sb, b_sb, p, f)
    t_sb = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    for u_sb, v_sb in ((a_sb, bl_sb), (al_sb, b_sb)):
        if v_sb != None and u_sb != None:  # noqa: E711 (NKI kernels compare with None by value)
            nisa.tensor_tensor(dst=t_sb, data1=u_sb, data2=v_sb, op=nl.multiply)
            nisa.tensor_tensor(dst=e_sb, data1=e_sb, data2=t_sb, op=nl.add)
    fold_two_float(h_sb, e_sb, p, f)
    nisa.tensor_copy(dst=h_col, src=h_sb[0:p, 0:1])
    nisa.tensor_copy(dst=e_col, src=e_sb[0:p, 0:1])


def divide_two_float(q_sb, n_sb, d_sb, p):
    """q [p, 2] = n / d per row, n and d [p, 2] two-float values (hi, lo): q_hi = n_hi / d_hi rounded, then
    q_lo = (n - q_hi d) / d_hi with q_hi d_hi exact as two floats (two_product), so q carries about twice
    float32's digits (d_hi > 0 finite)."""
    r_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=r_sb, data=d_sb[0:p, 0:1])
    nisa.tensor_tensor(dst=q_sb[0:p, 0:1], data1=n_sb[0:p, 0:1], data2=r_sb, op=nl.multiply)
    ph_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    pl_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    two_product(ph_sb, pl_sb, q_sb[0:p, 0:1], d_sb[0:p, 0:1], p, 1)
    rem_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # ((n_hi - ph) - pl) + n_lo - q_hi d_lo
    nisa.tensor_tensor(dst=rem_sb, data1=n_sb[0:p, 0:1], data2=ph_sb, op=nl.subtract)
    nisa.tensor_tensor(dst=rem_sb, data1=rem_sb, data2=pl_sb, op=nl.subtract)
    nisa.tensor_tensor(dst=rem_sb, data1=rem_sb, data2=n_sb[0:p, 1:2], op=nl.add)
    nisa.tensor_tensor(dst=ph_sb, data1=q_sb[0:p, 0:1], data2=d_sb[0:p, 1:2], op=nl.multiply)
    nisa.tensor_tensor(dst=rem_sb, data1=rem_sb, data2=ph_sb, op=nl.subtract)
    nisa.tensor_tensor(dst=q_sb[0:p, 1:2], data1=rem_sb, data2=r_sb, op=nl.multiply)
