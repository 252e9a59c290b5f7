"""varlen_attention's backward in Triton: FlashAttention-2's backward over the packed layout, two launches for all
sequences, no per-sequence Python loop, no atomics.

1. `_varlen_dq_kernel`, one program per (query block of a sequence, KV head): the query rows of a KV head's
   group within one sequence are packed as attention's ((g, i) -> row g * Sq + i), so GQA reads each key block
   once per group. D = rowsum(dO * O) in its prologue, then one pass over the sequence's visible key blocks
   recomputing P = exp2(s - lse) and dP = dO V^T; writes dq, D and each row's max-key terms.
2. `_varlen_dkdv_kernel`, one program per (key block of a sequence, KV head): one pass over that sequence's packed
   query rows that see the key block, so dk and dv sum over the group's query heads in a fixed order inside one
   program: deterministic.

Each program finds its sequence from its program id alone: the host makes, on the device, the prefix sums of each
sequence's block counts and, by `torch.searchsorted`, each program's sequence (no read of cu_seqlens, no sync);
the grid is their upper bound (blocks of the total plus one per sequence), and a program past the last block
exits. (A binary search inside the kernels, as the forward's, cost the dq pass about 60 registers a thread: at
D = 256 it spilled 104 bytes, against none with the table.) Its pointers then start at its sequence's first query
and key token and its lengths are its sequence's, so no program reads another sequence's tokens.

The numerics are attention's backward (opport/backends/cuda/attention.py, whose section comment explains them):
the exact dS of each row's max-score key j* (dS = P dO.(v_j* - O), where dP - D would cancel), and the EXACT
re-run of the tiles whose masked blocks hid NaN/inf in q, k or dO under a causal mask or window (the fast launch
zeroes them in its dot operands and flags its program). The block routines that implement them are attention's,
copied below unchanged (marked): they take a sequence's base pointers and lengths as they take one batch entry's.
"""

from collections.abc import Iterator

import torch

from opport.backends.cuda._launch import INTERPRET, cdiv, dot_operand, f32, narrow, next_pow2, tl, triton
from opport.backends.cuda.attention import LOG2E, MAX_GRID_Y, MAX_HEAD_DIM, _nonfinite_part, _softmax_scale
from opport.backends.cuda.varlen_attention import _block_sums
from opport.dispatch import impl
from opport.ops.varlen_attention import varlen_attention as spec


