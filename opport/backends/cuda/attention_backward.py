"""attention's backward in Triton: FlashAttention-2 in two launches (a dq pass, then a dk/dv pass), no S x S
storage and no atomics. The forward, and what both directions use (the default scale, the shape check, the
non-finite part of p @ v), are in attention.py.
"""

import torch

from opport.backends.cuda._launch import INTERPRET, cdiv, dot_operand, f32, narrow, next_pow2, tl, triton
from opport.backends.cuda.attention import LOG2E, _nonfinite_part, _softmax_scale, _supports
from opport.dispatch import impl
from opport.ops.attention import attention as spec

# FlashAttention-2's backward in two launches, no S x S storage and no atomics:
#   1. `_attention_dq_kernel`, one program per (query block, batch, KV head), GQA-packed as the forward:
#      D = rowsum(dO * O) in its prologue (FlashAttention's preprocessing step), then one pass over the
#      visible key blocks recomputing P = exp2(s - lse) and dP = dO V^T; writes dq, D and each row's
#      max-key terms (below).
#   2. `_attention_dkdv_kernel`, one program per (key block, batch, KV head): one pass over the group's
#      packed query rows that see the key block (causal blocks skipped), so GQA's dk/dv sums over the group
#      in a fixed order inside one program.
#
# dS = P (dP - D) cancels: where attention sits on one key j, O = v_j and dP_j - D = dO.v_j - dO.O is a
# difference of two float32 dot products of size |dO| |v|, whose rounding (eps |dO| |v|) is then the whole
# result, while the reference's dS is 0 (a row with one visible key: dq = dk = 0 exactly; the cpu backend
# forms dP - D in float64, at 1.5x its cost). No reordering of float32 dots cancels it reliably: two
# elements of one tl.dot holding the same sum of the same products already differ in their last bits
# (NumPy's BLAS under the interpreter gives column j and j + 1 different roundings). So the one pair that
# can carry weight ~1, (row i, its max-score key j*), is formed without the cancellation:
#     dS_ij* = P_ij* (dO_i . (v_j* - O_i))
# the difference taken element by element before the product (exact where v_j* and O_i are close), which
# is 0 when O_i = v_j*. Every other key has P_ij <= 1/2 wherever the row concentrates, so its dP - D error
# is weighted down by P. The dq pass tracks j* (first key of the largest visible score) and the plain dP - D
# of that pair, and after its sweep swaps the plain dS for the exact one in dq (a [BLOCK_M, D] correction with
# k_j* gathered once per tile); it stores j* and dO_i . (v_j* - O_i) for the dk/dv pass, which uses them in
# place of dP - D for that pair. Where the plain dP - D is not finite (inf or NaN in dO, v or O) both passes
# keep it, so special values come out as the reference's.
#
# NaN/inf under the causal mask: masked P and dS are zeroed, but 0 * NaN inside a dot would still carry a
# non-finite k (into dq), q or dO (into dk, dv) past the mask. As in the forward, the fast launch zeroes such
# operand entries in its diagonal blocks and raises its tile's flag; an EXACT launch (small tiles) recomputes
# flagged tiles and adds exactly what those entries contribute to the pairs that see them.


@triton.jit
def _softcap_slope(s, cap):
    """(cap·tanh(s / cap), its derivative 1 - tanh²(s / cap)) for the backward's chain rule."""
    x = s / cap
    e = tl.exp2(tl.abs(x) * (-2.0 * 1.4426950408889634))
    t = (1.0 - e) / (1.0 + e)
    t = tl.where(x < 0, -t, t)
    return cap * t, 1.0 - t * t


