"""varlen_attention in Triton: one program per (query block, query head), its sequence found through cu_seqlens.

The key-block loop is attention's (`_attn_block`: online softmax, soft cap, causal and window masks); the
program's K/V pointers start at its sequence's first key and its key count is that sequence's, so no
program reads another sequence's keys or values.
"""

import torch

from opport.backends.cuda._launch import INTERPRET, cdiv, dot_operand, next_pow2, tl, triton
from opport.backends.cuda.attention import (
    LOG2E,
    MAX_GRID_Y,
    MAX_HEAD_DIM,
    _attn_block,
    _exact_config,
    _softmax_scale,
    _store_lse,
    _store_out,
)
from opport.dispatch import impl
from opport.ops.varlen_attention import varlen_attention as spec


@triton.jit
def _varlen_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, out_ptr, cu_q_ptr, cu_k_ptr, cu_blocks_ptr, flag_ptr, cu_fast_ptr, lse_ptr,
    # shapes, strides
    n_seq, group, d, dv,
    q_st, q_sh, q_sd,
    k_st, k_sh, k_sd,
    v_st, v_sh, v_sd,
    o_st, o_sh, o_sd,
    l_sh, l_st,
    qk_scale, cap2, window, search_steps, flag_block,
    # meta-parameters
    CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr, EXACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    STORE_LSE: tl.constexpr = False,
):
    """out[t, h] for BLOCK_M query tokens of one sequence and head.

    Dimensions: q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv], out [Tq, Hq, Dv], all strided; cu_q, cu_k [B + 1]
    int32 (validated: 0 = cu[0] <= ... <= cu[B] = T); cu_blocks [B + 1] int32, the prefix sums of each
    sequence's query blocks cdiv(len, BLOCK_M). Grid: (cdiv(Tq, BLOCK_M) + B, Hq), an upper bound of the
    blocks that needs no read of cu_seqlens on the host; program p finds its sequence, the last s with
    cu_blocks[s] <= p, by a binary search of search_steps >= log2(B + 1) steps (a runtime count: a new batch
    size compiles nothing); programs past the last block exit.
    Notes: as attention's kernel: blocks every row sees whole run unmasked, the rest masked (key count,
    causal, window); NaN/inf in v under the causal mask as there: the fast launch zeroes them and flags its
    program (flags [programs, Hq] int32); the EXACT launch (small tiles, its own cu_blocks; cu_fast is the fast
    launch's, flag_block its BLOCK_M, a multiple of this one) re-runs only the tiles inside flagged ones.
    STORE_LSE (the training forward): each row's log-sum-exp into lse [Hq, Tq] float32 (strided), -inf for a row
    that saw no key or only -inf scores, from the running max and sum (`_store_lse`).
    Pseudocode: per key block of the sequence: s = q k^T (capped); online softmax; out = acc / l (0 if l = 0)
    """
    pid = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    lo = pid * 0
    hi = lo + n_seq - 1
    for _step in range(search_steps):  # invariant: the sequence is in [lo, hi]
        mid = (lo + hi + 1) // 2
        below = tl.load(cu_blocks_ptr + mid) <= pid
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid - 1)
    seq = lo
    pid_m = pid - tl.load(cu_blocks_ptr + seq)
    q0 = tl.load(cu_q_ptr + seq).to(tl.int64)
    sq = (tl.load(cu_q_ptr + seq + 1) - q0).to(tl.int32)
    k0 = tl.load(cu_k_ptr + seq).to(tl.int64)
    sk = (tl.load(cu_k_ptr + seq + 1) - k0).to(tl.int32)
    r0 = pid_m * BLOCK_M
    run = pid < tl.load(cu_blocks_ptr + n_seq)
    if EXACT:  # the fast launch's program that held these rows
        fast = tl.load(cu_fast_ptr + seq) + r0 // flag_block
        run = run & (tl.load(flag_ptr + fast.to(tl.int64) * tl.num_programs(1) + head, mask=run, other=0) != 0)
    if run:
        i = r0 + tl.arange(0, BLOCK_M)
        row_ok = i < sq
        hkv = head // group
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        q_rows = q_ptr + (q0 + i.to(tl.int64)) * q_st + head * q_sh
        q = tl.load(q_rows[:, None] + offs_d[None, :] * q_sd, mask=row_ok[:, None] & (offs_d[None, :] < d), other=0.0)
        q = dot_operand(q)
        k_base = k_ptr + k0 * k_st + hkv * k_sh
        v_base = v_ptr + k0 * v_st + hkv * v_sh
        off = sk - sq
        i_lo = r0
        i_hi = tl.minimum(r0 + BLOCK_M, sq) - 1
        if CAUSAL:
            full_end = tl.minimum(tl.maximum(i_lo + off + 1, 0), sk) // BLOCK_N * BLOCK_N
            end = tl.minimum(tl.maximum(i_hi + off + 1, 0), sk)
        else:
            full_end = sk // BLOCK_N * BLOCK_N
            end = sk
        start0 = 0
        mid = 0
        if WINDOW:
            start0 = tl.minimum(tl.maximum(i_lo + off + 1 - window, 0), sk) // BLOCK_N * BLOCK_N
            mid = tl.minimum(tl.cdiv(tl.minimum(tl.maximum(i_hi + off + 1 - window, 0), sk), BLOCK_N) * BLOCK_N, end)
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_sum = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
        hidden = 0  # masked blocks with non-finite v (fast launch)
        # (distinct names for the unused flags: a name reused across loops would be loop-carried, changing type)
        for start in range(start0, mid, BLOCK_N):
            acc, m, l_sum, _lead = _attn_block(acc, m, l_sum, q, k_base, v_base, start, i, off, sk, d, dv, k_st, k_sd,
                                               v_st, v_sd, qk_scale, offs_d, offs_dv, True, CAUSAL, EXACT, PRECISION,
                                               BLOCK_N, cap2, window, SOFTCAP, WINDOW)
            hidden += _lead
        for start in range(mid, full_end, BLOCK_N):
            acc, m, l_sum, _mid = _attn_block(acc, m, l_sum, q, k_base, v_base, start, i, off, sk, d, dv, k_st, k_sd,
                                           v_st, v_sd, qk_scale, offs_d, offs_dv, False, False, False, PRECISION,
                                           BLOCK_N, cap2, window, SOFTCAP, False)
        for start in range(tl.maximum(mid, full_end), end, BLOCK_N):
            acc, m, l_sum, _tail = _attn_block(acc, m, l_sum, q, k_base, v_base, start, i, off, sk, d, dv, k_st, k_sd,
                                               v_st, v_sd, qk_scale, offs_d, offs_dv, True, CAUSAL, EXACT, PRECISION,
                                               BLOCK_N, cap2, window, SOFTCAP, WINDOW)
            hidden += _tail
        _store_out(out_ptr, acc, l_sum, 0, head, q0 + i.to(tl.int64), offs_dv,
                   row_ok[:, None] & (offs_dv[None, :] < dv), 0, o_sh, o_st, o_sd)
        if STORE_LSE:
            _store_lse(lse_ptr, m, l_sum, head * l_sh + (q0 + i.to(tl.int64)) * l_st, row_ok)
        if CAUSAL and not EXACT:
            tl.store(flag_ptr + pid.to(tl.int64) * tl.num_programs(1) + head, hidden)


