"""paged_varlen_attention in Triton: one launch for a mixed batch of decodes and prefill chunks over a paged cache.

Program (query tile, KV head) holds BLOCK_Q new tokens of one sequence times the g = Hq / Hkv query heads of its
KV head as the BLOCK_M = BLOCK_Q * BLOCK_G rows of one tile (a decode's g heads fill the rows a token alone would
leave empty), and walks the positions its tokens see, BLOCK_N at a time, each row gathered through the block
table. The tiles of all sequences are numbered in one grid axis: sequence b's first tile is
cu_seqlens_q[b] // BLOCK_Q + b, so the grid size, T // BLOCK_Q + B, comes from shapes alone (no device-to-host
read, nothing that breaks CUDA-graph capture) and each program finds its sequence by a binary search over
cu_seqlens_q (vLLM's unified attention numbers its tiles the same way).

fp8 caches with k_scale and v_scale (per tensor or per token and head) are read as paged_attention.py's kernel reads
them (`k_operand`, `v_values`, constexpr KV_SCALE; a cache in q's dtype compiles as before).
"""

import math

import torch

from opport.backends.cuda._launch import INTERPRET, dot_operand, next_pow2, tl, triton
from opport.backends.cuda.attention import _nonfinite_part
from opport.backends.cuda.paged_attention import (
    MAX_HEAD_DIM,
    PER_TENSOR,
    PER_TOKEN,
    _tanh,
    cache_view,
    k_operand,
    kv_scale_args,
    v_values,
)
from opport.dispatch import impl
from opport.ops.paged_varlen_attention import paged_varlen_attention as spec

MAX_GROUP = 64  # query heads per KV head held as tile rows
ROWS = 64  # rows per tile: BLOCK_Q tokens x BLOCK_G heads


@triton.jit
def _find_sequence(cu_ptr, cu_s, tile, n_seqs, n_steps, BLOCK_Q: tl.constexpr):
    """The sequence b whose tiles hold `tile`: the last b with cu[b] // BLOCK_Q + b <= tile (bisection in n_steps =
    ceil(log2(n_seqs)) + 1 rounds)."""
    lo = 0
    hi = n_seqs - 1
    for _ in range(0, n_steps):  # invariant: start(lo) <= tile (start(0) = 0), and the answer is in [lo, hi]
        mid = (lo + hi + 1) // 2
        go = tl.load(cu_ptr + mid * cu_s) // BLOCK_Q + mid <= tile
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    return lo