@triton.jit
def _varlen_dq_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, dq_ptr, delta_ptr, star_ptr, jstar_ptr,
    cu_q_ptr, cu_k_ptr, cu_blocks_ptr, seq_ptr, flag_ptr, cu_fast_ptr,
    # shapes, strides
    n_seq, group, d, dv,
    q_st, q_sh, q_sd,
    k_st, k_sh, k_sd,
    v_st, v_sh, v_sd,
    o_st, o_sh, o_sd,
    g_st, g_sh, g_sd,
    l_sh, l_st,
    dq_st, dq_sh, s_sh,
    qk_scale, scale, cap2, window, flag_block,
    # meta-parameters
    CAUSAL: tl.constexpr, EXACT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    SOFTCAP: tl.constexpr = False, WINDOW: tl.constexpr = False,
):
    """dq, D = rowsum(dO * O) and the max-key terms for BLOCK_M packed query rows of one sequence and KV head.

    Dimensions: q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv], o and do [Tq, Hq, Dv], lse [Hq, Tq] float32, all
    strided; dq [Tq, Hq, D] (strides dq_st, dq_sh, 1); delta, delta_star [Hq, Tq] float32 and j_star [Hq, Tq]
    int32 (stride s_sh); cu_q, cu_k [B + 1] int32 (validated); cu_blocks [B + 1] int32, the prefix sums of each
    sequence's blocks cdiv(group * Sq_b, BLOCK_M); seq [programs] int32, program p's sequence s (the last with
    cu_blocks[s] <= p); flags [programs, Hkv] int32.
    Grid: (cdiv(group * Tq, BLOCK_M) + B, Hkv); program p is block p - cu_blocks[s] of sequence s = seq[p];
    programs past the last block exit.
    Notes: the packed rows g * Sq + i of the sequence (query head hkv * group + g, token cu_q[s] + i); rows with
    lse = -inf take no part and get dq = 0. Key blocks every row sees in full run unmasked, the causal, window and
    tail blocks masked. The EXACT launch (its own cu_blocks; cu_fast is the fast launch's, flag_block its
    BLOCK_M, a multiple of this one) re-runs only the tiles inside flagged fast programs. The rest is
    `_attention_dq_kernel`'s (attention's section comment).
    Pseudocode: D = rowsum(dO O); for key block of the sequence: P = exp2(s - lse); dS = P (dO V^T - D);
                A += dS k; track j*. A += (P_j* dO.(v_j* - O) - dS_j*) k_j*; dq = scale A
    """
    pid = tl.program_id(0)
    hkv = tl.program_id(1).to(tl.int64)
    seq = tl.load(seq_ptr + pid)
    r0 = (pid - tl.load(cu_blocks_ptr + seq)) * BLOCK_M
    run = pid < tl.load(cu_blocks_ptr + n_seq)
    if EXACT:  # the fast launch's program that held these rows
        fast = (tl.load(cu_fast_ptr + seq) + r0 // flag_block).to(tl.int64)
        run = run & (tl.load(flag_ptr + fast * tl.num_programs(1) + hkv, mask=run, other=0) != 0)
    if run:
        q0 = tl.load(cu_q_ptr + seq).to(tl.int64)
        sq = (tl.load(cu_q_ptr + seq + 1) - q0).to(tl.int32)
        k0 = tl.load(cu_k_ptr + seq).to(tl.int64)
        sk = (tl.load(cu_k_ptr + seq + 1) - k0).to(tl.int32)
        row_ok, head, i = _seq_rows(r0, hkv, group, sq, BLOCK_M)
        tok = q0 + i
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        do_rows = do_ptr + tok * g_st + head * g_sh
        q, do, lse2, dead = _query_rows(q_ptr + tok * q_st + head * q_sh, do_rows, lse_ptr + head * l_sh + tok * l_st,
                                        row_ok, d, dv, q_sd, g_sd, offs_d, offs_dv)
        q_op, do_op = dot_operand(q), dot_operand(do)
        o_rows = o_ptr + tok * o_st + head * o_sh
        delta = tl.where(dead, 0.0, tl.sum(f32(do) * _load_rows(o_rows, row_ok, dv, o_sd, offs_dv), 1))
        k_base = k_ptr + k0 * k_st + hkv * k_sh
        v_base = v_ptr + k0 * v_st + hkv * v_sh
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
        # (distinct names for the unused flags: a name reused across loops would be loop-carried, changing type)
        for start in range(start0, mid, BLOCK_N):
            acc, star_score, star_key, star_x, nan_cols, _lead = _dq_block(
                acc, star_score, star_key, star_x, nan_cols, q_op, do_op, delta, lse2, k_base, v_base, start, i, off, sk,
                d, dv, k_st, k_sd, v_st, v_sd, qk_scale, offs_d, offs_dv, True, CAUSAL, EXACT, PRECISION, BLOCK_N,
                cap2, window, SOFTCAP, WINDOW)
            hidden += _lead
        for start in range(mid, full_end, BLOCK_N):
            acc, star_score, star_key, star_x, nan_cols, _mid = _dq_block(
                acc, star_score, star_key, star_x, nan_cols, q_op, do_op, delta, lse2, k_base, v_base, start, i, off, sk,
                d, dv, k_st, k_sd, v_st, v_sd, qk_scale, offs_d, offs_dv, False, False, False, PRECISION, BLOCK_N,
                cap2, window, SOFTCAP, False)
        for start in range(tl.maximum(mid, full_end), end, BLOCK_N):
            acc, star_score, star_key, star_x, nan_cols, _tail = _dq_block(
                acc, star_score, star_key, star_x, nan_cols, q_op, do_op, delta, lse2, k_base, v_base, start, i, off, sk,
                d, dv, k_st, k_sd, v_st, v_sd, qk_scale, offs_d, offs_dv, True, CAUSAL, EXACT, PRECISION, BLOCK_N,
                cap2, window, SOFTCAP, WINDOW)
            hidden += _tail
        acc, delta_star = _max_key_fix(acc, star_score, star_key, star_x, do_rows, g_sd, o_rows, o_sd, lse2, k_base,
                                       v_base, row_ok, sk, d, dv, k_st, k_sd, v_st, v_sd, offs_d, offs_dv, cap2, SOFTCAP)
        dq = acc * scale
        if EXACT:
            dq = tl.where(nan_cols > 0.0, float("nan"), dq)
        dq = tl.where(dead[:, None], 0.0, dq)
        tl.store(dq_ptr + (tok * dq_st + head * dq_sh)[:, None] + offs_d[None, :], narrow(dq, dq_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_d[None, :] < d))
        at_row = head * s_sh + tok
        tl.store(delta_ptr + at_row, delta, mask=row_ok)
        tl.store(star_ptr + at_row, delta_star, mask=row_ok)
        tl.store(jstar_ptr + at_row, star_key, mask=row_ok)
        if CAUSAL and not EXACT:
            tl.store(flag_ptr + pid.to(tl.int64) * tl.num_programs(1) + hkv, hidden)


@triton.jit
def _varlen_dkdv_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, star_ptr, jstar_ptr, dk_ptr, dv_ptr,
    cu_q_ptr, cu_k_ptr, cu_blocks_ptr, seq_ptr, flag_ptr, cu_fast_ptr,
    # shapes, strides
    n_seq, group, d, dv,
    q_st, q_sh, q_sd,
    k_st, k_sh, k_sd,
    v_st, v_sh, v_sd,
    g_st, g_sh, g_sd,
    l_sh, l_st,
    dk_st, dk_sh, dv_st, dv_sh, s_sh,
    qk_scale, scale, cap2, window, flag_block,
    # meta-parameters
    CAUSAL: tl.constexpr, EXACT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    SOFTCAP: tl.constexpr = False, WINDOW: tl.constexpr = False,
):
    """dk, dv for BLOCK_N keys of one sequence and KV head, summed over the group's query rows in a fixed order.

    Dimensions: as `_varlen_dq_kernel`; delta, delta_star, j_star are its outputs; dk [Tk, Hkv, D] and dv [Tk, Hkv,
    Dv] (strides dk_st, dk_sh, 1 and dv_st, dv_sh, 1); cu_blocks [B + 1] int32, the prefix sums of each sequence's
    key blocks cdiv(Sk_b, BLOCK_N); flags [programs, Hkv] int32.
    Grid: (cdiv(Tk, BLOCK_N) + B, Hkv), each program's sequence found as in `_varlen_dq_kernel`.
    Notes: the sequence's packed query rows (g * Sq + i), BLOCK_M at a time: with a causal mask, blocks none of
    whose rows sees a key of this block are skipped and blocks whose every row sees every key run unmasked (a
    window narrows both). Keys past the sequence's Sk load as 0 and only reach rows of dk, dv that are not stored;
    keys of a sequence without queries get dk = dv = 0. Tiles are keys x rows (s^T = k q^T), as attention's
    `_attention_dkdv_kernel`; the EXACT launch as in the dq pass, per key block.
    Pseudocode: for query block of the sequence: P = exp2(s - lse); dS = P (dO V^T - D), at (i, j*_i)
                P dO.(v_j* - O); dV += P^T dO; dK += dS^T q.  dk = scale dK
    """
    pid = tl.program_id(0)
    hkv = tl.program_id(1).to(tl.int64)
    seq = tl.load(seq_ptr + pid)
    j0 = (pid - tl.load(cu_blocks_ptr + seq)) * BLOCK_N
    run = pid < tl.load(cu_blocks_ptr + n_seq)
    if EXACT:
        fast = (tl.load(cu_fast_ptr + seq) + j0 // flag_block).to(tl.int64)
        run = run & (tl.load(flag_ptr + fast * tl.num_programs(1) + hkv, mask=run, other=0) != 0)
    if run:
        q0 = tl.load(cu_q_ptr + seq).to(tl.int64)
        sq = (tl.load(cu_q_ptr + seq + 1) - q0).to(tl.int32)
        k0 = tl.load(cu_k_ptr + seq).to(tl.int64)
        sk = (tl.load(cu_k_ptr + seq + 1) - k0).to(tl.int32)
        keys = j0 + tl.arange(0, BLOCK_N)
        tok_k = k0 + keys.to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        k = tl.load(k_ptr + hkv * k_sh + tok_k[:, None] * k_st + offs_d[None, :] * k_sd,
                    mask=(keys[:, None] < sk) & (offs_d[None, :] < d), other=0.0)
        v = tl.load(v_ptr + hkv * v_sh + tok_k[:, None] * v_st + offs_dv[None, :] * v_sd,
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
            row_ok, head, i = _seq_rows(r0, hkv, group, sq, BLOCK_M)
            tok = q0 + i
            q_rows = q_ptr + tok * q_st + head * q_sh
            do_rows = do_ptr + tok * g_st + head * g_sh
            lse_rows = lse_ptr + head * l_sh + tok * l_st
            at_row = head * s_sh + tok
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
                        acc_k, acc_v, nan_k, _whole = _dkdv_block(
                            acc_k, acc_v, nan_k, k_op, v_op, q_rows, do_rows, lse_rows, stats, row_ok, i, keys, off,
                            d, dv, q_sd, g_sd, qk_scale, offs_d, offs_dv, False, False, PRECISION, cap2, window,
                            SOFTCAP, False)
                    else:
                        acc_k, acc_v, nan_k, _part = _dkdv_block(
                            acc_k, acc_v, nan_k, k_op, v_op, q_rows, do_rows, lse_rows, stats, row_ok, i, keys, off,
                            d, dv, q_sd, g_sd, qk_scale, offs_d, offs_dv, True, EXACT, PRECISION, cap2, window,
                            SOFTCAP, WINDOW)
                        hidden += _part
            else:
                acc_k, acc_v, nan_k, _all = _dkdv_block(
                    acc_k, acc_v, nan_k, k_op, v_op, q_rows, do_rows, lse_rows, stats, row_ok, i, keys, off, d, dv,
                    q_sd, g_sd, qk_scale, offs_d, offs_dv, False, False, PRECISION, cap2, window, SOFTCAP, False)
        dk = acc_k * scale
        if EXACT:
            dk = tl.where(nan_k > 0.0, float("nan"), dk)
        key_ok = keys[:, None] < sk
        tl.store(dk_ptr + (tok_k * dk_st + hkv * dk_sh)[:, None] + offs_d[None, :], narrow(dk, dk_ptr.dtype.element_ty),
                 mask=key_ok & (offs_d[None, :] < d))
        tl.store(dv_ptr + (tok_k * dv_st + hkv * dv_sh)[:, None] + offs_dv[None, :],
                 narrow(acc_v, dv_ptr.dtype.element_ty), mask=key_ok & (offs_dv[None, :] < dv))
        if CAUSAL and not EXACT:
            tl.store(flag_ptr + pid.to(tl.int64) * tl.num_programs(1) + hkv, hidden)


@triton.jit
def _seq_rows(r0, hkv, group, sq, BLOCK_M: tl.constexpr):
    """Rows r0 .. r0 + BLOCK_M of a KV head's packed query rows in one sequence (row g * Sq + i is query head
    hkv * group + g, position i): (in range, query head, position), int64. sq > 0 wherever a block exists."""
    r = r0 + tl.arange(0, BLOCK_M)
    n = tl.maximum(sq, 1)  # (never 0 in a running program; kept off a division by zero)
    return r < group * sq, hkv * group + (r // n).to(tl.int64), (r % n).to(tl.int64)


def _supports(grad, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, scale, softcap=None, sliding_window=None):
    if q.shape[-1] > MAX_HEAD_DIM or v.shape[-1] > MAX_HEAD_DIM:
        return f"head dims D={q.shape[-1]}, Dv={v.shape[-1]}: the Triton kernels take D, Dv <= {MAX_HEAD_DIM}"
    if k.shape[1] > MAX_GRID_Y:
        return f"Hkv = {k.shape[1]} exceeds the grid's {MAX_GRID_Y} (axis 1)"
    return None


def _configs(rows: int, keys: int, d: int, dv: int, dtype: torch.dtype, capped: bool = False) -> tuple:
    """Tiles of the dq pass (BLOCK_M packed query rows per program, BLOCK_N keys a step) and of the dk/dv pass
    (BLOCK_N keys per program, BLOCK_M query rows a step) from the mean packed rows (group x Tq / B) and keys
    (Tk / B) of a sequence, known without reading cu_seqlens. On a GPU, attention's backward tiles (sized for
    sm_90 by tools/cuda_aot.py's registers and spills, docs/cuda.md; not timed): the block routines are the same.
    `capped`: a soft cap or a window (their per-score work costs registers)."""
    fit = lambda n, cap: max(16, min(cap, next_pow2(n)))  # noqa: E731 (tl.dot needs every dim >= 16)
    dims = {"BLOCK_D": max(16, next_pow2(d)), "BLOCK_DV": max(16, next_pow2(dv))}
    if INTERPRET:  # few, large programs: each tl.dot is one NumPy matmul
        cfg = {"BLOCK_M": fit(rows, 128), "BLOCK_N": fit(keys, 128), **dims, "num_warps": 4, "num_stages": 1}
        return cfg, cfg
    wide = max(dims.values())
    if dtype == torch.float32:  # IEEE FMA dots: small tiles
        b = 32 if wide <= 64 else 16
        cfg = {"BLOCK_M": b, "BLOCK_N": b, **dims, "num_warps": 8, "num_stages": 2}
        return cfg, cfg
    if wide <= 64:
        return ({"BLOCK_M": 64, "BLOCK_N": 32, **dims, "num_warps": 8, "num_stages": 1},
                {"BLOCK_M": 32, "BLOCK_N": 64, **dims, "num_warps": 8, "num_stages": 2})
    if wide <= 128:  # dq over 4 warps spilled 16 bytes here (attention's takes 4 without cap or window); 8 spill none
        return ({"BLOCK_M": 16, "BLOCK_N": 32, **dims, "num_warps": 8, "num_stages": 2},
                {"BLOCK_M": 32, "BLOCK_N": 32, **dims, "num_warps": 8, "num_stages": 1})
    # D = 256: attention's 16 x 16 over 8 warps (dq 191 registers, no spill)
    return ({"BLOCK_M": 16, "BLOCK_N": 16, **dims, "num_warps": 8, "num_stages": 2},
            {"BLOCK_M": 16, "BLOCK_N": 16, **dims, "num_warps": 8, "num_stages": 1})


def _exact_config(cfg: dict) -> dict:
    """Tiles of the launches that recompute flagged tiles: small (the exact path's extra dots), and dividing the
    fast launch's, so each lies inside one flagged tile."""
    if INTERPRET:
        return cfg
    return {**cfg, "BLOCK_M": min(cfg["BLOCK_M"], 32), "BLOCK_N": min(cfg["BLOCK_N"], 32), "num_warps": 4,
            "num_stages": 1}


@impl(spec.backward_op, "cuda", supports=_supports)
def varlen_attention_backward(grad, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal: bool, scale, softcap=None,
                              sliding_window=None):
    """dq, dk, dv: the dq pass (with D) over every sequence's query blocks, then the dk/dv pass over every sequence's
    key blocks; each followed, with a causal mask, by its exact re-run of flagged tiles. Block prefix sums are made
    on the device (no host read of cu_seqlens). Deterministic: fixed tiles and orders, no atomics."""
    tq, hq, d = q.shape
    tk, hkv, dv = v.shape
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv_ = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if tq * hq == 0 or tk == 0:  # no query or no key: nothing sees anything
        return dq.zero_(), dk.zero_(), dv_.zero_()
    n_seq = cu_seqlens_q.shape[0] - 1  # >= 1: cu_seqlens end at Tq > 0
    group = hq // hkv
    cu_q, cu_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    capped = softcap is not None or sliding_window is not None
    cfg_q, cfg_kv = _configs(group * max(1, tq // n_seq), max(1, tk // n_seq), d, dv, q.dtype, capped)
    stats = torch.empty((2, hq, tq), dtype=torch.float32, device=q.device)  # D and dO . (v_j* - O) per row
    j_star = torch.empty((hq, tq), dtype=torch.int32, device=q.device)
    sm_scale = _softmax_scale(scale, d)
    window = 0 if sliding_window is None else min(int(sliding_window), tq + tk)
    common = (n_seq, group, d, dv, *q.stride(), *k.stride(), *v.stride())
    tail = (sm_scale * LOG2E, sm_scale, 1.0 if softcap is None else float(softcap) * LOG2E, window)
    meta = dict(CAUSAL=bool(causal), PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                SOFTCAP=softcap is not None, WINDOW=sliding_window is not None)
    fast = _block_sums(cu_q, cfg_q["BLOCK_M"], group)
    flags = torch.empty((cdiv(group * tq, cfg_q["BLOCK_M"]) + n_seq, hkv), dtype=torch.int32, device=q.device) \
        if causal else dq
    for c, exact in _launches(cfg_q, causal, flags):
        blocks = fast if c["BLOCK_M"] == cfg_q["BLOCK_M"] else _block_sums(cu_q, c["BLOCK_M"], group)
        grid = cdiv(group * tq, c["BLOCK_M"]) + n_seq
        _varlen_dq_kernel[(grid, hkv)](
            q, k, v, out, grad, lse, dq, stats[0], stats[1], j_star, cu_q, cu_k, blocks, _sequences(blocks, grid),
            flags, fast, *common,
            *out.stride(), *grad.stride(), *lse.stride(), dq.stride(0), dq.stride(1), tq, *tail, cfg_q["BLOCK_M"],
            EXACT=exact, **meta, **c)
    fast = _block_sums(cu_k, cfg_kv["BLOCK_N"])
    flags = torch.empty((cdiv(tk, cfg_kv["BLOCK_N"]) + n_seq, hkv), dtype=torch.int32, device=q.device) \
        if causal else dq
    for c, exact in _launches(cfg_kv, causal, flags):
        blocks = fast if c["BLOCK_N"] == cfg_kv["BLOCK_N"] else _block_sums(cu_k, c["BLOCK_N"])
        grid = cdiv(tk, c["BLOCK_N"]) + n_seq
        _varlen_dkdv_kernel[(grid, hkv)](
            q, k, v, grad, lse, stats[0], stats[1], j_star, dk, dv_, cu_q, cu_k, blocks, _sequences(blocks, grid),
            flags, fast, *common,
            *grad.stride(), *lse.stride(), dk.stride(0), dk.stride(1), dv_.stride(0), dv_.stride(1), tq, *tail,
            cfg_kv["BLOCK_N"], EXACT=exact, **meta, **c)
    return dq, dk, dv_


def _sequences(blocks, grid: int):
    """[grid] int32 on the device: each program's sequence, the last s with blocks[s] <= p (blocks: the prefix sums of
    the sequences' block counts; programs past the last block get the last sequence, and exit)."""
    ids = torch.arange(grid, dtype=torch.int32, device=blocks.device)
    seq = torch.searchsorted(blocks, ids, right=True) - 1
    return seq.clamp_(max=blocks.shape[0] - 2).to(torch.int32)


def _launches(cfg: dict, causal: bool, flags) -> Iterator[tuple]:
    """(config, EXACT) of a pass's launches: the fast one, then (causal) the exact re-run of flagged tiles. Yielded
    lazily: in the interpreter (flags in host memory, no sync to read) the re-run is left out when the fast launch
    flagged nothing, where every one of its programs would exit at once."""
    yield cfg, False
    if causal and not (INTERPRET and not bool(flags.any())):
        yield _exact_config(cfg), True


# --------------------------------------------------------------------------- attention's backward block routines
# Copied unchanged from opport/backends/cuda/attention.py (its backward section), where they are documented; they
# address one sequence's tokens through base pointers and strides as they do one batch entry's.


@triton.jit
def _softcap_slope(s, cap):
    """(cap·tanh(s / cap), its derivative 1 - tanh²(s / cap)) for the backward's chain rule."""
    x = s / cap
    e = tl.exp2(tl.abs(x) * (-2.0 * 1.4426950408889634))
    t = (1.0 - e) / (1.0 + e)
    t = tl.where(x < 0, -t, t)
    return cap * t, 1.0 - t * t


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