def _supports(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, softcap, sliding_window):
    if q.shape[-1] > MAX_HEAD_DIM or v.shape[-1] > MAX_HEAD_DIM:
        return f"head dims D={q.shape[-1]}, Dv={v.shape[-1]}: the Triton kernel takes D, Dv <= {MAX_HEAD_DIM}"
    if q.shape[1] > MAX_GRID_Y:
        return f"Hq = {q.shape[1]} exceeds the grid's {MAX_GRID_Y} (axis 1)"
    return None


def _config(mean_sq: int, d: int, dv: int, dtype: torch.dtype, capped: bool = False) -> dict:
    """Tiles from the mean query length Tq / B (decode: 16-row tiles), known without reading cu_seqlens: attention's
    prefill tiles otherwise (not yet timed on hardware; spills checked by tools/cuda_aot.py). `capped`: a soft cap
    or a window (their per-score work costs registers)."""
    block_d, block_dv = max(16, next_pow2(d)), max(16, next_pow2(dv))
    fit = lambda n, cap: max(16, min(cap, next_pow2(n)))  # noqa: E731 (tl.dot needs every dim >= 16)
    dims = {"BLOCK_D": block_d, "BLOCK_DV": block_dv}
    if INTERPRET:
        return {"BLOCK_M": fit(mean_sq, 128), "BLOCK_N": 64, **dims, "num_warps": 4, "num_stages": 1}
    wide = max(block_d, block_dv)
    if dtype == torch.float32:
        return {"BLOCK_M": 16, "BLOCK_N": 64 if wide <= 128 else 16, **dims, "num_warps": 8, "num_stages": 2}
    if wide <= 128:
        return {"BLOCK_M": fit(mean_sq, 128), "BLOCK_N": 64, **dims, "num_warps": 8, "num_stages": 3}
    # D = 256 with cap + window: 64 x 32 spilled 16 bytes (1 stage: 224, 4 warps: 1096); 64 x 16 spills none
    n = 16 if capped else 32
    return {"BLOCK_M": fit(mean_sq, 64), "BLOCK_N": n, **dims, "num_warps": 8, "num_stages": 2}