@triton.jit
def _paged_varlen_kernel(
    # pointers
    q_ptr, kc_ptr, vc_ptr, bt_ptr, cu_ptr, len_ptr, out_ptr, flag_ptr, ks_ptr, vs_ptr,
    # shapes, strides
    n_seqs, n_tokens, n_steps, hkv, group, d, dv, block_size, num_blocks, capacity, window,
    cu_s, len_s, q_st, q_sh, q_sd,
    k_sb, k_so, k_sh, k_sd,
    v_sb, v_so, v_sh, v_sd,
    bt_sb, bt_sm,
    o_st, o_sh, o_sd,
    ks_sb, ks_so, ks_sh, vs_sb, vs_so, vs_sh,
    scale, softcap,
    # meta-parameters
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr, EXACT: tl.constexpr,
    KV_SCALE: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, E5M2: tl.constexpr, SUB_UNIT: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """One query tile of one sequence and one KV head: online softmax over the positions its tokens see.

    Dimensions: q [T, Hq, D], caches [num_blocks, block_size, Hkv, D/Dv], block_tables [B, max_blocks] int32,
    cu_seqlens_q [B + 1] int32, context_lens [B] int32, out [T, Hq, Dv]; all strided. fp8 caches (KV_SCALE):
    k_scale, v_scale float32, [1] (PER_TENSOR) or [num_blocks, block_size, Hkv] (PER_TOKEN, strided).
    Args: window: sliding window W (WINDOW); softcap: c (SOFTCAP); n_steps: bisection rounds, ceil(log2(B + 1));
    KV_SCALE: NO_SCALE (caches in q's dtype; ks_ptr, vs_ptr unused), PER_TENSOR or PER_TOKEN; MANT, BIAS, E5M2,
    SUB_UNIT: the fp8 format (the interpreter's exact decoding).
    Returns: out rows of the tile's tokens and heads.
    Notes: row r is token r // BLOCK_G of the tile, head r % BLOCK_G of the group; token i of a sequence with n new
    tokens and context ctx is at position p = ctx - n + i and sees positions in (p - W, p]. Keys are loaded only
    in [the first row's window start, the last row's position] (masked loads read no memory), so slots outside
    every row's view, blocks of other sequences and table padding are never touched; within that range a key a
    row does not see gets -inf before the max (weight exactly 0). Where v holds NaN/inf in a block (a row that
    masks it would compute 0 * inf = NaN in the dot), the fast launch zeroes those entries and raises the tile's
    flag; a second launch (EXACT) recomputes only flagged tiles, adding the non-finite entries back to exactly
    the rows that see them (attention's `_nonfinite_part`), which keeps that path's registers out of the fast
    kernel. Scores are float32, taken to base 2 for exp2;
    P stays float32 for the second dot (tf32 on 16-bit inputs), as in paged_attention. A program past its
    sequence's last tile (the grid's slack) exits after the search. Tables, lengths and cu_seqlens_q are checked
    on the host before the launch, except on device arrays without OPPORT_CHECK_VALUES=1 (a host read per call
    would break CUDA-graph capture): then nothing outside q, out, the tables or the caches is touched (lengths
    clamped, stray blocks replaced by block 0, token rows outside [0, T) masked), the rows of a sequence with an
    invalid length, query count, token range or block come out NaN, rows no program reaches keep out's initial
    NaN (cu_seqlens_q that decrease can still leave two sequences' rows overlapping: those are unspecified).
    fp8 (as paged_attention's kernel): K's codes enter the dot in q's dtype (exact), k_scale multiplies the scores
    (folded into `scale` per tensor, per column per token); V's codes are widened exactly to float32 and multiplied
    by v_scale before the NaN/inf test and the P @ V dot, so non-finite values (NaN codes, e5m2 inf) take the same
    exact path as a 16-bit cache's. Scales load under the codes' masks (the NaN scales of unseen slots are never read).
    Pseudocode: b = sequence of this tile; for each BLOCK_N positions: blk = table[b, pos // bs];
                k, v = cache[blk, pos % bs, h]; s = mask(q k^T (x k_scale)); v = v (x v_scale); online softmax;
                out = acc / l
    """
    tile = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = _find_sequence(cu_ptr, cu_s, tile, n_seqs, n_steps, BLOCK_Q)
    t_start = tl.load(cu_ptr + b * cu_s)
    n_new = tl.load(cu_ptr + (b + 1) * cu_s) - t_start
    i0 = (tile - (t_start // BLOCK_Q + b)) * BLOCK_Q  # the tile's first token within the sequence
    flag = flag_ptr + tile * hkv + h
    run = i0 < n_new
    if EXACT:
        run = run & (tl.load(flag) != 0)
    if run:
        ctx = tl.load(len_ptr + b * len_s)
        # checked on the host except for device arrays (see the notes)
        invalid = (ctx < 0) | (ctx > capacity) | (n_new > ctx) | (i0 < 0) | (t_start < 0) | (t_start + n_new > n_tokens)
        ctx = tl.minimum(tl.maximum(ctx, 0), capacity)
        rows = tl.arange(0, BLOCK_Q * BLOCK_G)
        tok = i0 + rows // BLOCK_G
        g = rows % BLOCK_G
        t_row = (t_start + tok).to(tl.int64)
        row_ok = (tok < n_new) & (g < group) & (t_row >= 0) & (t_row < n_tokens)
        pos = ctx - n_new + tok  # each row's own position
        head = h * group + g
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        q = tl.load(q_ptr + t_row[:, None] * q_st + head[:, None] * q_sh + offs_d[None, :] * q_sd,
                    mask=row_ok[:, None] & (offs_d[None, :] < d), other=0.0)
        q = dot_operand(q)
        v_mul = 1.0  # per tensor: v_scale (k_scale joins `scale`)
        if KV_SCALE == PER_TENSOR:
            scale = scale * tl.load(ks_ptr)
            v_mul = tl.load(vs_ptr)
        first = ctx - n_new + i0  # the tile's first token's position
        end = tl.minimum(ctx, first + BLOCK_Q)  # one past its last token's
        start = 0
        if WINDOW:
            start = tl.maximum(first + 1 - window, 0)
        m = tl.full((BLOCK_Q * BLOCK_G,), float("-inf"), tl.float32)
        l_sum = tl.zeros((BLOCK_Q * BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_Q * BLOCK_G, BLOCK_DV), tl.float32)
        hidden = 0  # blocks whose v held NaN/inf (the fast launch zeroed them)
        for s0 in range(start, end, BLOCK_N):
            kpos = s0 + tl.arange(0, BLOCK_N)
            ok = kpos < end
            blk = tl.load(bt_ptr + b * bt_sb + (kpos // block_size) * bt_sm, mask=ok, other=0).to(tl.int64)
            stray = ok & ((blk < 0) | (blk >= num_blocks))
            invalid = invalid | (tl.max(stray.to(tl.int32), 0) > 0)
            blk = tl.where(stray, 0, blk)
            off = (kpos % block_size).to(tl.int64)
            kt = tl.load(kc_ptr + blk[None, :] * k_sb + off[None, :] * k_so + h * k_sh + offs_d[:, None] * k_sd,
                         mask=ok[None, :] & (offs_d[:, None] < d), other=0.0)
            s = tl.dot(q, k_operand(kt, q, KV_SCALE, MANT, BIAS, E5M2, SUB_UNIT), input_precision=PRECISION) * scale
            if KV_SCALE == PER_TOKEN:
                ks = tl.load(ks_ptr + blk * ks_sb + off * ks_so + h * ks_sh, mask=ok, other=0.0)
                s = s * ks[None, :]
            if SOFTCAP:
                s = softcap * _tanh(s / softcap)
            seen = ok[None, :] & (kpos[None, :] <= pos[:, None])
            if WINDOW:
                seen = seen & (kpos[None, :] > pos[:, None] - window)
            s = tl.where(seen, s * 1.4426950408889634, float("-inf"))  # log2(e): exp2 from here on
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_safe)
            pr = tl.exp2(s - m_safe[:, None])
            l_sum = l_sum * alpha + tl.sum(pr, 1)
            v = tl.load(vc_ptr + blk[:, None] * v_sb + off[:, None] * v_so + h * v_sh + offs_dv[None, :] * v_sd,
                        mask=ok[:, None] & (offs_dv[None, :] < dv), other=0.0)
            # compares on float32: the interpreter holds bfloat16 as raw bits, where NaN == NaN
            if KV_SCALE == PER_TOKEN:
                vs = tl.load(vs_ptr + blk * vs_sb + off * vs_so + h * vs_sh, mask=ok, other=0.0)
                vf = v_values(v, vs, KV_SCALE, MANT, BIAS, E5M2, SUB_UNIT)
            else:
                vf = v_values(v, v_mul, KV_SCALE, MANT, BIAS, E5M2, SUB_UNIT)
            bad = (vf != vf) | (tl.abs(vf) == float("inf"))
            acc = acc * alpha[:, None]
            n_bad = tl.max(tl.max(bad.to(tl.int32), 1), 0)
            if n_bad > 0:  # rare: NaN/inf that a row masking it would get as 0 * v in the dot
                if EXACT:
                    acc += _nonfinite_part(seen, pr, vf)
                vf = tl.where(bad, 0.0, vf)
                hidden += n_bad
            acc = tl.dot(pr, vf, acc, input_precision=PRECISION)
            m = m_new
        out = tl.where(l_sum[:, None] == 0.0, 0.0, acc / l_sum[:, None])
        if invalid:  # an invalid length, query count or block: the tile's rows are NaN
            out = tl.full((BLOCK_Q * BLOCK_G, BLOCK_DV), float("nan"), tl.float32)
        ptrs = out_ptr + t_row[:, None] * o_st + head[:, None] * o_sh + offs_dv[None, :] * o_sd
        tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < dv))
        if not EXACT:
            if hidden > 0:
                tl.store(flag, 1)


def _supports(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, softcap, sliding_window,
              k_scale=None, v_scale=None):
    if q.shape[-1] > MAX_HEAD_DIM or v_cache.shape[-1] > MAX_HEAD_DIM:
        return f"head dims D={q.shape[-1]}, Dv={v_cache.shape[-1]}: the Triton kernel takes D, Dv <= {MAX_HEAD_DIM}"
    if q.shape[1] // k_cache.shape[2] > MAX_GROUP:
        return f"{q.shape[1] // k_cache.shape[2]} query heads per KV head: the tile holds at most {MAX_GROUP}"
    return None


def _config(d: int, dv: int, group: int, dtype: torch.dtype) -> dict:
    """Tile shape: ROWS rows (the group padded to a power of two, times the tokens that fill the rest; a group
    above ROWS takes one token per tile), 64 positions per step (32 in float32, whose ieee dots run on the FMA units). Checked for
    sm_90 spills by `python tools/cuda_aot.py`; not yet timed on hardware."""
    fp32 = dtype == torch.float32 and not INTERPRET
    block_g = next_pow2(group)
    block_q = max(1, (ROWS // 2 if fp32 else ROWS) // block_g)  # float32's ieee dots: 64 rows spilled up to 1.8 KB
    block_d, block_dv = max(16, next_pow2(d)), max(16, next_pow2(dv))
    warps = 8 if max(block_d, block_dv) >= 128 else 4  # 64 rows x D 128 at 4 warps spilled (bf16, sm_90)
    return {"BLOCK_Q": block_q, "BLOCK_G": block_g, "BLOCK_N": 32 if fp32 else 64, "BLOCK_D": block_d,
            "BLOCK_DV": block_dv, "num_warps": warps, "num_stages": 2}


@impl(spec, "cuda", supports=_supports)
def paged_varlen_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, scale, softcap,
                           sliding_window, k_scale=None, v_scale=None) -> torch.Tensor:
    t, hq, d = q.shape
    bsz = block_tables.shape[0]
    hkv, dv = k_cache.shape[2], v_cache.shape[3]
    out = torch.full((t, hq, dv), float("nan"), dtype=q.dtype, device=q.device)  # rows bad cu_seqlens_q miss
    if out.numel() == 0:
        return out
    group = hq // hkv
    cfg = _config(d, dv, group, q.dtype)
    tiles = t // cfg["BLOCK_Q"] + bsz  # every sequence's tiles, numbered from shapes alone (see the module doc)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    flags = torch.zeros((tiles, hkv), dtype=torch.int32, device=q.device)
    (ks, vs, *scale_strides), fp8 = kv_scale_args(k_cache, k_scale, v_scale, q)
    kc, vc = cache_view(k_cache), cache_view(v_cache)
    for exact in (False, True):  # the exact launch's programs exit at once unless their tile was flagged
        _paged_varlen_kernel[(tiles, hkv)](
            q, kc, vc, block_tables, cu_seqlens_q, context_lens, out, flags, ks, vs,
            bsz, t, math.ceil(math.log2(bsz)) + 1, hkv, group, d, dv, k_cache.shape[1], k_cache.shape[0],
            block_tables.shape[1] * k_cache.shape[1], sliding_window or 0,
            cu_seqlens_q.stride(0), context_lens.stride(0), *q.stride(), *k_cache.stride(), *v_cache.stride(),
            *block_tables.stride(), *out.stride(), *scale_strides, scale, float(softcap or 1.0),
            SOFTCAP=softcap is not None, WINDOW=sliding_window is not None,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", EXACT=exact, **fp8, **cfg)
    return out