@triton.jit
def _attention_dq_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, dq_ptr, delta_ptr, star_ptr, jstar_ptr, flag_ptr,
    # shapes, strides
    n_kv_heads, group, sq, sk, d, dv,
    q_sb, q_sh, q_ss, q_sd,
    k_sb, k_sh, k_ss, k_sd,
    v_sb, v_sh, v_ss, v_sd,
    o_sb, o_sh, o_ss, o_sd,
    g_sb, g_sh, g_ss, g_sd,
    l_sb, l_sh, l_ss,
    qk_scale, scale, flag_block, cap2, window,
    # meta-parameters
    CAUSAL: tl.constexpr, EXACT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    SOFTCAP: tl.constexpr = False, WINDOW: tl.constexpr = False,
):
    """dq, D = rowsum(dO * O) and the max-key terms for BLOCK_M query rows of one (batch, KV head),
    GQA-packed as the forward.

    Dimensions: q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv], o and do [B, Hq, Sq, Dv], lse
    [B, Hq, Sq], all strided; dq [B, Hq, Sq, D], delta and delta_star [B, Hq, Sq] float32, j_star [B, Hq, Sq]
    int32 and flags [B * Hkv, cdiv(group * Sq, flag_block)] contiguous.
    Notes: rows with lse = -inf (no visible key, or only -inf scores) take no part: q and dO are zeroed
    (their NaN cannot reach a sum) and P = exp2(s - inf) = 0; their dq is written 0. Key blocks every row
    sees in full run unmasked; the causal/tail blocks mask the scores and dS. See the section comment for
    the max key j*. SOFTCAP, WINDOW as the forward's: dS takes the cap's slope (also in the j* fix); key blocks
    before the tile's first window are skipped, those a row's window starts inside are masked.
    Pseudocode: D = rowsum(dO O); for key block: P = exp2(s - lse); dS = P (dO V^T - D); A += dS k;
                track j*. A += (P_j* dO.(v_j* - O) - dS_j*) k_j*; dq = scale A
    """
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    flag = flag_ptr + bh.to(tl.int64) * tl.cdiv(group * sq, flag_block) + (pid_m * BLOCK_M) // flag_block
    if EXACT:
        run = tl.load(flag) != 0
    else:
        run = True
    if run:
        b = (bh // n_kv_heads).to(tl.int64)
        hkv = (bh % n_kv_heads).to(tl.int64)
        row_ok, head, i, at_row = _packed_rows(pid_m * BLOCK_M, b, hkv, n_kv_heads, group, sq, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        do_rows = do_ptr + b * g_sb + head * g_sh + i * g_ss
        q, do, lse2, dead = _query_rows(q_ptr + b * q_sb + head * q_sh + i * q_ss, do_rows,
                                        lse_ptr + b * l_sb + head * l_sh + i * l_ss, row_ok, d, dv, q_sd, g_sd, offs_d,
                                        offs_dv)
        q_op, do_op = dot_operand(q), dot_operand(do)
        o_rows = o_ptr + b * o_sb + head * o_sh + i * o_ss
        delta = tl.where(dead, 0.0, tl.sum(f32(do) * _load_rows(o_rows, row_ok, dv, o_sd, offs_dv), 1))
        k_base = k_ptr + b * k_sb + hkv * k_sh
        v_base = v_ptr + b * v_sb + hkv * v_sh
        off = sk - sq
        i_lo = tl.min(tl.where(row_ok, i, sq), 0)
        i_hi = tl.max(tl.where(row_ok, i, 0), 0)
        if CAUSAL:
            full_end = tl.minimum(tl.maximum(i_lo + off + 1, 0), sk) // BLOCK_N * BLOCK_N
            end = tl.minimum(tl.maximum(i_hi + off + 1, 0), sk)
        else:
            full_end = sk // BLOCK_N * BLOCK_N
            end = sk
        start0 = 0  # blocks [start0, mid) are masked by some row's window start (none without WINDOW)
        mid = 0
        if WINDOW:
            start0 = tl.minimum(tl.maximum(i_lo + off + 1 - window, 0), sk) // BLOCK_N * BLOCK_N
            mid = tl.minimum(tl.cdiv(tl.minimum(tl.maximum(i_hi + off + 1 - window, 0), sk), BLOCK_N) * BLOCK_N, end)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        star_score = tl.full((BLOCK_M,), float("-inf"), tl.float32)  # the max key so far: see _track_max_key
        star_key = tl.full((BLOCK_M,), -1, tl.int32)
        star_x = tl.zeros((BLOCK_M,), tl.float32)
        if EXACT:
            nan_cols = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)  # visible non-finite k per (row, column)
        else:
            nan_cols = tl.zeros((1, 1), tl.float32)
        hidden = 0
        for start in range(start0, mid, BLOCK_N):
            acc, star_score, star_key, star_x, nan_cols, bad = _dq_block(
                acc, star_score, star_key, star_x, nan_cols, q_op, do_op, delta, lse2, k_base, v_base, start, i, off, sk,
                d, dv, k_ss, k_sd, v_ss, v_sd, qk_scale, offs_d, offs_dv, True, CAUSAL, EXACT, PRECISION, BLOCK_N,
                cap2, window, SOFTCAP, WINDOW)
            hidden += bad
        for start in range(mid, full_end, BLOCK_N):
            acc, star_score, star_key, star_x, nan_cols, _ = _dq_block(
                acc, star_score, star_key, star_x, nan_cols, q_op, do_op, delta, lse2, k_base, v_base, start, i, off, sk,
                d, dv, k_ss, k_sd, v_ss, v_sd, qk_scale, offs_d, offs_dv, False, False, False, PRECISION, BLOCK_N,
                cap2, window, SOFTCAP, False)
        for start in range(tl.maximum(mid, full_end), end, BLOCK_N):
            acc, star_score, star_key, star_x, nan_cols, bad = _dq_block(
                acc, star_score, star_key, star_x, nan_cols, q_op, do_op, delta, lse2, k_base, v_base, start, i, off, sk,
                d, dv, k_ss, k_sd, v_ss, v_sd, qk_scale, offs_d, offs_dv, True, CAUSAL, EXACT, PRECISION, BLOCK_N,
                cap2, window, SOFTCAP, WINDOW)
            hidden += bad
        acc, delta_star = _max_key_fix(acc, star_score, star_key, star_x, do_rows, g_sd, o_rows, o_sd, lse2, k_base,
                                       v_base, row_ok, sk, d, dv, k_ss, k_sd, v_ss, v_sd, offs_d, offs_dv, cap2, SOFTCAP)
        dq = acc * scale
        if EXACT:
            dq = tl.where(nan_cols > 0.0, float("nan"), dq)
        dq = tl.where(dead[:, None], 0.0, dq)
        tl.store(dq_ptr + at_row[:, None] * d + offs_d[None, :], narrow(dq, dq_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_d[None, :] < d))
        tl.store(delta_ptr + at_row, delta, mask=row_ok)
        tl.store(star_ptr + at_row, delta_star, mask=row_ok)
        tl.store(jstar_ptr + at_row, star_key, mask=row_ok)
        if not EXACT and CAUSAL:
            tl.store(flag, hidden)


@triton.jit
def _max_key_fix(acc, star_score, star_key, star_x, do_rows, g_sd, o_rows, o_sd, lse2, k_base, v_base, row_ok, sk, d, dv,
                 k_ss, k_sd, v_ss, v_sd, offs_d, offs_dv, cap2=1.0, SOFTCAP: tl.constexpr = False):
    """Swap the plain dS = P (dP - D) of each row's max key j* in dq's sum A for P (dO . (v_j* - O)) (section
    comment); returns (A, dO . (v_j* - O)). Left alone: rows with no visible finite score (j* = -1), and rows
    whose plain dP - D is not finite (inf or NaN in dO, v or O), which keep the reference's special values."""
    j = tl.minimum(tl.maximum(star_key, 0), sk - 1).to(tl.int64)  # (clamped: never an address outside k, v)
    found = row_ok & (star_key >= 0)
    v_star = f32(tl.load(v_base + j[:, None] * v_ss + offs_dv[None, :] * v_sd,
                         mask=found[:, None] & (offs_dv[None, :] < dv), other=0.0))
    k_star = f32(tl.load(k_base + j[:, None] * k_ss + offs_d[None, :] * k_sd,
                         mask=found[:, None] & (offs_d[None, :] < d), other=0.0))
    # dO and O read again: keeping their float32 values in registers through the sweep spilled (dead rows'
    # unzeroed dO does not matter: their dq is written 0 and the dk/dv pass zeroes their dS)
    do = _load_rows(do_rows, row_ok, dv, g_sd, offs_dv)
    delta_star = tl.sum(do * (v_star - _load_rows(o_rows, row_ok, dv, o_sd, offs_dv)), 1)
    p_star = tl.exp2(star_score - lse2)  # the bits of P at j* in the sweep (same operands, same formula)
    fix = tl.where(found & (tl.abs(star_x) < float("inf")), p_star * delta_star - p_star * star_x, 0.0)
    if SOFTCAP:  # both terms carry the cap's slope at j* (star_score is the capped score)
        t = star_score / cap2
        fix = fix * (1.0 - t * t)
    return acc + fix[:, None] * k_star, delta_star


@triton.jit
def _load_rows(rows, row_ok, n, s_col, cols):
    """Rows of a [.., n] tensor from their row pointers, widened to float32 (0 outside)."""
    return f32(tl.load(rows[:, None] + cols[None, :] * s_col, mask=row_ok[:, None] & (cols[None, :] < n), other=0.0))


@triton.jit
def _packed_rows(r0, b, hkv, n_kv_heads, group, sq, BLOCK_M: tl.constexpr):
    """Rows r0 .. r0 + BLOCK_M of a KV head's packed query rows (row g * Sq + i is query head hkv * group + g,
    position i): (in range, query head, position, row index in [B, Hq, Sq] arrays), int64."""
    r = r0 + tl.arange(0, BLOCK_M)
    head = hkv * group + (r // sq).to(tl.int64)
    i = (r % sq).to(tl.int64)
    return r < group * sq, head, i, (b * n_kv_heads * group + head) * sq + i


@triton.jit
def _query_rows(q_rows, do_rows, lse_rows, row_ok, d, dv, q_sd, g_sd, offs_d, offs_dv):
    """One block of query rows from their row pointers: (q, dO, lse * log2(e), dead). Dead rows (lse = -inf;
    also rows out of range) get q = dO = 0 and a log2 lse of +inf, so their P is exactly 0 and nothing of
    theirs reaches a dot."""
    q = tl.load(q_rows[:, None] + offs_d[None, :] * q_sd, mask=row_ok[:, None] & (offs_d[None, :] < d), other=0.0)
    do = tl.load(do_rows[:, None] + offs_dv[None, :] * g_sd, mask=row_ok[:, None] & (offs_dv[None, :] < dv), other=0.0)
    lse = tl.load(lse_rows, mask=row_ok, other=float("-inf"))
    dead = lse == float("-inf")
    q = tl.where(dead[:, None], tl.zeros_like(q), q)
    do = tl.where(dead[:, None], tl.zeros_like(do), do)
    return q, do, tl.where(dead, float("inf"), lse * 1.4426950408889634), dead


@triton.jit
def _nonfinite(x):
    """Where x is NaN or +-inf (compared in float32: the interpreter holds bfloat16 as raw bits, where NaN == NaN)."""
    xf = f32(x)
    return (xf != xf) | (tl.abs(xf) == float("inf"))


@triton.jit
def _dq_block(acc, star_score, star_key, star_x, nan_cols, q_op, do_op, delta, lse2, k_base, v_base, start, i, off, sk,
              d, dv, k_ss, k_sd, v_ss, v_sd, qk_scale, offs_d, offs_dv, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
              EXACT: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, cap2=1.0, window=0,
              SOFTCAP: tl.constexpr = False, WINDOW: tl.constexpr = False):
    """One key block of the dq pass; returns the updated sums, the rows' max key so far, and whether k held
    non-finite entries under the causal mask (which the fast launch zeroed in the dot operand)."""
    keys = start + tl.arange(0, BLOCK_N)
    k = tl.load(k_base + keys.to(tl.int64)[:, None] * k_ss + offs_d[None, :] * k_sd,
                mask=(keys[:, None] < sk) & (offs_d[None, :] < d), other=0.0)
    v = tl.load(v_base + keys.to(tl.int64)[:, None] * v_ss + offs_dv[None, :] * v_sd,
                mask=(keys[:, None] < sk) & (offs_dv[None, :] < dv), other=0.0)
    s = tl.dot(q_op, tl.trans(dot_operand(k)), input_precision=PRECISION) * qk_scale
    if SOFTCAP:
        s, slope = _softcap_slope(s, cap2)
    p = tl.exp2(s - lse2[:, None])
    dp = tl.dot(do_op, tl.trans(dot_operand(v)), input_precision=PRECISION)
    x = dp - delta[:, None]
    ds = p * x
    if SOFTCAP:
        ds = ds * slope
    hidden = 0
    if MASKED:
        vis = keys[None, :] < sk
        if CAUSAL:
            vis = vis & (keys[None, :] <= i[:, None] + off)
        if WINDOW:
            vis = vis & (keys[None, :] > i[:, None] + off - window)
        s = tl.where(vis, s, float("-inf"))
        ds = tl.where(vis, ds, 0.0)  # (exp2 of a masked NaN score, 0 * inf of a masked v's dP)
        if CAUSAL:  # beyond-the-tail keys load as 0: only the causal mask can hide NaN/inf
            bad = _nonfinite(k)
            hidden = tl.max(tl.max(bad.to(tl.int32), 1), 0)
            if hidden > 0:  # rare
                if EXACT:  # a visible non-finite k[j, c] makes dq[i, c] NaN (its score is +-inf or NaN: P or dS is 0 or NaN)
                    nan_cols += tl.dot(vis.to(tl.float32), bad.to(tl.float32), input_precision="ieee")
                k = tl.where(bad, tl.zeros_like(k), k)
    acc = _dot_split(ds, k, acc, PRECISION)
    star_score, star_key, star_x = _track_max_key(star_score, star_key, star_x, s, x, start)
    return acc, star_score, star_key, star_x, nan_cols, hidden


@triton.jit
def _track_max_key(star_score, star_key, star_x, s, x, start):
    """Per row, the max key after one more block: (largest visible score so far, log2-scaled; its key, -1 while
    there is none; its plain dP - D). A strictly larger score moves it, so ties keep the first key."""
    top, col = tl.max(s, 1, return_indices=True)
    x_top = tl.sum(tl.where(tl.arange(0, s.shape[1])[None, :] == col[:, None], x, 0.0), 1)
    new = top > star_score
    return tl.where(new, top, star_score), tl.where(new, (start + col).to(tl.int32), star_key), tl.where(new, x_top, star_x)


@triton.jit
def _dot_split(x, y, acc, PRECISION: tl.constexpr):
    """acc + x @ y for a float32 x (P or dS) and an input tile y.

    16-bit y: x = hi + lo, each rounded to y's dtype, through two tensor-core dots. One rounding of x alone
    (FlashAttention's) errs by 2^-9 (bfloat16) or 2^-12 (float16) of each term, and dV = P^T dO, dK = dS^T q
    and dq = dS k sum terms of both signs: where they cancel (two query rows with opposite dO, one visible
    key), that error is the whole result. hi + lo carries x to 2^-17 (2^-23) of each term. float32: one IEEE
    dot. A non-finite hi (x is inf or NaN) has lo = 0, so inf - inf cannot turn an infinite term into NaN.
    """
    if y.dtype == tl.float32:
        return tl.dot(x, y, acc, input_precision=PRECISION)
    else:
        hi = narrow(x, y.dtype)
        hi32 = f32(hi)
        lo = narrow(tl.where(tl.abs(hi32) < float("inf"), x - hi32, 0.0), y.dtype)
        y_op = dot_operand(y)
        acc = tl.dot(dot_operand(hi), y_op, acc, input_precision=PRECISION)
        return tl.dot(dot_operand(lo), y_op, acc, input_precision=PRECISION)


@triton.jit
def _attention_dkdv_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, star_ptr, jstar_ptr, dk_ptr, dv_ptr, flag_ptr,
    # shapes, strides
    n_kv_heads, group, sq, sk, d, dv,
    q_sb, q_sh, q_ss, q_sd,
    k_sb, k_sh, k_ss, k_sd,
    v_sb, v_sh, v_ss, v_sd,
    g_sb, g_sh, g_ss, g_sd,
    l_sb, l_sh, l_ss,
    qk_scale, scale, flag_block, cap2, window,
    # meta-parameters
    CAUSAL: tl.constexpr, EXACT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    SOFTCAP: tl.constexpr = False, WINDOW: tl.constexpr = False,
):
    """dk, dv for BLOCK_N keys of one (batch, KV head), summed over the group's query rows in a fixed order.

    Dimensions: as `_attention_dq_kernel`; delta, delta_star, j_star are its outputs; dk [B, Hkv, Sk, D],
    dv [B, Hkv, Sk, Dv] and flags [B * Hkv, cdiv(Sk, flag_block)] contiguous.
    Notes: the group's query rows are packed as in the dq pass (g * Sq + i), BLOCK_M at a time. Causal:
    a block none of whose rows sees a key of this block is skipped; a block whose every row sees every key
    runs unmasked. Keys past Sk load as 0 and only reach rows of dk, dv that are not stored. Tiles are
    computed transposed (keys x rows: s^T = k q^T, dP^T = v dO^T), so P^T and dS^T enter the dk/dv dots as the
    first operand straight from registers, with the keys on the MMA's M dimension.
    Pseudocode: for query block: P = exp2(s - lse); dS = P (dO V^T - D), at (i, j*_i) P dO.(v_j* - O);
                dV += P^T dO; dK += dS^T q.  dk = scale dK
    """
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    j0 = pid_n * BLOCK_N
    flag = flag_ptr + bh.to(tl.int64) * tl.cdiv(sk, flag_block) + j0 // flag_block
    if EXACT:
        run = tl.load(flag) != 0
    else:
        run = True
    if run:
        b = (bh // n_kv_heads).to(tl.int64)
        hkv = (bh % n_kv_heads).to(tl.int64)
        keys = j0 + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        k = tl.load(k_ptr + b * k_sb + hkv * k_sh + keys.to(tl.int64)[:, None] * k_ss + offs_d[None, :] * k_sd,
                    mask=(keys[:, None] < sk) & (offs_d[None, :] < d), other=0.0)
        v = tl.load(v_ptr + b * v_sb + hkv * v_sh + keys.to(tl.int64)[:, None] * v_ss + offs_dv[None, :] * v_sd,
                    mask=(keys[:, None] < sk) & (offs_dv[None, :] < dv), other=0.0)
        k_op, v_op = dot_operand(k), dot_operand(v)
        off = sk - sq  # query i sees key j iff j <= i + off (causal)
        j_last = tl.minimum(j0 + BLOCK_N, sk) - 1
        acc_k = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
        acc_v = tl.zeros((BLOCK_N, BLOCK_DV), tl.float32)
        if EXACT:
            nan_k = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)  # visible non-finite q per (key, column)
        else:
            nan_k = tl.zeros((1, 1), tl.float32)
        hidden = 0
        for r0 in range(0, group * sq, BLOCK_M):
            row_ok, head, i, at_row = _packed_rows(r0, b, hkv, n_kv_heads, group, sq, BLOCK_M)
            q_rows = q_ptr + b * q_sb + head * q_sh + i * q_ss
            do_rows = do_ptr + b * g_sb + head * g_sh + i * g_ss
            lse_rows = lse_ptr + b * l_sb + head * l_sh + i * l_ss
            stats = (delta_ptr + at_row, star_ptr + at_row, jstar_ptr + at_row)
            if CAUSAL:
                i_lo = tl.min(tl.where(row_ok, i, sq), 0)
                i_hi = tl.max(tl.where(row_ok, i, -1), 0)
                some = i_hi + off >= j0  # some row sees some key of the block
                whole = i_lo + off >= j_last  # every row sees every key
                if WINDOW:
                    some = some & (i_lo + off - window < j_last)
                    whole = whole & (i_hi + off - window < j0)
                if some:
                    if whole:
                        acc_k, acc_v, nan_k, _ = _dkdv_block(
                            acc_k, acc_v, nan_k, k_op, v_op, q_rows, do_rows, lse_rows, stats, row_ok, i, keys, off,
                            d, dv, q_sd, g_sd, qk_scale, offs_d, offs_dv, False, False, PRECISION, cap2, window,
                            SOFTCAP, False)
                    else:
                        acc_k, acc_v, nan_k, bad = _dkdv_block(
                            acc_k, acc_v, nan_k, k_op, v_op, q_rows, do_rows, lse_rows, stats, row_ok, i, keys, off,
                            d, dv, q_sd, g_sd, qk_scale, offs_d, offs_dv, True, EXACT, PRECISION, cap2, window,
                            SOFTCAP, WINDOW)
                        hidden += bad
            else:
                acc_k, acc_v, nan_k, _ = _dkdv_block(
                    acc_k, acc_v, nan_k, k_op, v_op, q_rows, do_rows, lse_rows, stats, row_ok, i, keys, off, d, dv,
                    q_sd, g_sd, qk_scale, offs_d, offs_dv, False, False, PRECISION, cap2, window, SOFTCAP, False)
        dk = acc_k * scale
        if EXACT:
            dk = tl.where(nan_k > 0.0, float("nan"), dk)
        at_key = bh.to(tl.int64) * sk + keys
        tl.store(dk_ptr + at_key[:, None] * d + offs_d[None, :], narrow(dk, dk_ptr.dtype.element_ty),
                 mask=(keys[:, None] < sk) & (offs_d[None, :] < d))
        tl.store(dv_ptr + at_key[:, None] * dv + offs_dv[None, :], narrow(acc_v, dv_ptr.dtype.element_ty),
                 mask=(keys[:, None] < sk) & (offs_dv[None, :] < dv))
        if not EXACT and CAUSAL:
            tl.store(flag, hidden)


@triton.jit
def _dkdv_block(acc_k, acc_v, nan_k, k_op, v_op, q_rows, do_rows, lse_rows, stats, row_ok, i, keys, off, d, dv,
                q_sd, g_sd, qk_scale, offs_d, offs_dv, MASKED: tl.constexpr, EXACT: tl.constexpr,
                PRECISION: tl.constexpr, cap2=1.0, window=0, SOFTCAP: tl.constexpr = False,
                WINDOW: tl.constexpr = False):
    """One query block of the dk/dv pass (MASKED: causally masked), in keys x rows tiles; returns the updated
    sums and whether q or dO held non-finite entries in rows the mask hides from some key (zeroed in the fast
    launch's dots)."""
    q, do, lse2, dead = _query_rows(q_rows, do_rows, lse_rows, row_ok, d, dv, q_sd, g_sd, offs_d, offs_dv)
    delta_rows, star_rows, jstar_rows = stats  # the dq pass's per-row outputs
    delta = tl.load(delta_rows, mask=row_ok, other=0.0)
    delta_star = tl.load(star_rows, mask=row_ok, other=0.0)
    j_star = tl.load(jstar_rows, mask=row_ok, other=-1)
    st = tl.dot(k_op, tl.trans(dot_operand(q)), input_precision=PRECISION) * qk_scale
    if SOFTCAP:
        st, slope_t = _softcap_slope(st, cap2)
    pt = tl.exp2(st - lse2[None, :])
    xt = tl.dot(v_op, tl.trans(dot_operand(do)), input_precision=PRECISION) - delta[None, :]  # dP - D
    dst = pt * tl.where((keys[:, None] == j_star[None, :]) & (tl.abs(xt) < float("inf")), delta_star[None, :], xt)
    if SOFTCAP:
        dst = dst * slope_t
    # dead rows (zeroed q and dO) meet a non-finite k or v as 0 * inf = NaN in s or dP: they must add nothing
    pt = tl.where(dead[None, :], 0.0, pt)
    dst = tl.where(dead[None, :], 0.0, dst)
    hidden = 0
    if MASKED:
        vis_t = keys[:, None] <= i[None, :] + off
        if WINDOW:
            vis_t = vis_t & (keys[:, None] > i[None, :] + off - window)
        pt = tl.where(vis_t, pt, 0.0)
        dst = tl.where(vis_t, dst, 0.0)
        bad_q, bad_do = _nonfinite(q), _nonfinite(do)
        hidden = tl.maximum(tl.max(tl.max(bad_q.to(tl.int32), 1), 0), tl.max(tl.max(bad_do.to(tl.int32), 1), 0))
        if hidden > 0:  # rare
            if EXACT:
                # a visible non-finite q[i, c] makes dk[j, c] NaN (the score is +-inf or NaN: P or dS is 0 or NaN)
                nan_k += tl.dot(vis_t.to(tl.float32), bad_q.to(tl.float32), input_precision="ieee")
                acc_v += _nonfinite_part(vis_t, pt, do)
            q = tl.where(bad_q, tl.zeros_like(q), q)
            do = tl.where(bad_do, tl.zeros_like(do), do)
    acc_v = _dot_split(pt, do, acc_v, PRECISION)
    acc_k = _dot_split(dst, q, acc_k, PRECISION)
    return acc_k, acc_v, nan_k, hidden


def _backward_supports(grad, q, k, v, out, lse, causal, scale, softcap=None, sliding_window=None):
    return _supports(q, k, v, causal, scale)  # the same grid (axis 1: B * Hkv) and head-dim limits


def _backward_configs(rows: int, sk: int, d: int, dv: int, dtype: torch.dtype, capped: bool = False) -> tuple:
    """Tiles of the dq pass (BLOCK_M packed query rows per program, BLOCK_N keys a step) and of the dk/dv pass
    (BLOCK_N keys per program, BLOCK_M query rows a step). GPU numbers are design choices for Hopper, sized
    by `tools/cuda_aot.py`'s registers and spills (docs/cuda.md), not timed. `capped`: a soft cap or a window
    (their per-score work costs registers)."""
    fit = lambda n, cap: max(16, min(cap, next_pow2(n)))  # noqa: E731 (tl.dot needs every dim >= 16)
    dims = {"BLOCK_D": max(16, next_pow2(d)), "BLOCK_DV": max(16, next_pow2(dv))}
    if INTERPRET:  # few, large programs: each tl.dot is one NumPy matmul
        cfg = {"BLOCK_M": fit(rows, 128), "BLOCK_N": fit(sk, 128), **dims, "num_warps": 4, "num_stages": 1}
        return cfg, cfg
    wide = max(dims.values())
    if dtype == torch.float32:  # IEEE FMA dots: small tiles (32 x 32 at D = 128 spilled 168 / 1804 bytes)
        b = 32 if wide <= 64 else 16
        cfg = {"BLOCK_M": b, "BLOCK_N": b, **dims, "num_warps": 8, "num_stages": 2}
        return cfg, cfg
    if wide <= 64:  # dq: 64 x 64 spilled up to 228 bytes in the causal launch
        return ({"BLOCK_M": 64, "BLOCK_N": 32, **dims, "num_warps": 8, "num_stages": 1},
                {"BLOCK_M": 32, "BLOCK_N": 64, **dims, "num_warps": 8, "num_stages": 2})
    # D = 128, dq: every 32- and 64-row tile tried spilled in the causal launch (64 x 16: 36-176 bytes, 32 x 32:
    # 64-256); 16 x 32 over 4 warps does not, but with cap + window it spilled 24 bytes (1 stage: 16; 8 warps: none).
    # dk/dv: 64 keys (wgmma) spilled 88-416 bytes; 32 keys do not
    if wide <= 128:
        return ({"BLOCK_M": 16, "BLOCK_N": 32, **dims, "num_warps": 8 if capped else 4, "num_stages": 2},
                {"BLOCK_M": 32, "BLOCK_N": 32, **dims, "num_warps": 8, "num_stages": 1})
    # D = 256 (Gemma 2): 32 x 32 over 4 warps spilled 1.8-3.6 KB in both passes, with or without cap and window;
    # 16 x 16 over 8 warps spills nothing (dq 194-196 registers, dk/dv 179-181)
    return ({"BLOCK_M": 16, "BLOCK_N": 16, **dims, "num_warps": 8, "num_stages": 2},
            {"BLOCK_M": 16, "BLOCK_N": 16, **dims, "num_warps": 8, "num_stages": 1})


def _backward_exact_config(cfg: dict) -> dict:
    """Tiles of the launches that recompute flagged tiles: small (the exact path's extra dots), and dividing
    the fast launch's, so each lies inside one flagged tile."""
    if INTERPRET:
        return cfg
    return {**cfg, "BLOCK_M": min(cfg["BLOCK_M"], 32), "BLOCK_N": min(cfg["BLOCK_N"], 32), "num_warps": 4,
            "num_stages": 1}


@impl(spec.backward_op, "cuda", supports=_backward_supports)
def attention_backward(grad, q, k, v, out, lse, causal: bool, scale, softcap=None, sliding_window=None):
    """dq, dk, dv: the dq pass (with D), then the dk/dv pass; each followed, when causal, by its
    exact re-run of flagged tiles. Deterministic: fixed tiles and orders, no atomics."""
    bsz, hq, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv_ = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if bsz * hq * sq == 0 or sk == 0:  # no query or no key: nothing sees anything
        return dq.zero_(), dk.zero_(), dv_.zero_()
    causal = causal and (sq > 1 or sliding_window is not None)  # as the forward
    group = hq // hkv
    rows = group * sq  # a KV head's packed query rows
    cfg_q, cfg_kv = _backward_configs(rows, sk, d, dv, q.dtype, softcap is not None or sliding_window is not None)
    extra = {"SOFTCAP": softcap is not None, "WINDOW": sliding_window is not None}
    cfg_q, cfg_kv = {**cfg_q, **extra}, {**cfg_kv, **extra}
    delta = torch.empty((2, bsz, hq, sq), dtype=torch.float32, device=q.device)  # D and dO . (v_j* - O) per row
    j_star = torch.empty((bsz, hq, sq), dtype=torch.int32, device=q.device)
    sm_scale = _softmax_scale(scale, d)
    common = (hkv, group, sq, sk, d, dv, *q.stride(), *k.stride(), *v.stride())
    window = 0 if sliding_window is None else min(int(sliding_window), sk + sq)
    tail = (*grad.stride(), *lse.stride(), sm_scale * LOG2E, sm_scale)
    cap = (1.0 if softcap is None else float(softcap) * LOG2E, window)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    flags = torch.empty((bsz * hkv, cdiv(rows, cfg_q["BLOCK_M"])), dtype=torch.int32, device=q.device) if causal else dq
    for c, exact in _launches(cfg_q, causal):
        _attention_dq_kernel[(cdiv(rows, c["BLOCK_M"]), bsz * hkv)](
            q, k, v, out, grad, lse, dq, delta[0], delta[1], j_star, flags, *common, *out.stride(), *tail,
            cfg_q["BLOCK_M"], *cap, CAUSAL=causal, EXACT=exact, PRECISION=precision, **c)
    flags = torch.empty((bsz * hkv, cdiv(sk, cfg_kv["BLOCK_N"])), dtype=torch.int32, device=q.device) if causal else dq
    for c, exact in _launches(cfg_kv, causal):
        _attention_dkdv_kernel[(cdiv(sk, c["BLOCK_N"]), bsz * hkv)](
            q, k, v, grad, lse, delta[0], delta[1], j_star, dk, dv_, flags, *common, *tail, cfg_kv["BLOCK_N"], *cap,
            CAUSAL=causal, EXACT=exact, PRECISION=precision, **c)
    return dq, dk, dv_


def _launches(cfg: dict, causal: bool) -> tuple:
    """(config, EXACT) of a pass's launches: the fast one, then (causal) the exact re-run of flagged tiles."""
    return ((cfg, False), (_backward_exact_config(cfg), True)) if causal else ((cfg, False),)