@impl(spec, "cuda", supports=_supports)
def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool, scale, softcap, sliding_window):
    """Host side: each sequence's query-block count and their prefix sums on the device (no host read of
    cu_seqlens, no sync); every program then finds its sequence through them."""
    return _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, softcap, sliding_window, None)


@impl(spec.train_forward, "cuda", supports=_supports)
def varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool, scale, softcap, sliding_window):
    """The forward plus each token's log-sum-exp per query head, lse [Hq, Tq] (float32), from the same launch's
    running max and sum."""
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    return _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, softcap, sliding_window, lse), lse


def _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool, scale, softcap, sliding_window, lse):
    tq, hq, d = q.shape
    dv = v.shape[2]
    out = torch.empty((tq, hq, dv), dtype=q.dtype, device=q.device)
    n_seq = cu_seqlens_q.shape[0] - 1
    if tq * hq == 0 or (out.numel() == 0 and lse is None):  # (Tq > 0 implies a sequence: cu ends at Tq)
        return out
    cu_q, cu_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    cfg = _config(max(1, tq // n_seq), d, dv, q.dtype, softcap is not None or sliding_window is not None)
    fast_blocks = _block_sums(cu_q, cfg["BLOCK_M"])
    flags = torch.empty((cdiv(tq, cfg["BLOCK_M"]) + n_seq, hq), dtype=torch.int32, device=q.device) if causal else out
    window = 0 if sliding_window is None else min(int(sliding_window), 2**30)
    args = (lse if lse is not None else out, n_seq, hq // k.shape[1], d, dv, *q.stride(), *k.stride(), *v.stride(),
            *out.stride(), *(lse.stride() if lse is not None else (0, 0)), _softmax_scale(scale, d) * LOG2E,
            1.0 if softcap is None else float(softcap) * LOG2E, window, n_seq.bit_length(), cfg["BLOCK_M"])
    meta = dict(CAUSAL=bool(causal), SOFTCAP=softcap is not None, WINDOW=sliding_window is not None,
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32", STORE_LSE=lse is not None)
    launches = [(cfg, fast_blocks, False)]
    if causal:  # re-run the tiles whose masked blocks hid NaN/inf in v (unflagged programs exit at once)
        fix = _exact_config(cfg)
        launches.append((fix, fast_blocks if fix is cfg else _block_sums(cu_q, fix["BLOCK_M"]), True))
    for c, blocks, exact in launches:
        if exact and INTERPRET and not bool(flags.any()):  # (host memory: no sync) every program would exit at once
            continue
        _varlen_kernel[(cdiv(tq, c["BLOCK_M"]) + n_seq, hq)](q, k, v, out, cu_q, cu_k, blocks, flags, fast_blocks, *args,
                                                             EXACT=exact, **meta, **c)
    return out


def _block_sums(cu, bm: int, rows: int = 1):
    """[B + 1] int32: prefix sums of each sequence's blocks cdiv(rows * len, bm) (rows: GQA-packed query heads per
    token), on the device (no sync)."""
    blocks = torch.zeros(cu.shape[0], dtype=torch.int32, device=cu.device)
    torch.cumsum(((cu[1:] - cu[:-1]) * rows + (bm - 1)) // bm, 0, out=blocks[1:])
    return blocks
