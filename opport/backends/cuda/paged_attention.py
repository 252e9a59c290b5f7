"""paged_attention in Triton: flash-decoding over a paged KV cache (a partition pass and a reduce pass).

Program (sequence b, KV head h, partition p) holds the g = Hq / Hkv query heads of h as the rows of one
tile and walks positions [p * PART, (p + 1) * PART) of b's visible range, BLOCK_N tokens at a time, each
token's row gathered through the block table. Long contexts thus spread over cdiv(capacity, PART)
programs per (b, h), so a few long sequences still fill the GPU; a second launch merges the partitions.

fp8 caches (float8_e4m3fn / float8_e5m2 with float32 k_scale, v_scale per tensor [1] or per token and head
[num_blocks, block_size, Hkv]): the constexpr KV_SCALE picks none / per tensor / per token, so a cache in q's dtype
compiles exactly as before. K's codes go into the dot in q's dtype (every e4m3 and e5m2 value is exact in float16
and bfloat16) and k_scale multiplies the scores' columns; V's codes are widened to float32 and multiplied by
v_scale, then feed the float32 P @ V dot as a 16-bit V does. In the interpreter the codes are read through a uint8
view and decoded by bits (dequantize_fp8's `fp8_value`); compiled, by the hardware cvt.
"""

import math

import torch

from opport.backends.cuda._launch import INTERPRET, INTERPRETED, cdiv, dot_operand, f32, libdevice, narrow, next_pow2, tl, triton
from opport.backends.cuda.dequantize_fp8 import fp8_value
from opport.backends.cuda.quantize_fp8 import FORMAT
from opport.dispatch import impl
from opport.ops.paged_attention import paged_attention as spec

MAX_HEAD_DIM = 256  # q tile [BLOCK_G, D] and accumulator [BLOCK_G, Dv] live in registers
MAX_GROUP = 64  # query heads per KV head held as tile rows
PART = 512  # positions per partition program (vLLM's v2 kernel uses 512 too): 32 key tiles of 16
MAX_GRID_Y = 65535  # CUDA's limit on grid axis 1 (partitions)
# the kernels' KV_SCALE: a cache in q's dtype, an fp8 cache with one scale per tensor, or one per (slot, head)
NO_SCALE, PER_TENSOR, PER_TOKEN = (tl.constexpr(i) for i in range(3))


@triton.jit
def _tanh(x):
    """float32 tanh: libdevice on a GPU; the interpreter (no libdevice) through exp, 1 - 2 / (exp(2x) + 1),
    whose absolute error (~1e-7) stays far below a score's rounding once multiplied back by the cap."""
    if INTERPRETED:
        return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
    else:
        return libdevice.tanh(x)


@triton.jit
def k_operand(kt, q, KV_SCALE: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, E5M2: tl.constexpr,
              SUB_UNIT: tl.constexpr):
    """A K tile as the q k^T dot's operand: as dot_operand for a cache in q's dtype; an fp8 tile's codes in q's
    dot dtype (exact: e4m3 and e5m2 values are float16 and bfloat16 values), unscaled (k_scale goes on the scores)."""
    if KV_SCALE == NO_SCALE:
        return dot_operand(kt)
    elif INTERPRETED:
        return fp8_value(kt, MANT, BIAS, E5M2, SUB_UNIT).to(q.dtype)
    else:
        return kt.to(q.dtype)


@triton.jit
def v_values(v, vs, KV_SCALE: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, E5M2: tl.constexpr,
             SUB_UNIT: tl.constexpr):
    """A V tile [BLOCK_N, BLOCK_DV] as float32 values: f32(v) for a cache in q's dtype; an fp8 tile's codes, exactly,
    times `vs` (the per-tensor scalar, or the tile's per-token scales [BLOCK_N]) in float32."""
    if KV_SCALE == NO_SCALE:
        return f32(v)
    else:
        if INTERPRETED:
            vf = fp8_value(v, MANT, BIAS, E5M2, SUB_UNIT)
        else:
            vf = v.to(tl.float32)
        if KV_SCALE == PER_TOKEN:
            return vf * vs[:, None]
        else:
            return vf * vs


def kv_scale_args(k_cache, k_scale, v_scale, dummy) -> tuple:
    """(the caches' views for the kernel, scale pointers and strides, constexprs) for KV_SCALE.

    fp8 caches go to the interpreter as uint8 views (its fp8 casts are not exact, see quantize_fp8.py); a cache in
    q's dtype passes `dummy` for the scale pointers (never read)."""
    if k_scale is None:
        return (dummy, dummy, 0, 0, 0, 0, 0, 0), {"KV_SCALE": int(NO_SCALE), "MANT": 0, "BIAS": 0, "E5M2": False,
                                                   "SUB_UNIT": 1.0}
    mant, bias, _ = FORMAT[str(k_cache.dtype).removeprefix("torch.")]
    meta = {"KV_SCALE": int(PER_TENSOR if k_scale.numel() == 1 else PER_TOKEN), "MANT": mant, "BIAS": bias,
            "E5M2": mant == 2, "SUB_UNIT": 2.0 ** (1 - bias - mant)}
    ks = k_scale.stride() if k_scale.dim() == 3 else (0, 0, 0)
    vs = v_scale.stride() if v_scale.dim() == 3 else (0, 0, 0)
    return (k_scale, v_scale, *ks, *vs), meta


def cache_view(cache):
    """An fp8 cache as the kernel reads it: a uint8 view in the interpreter (decoded by bits), else itself."""
    if INTERPRET and cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return cache.view(torch.uint8)
    return cache


@triton.jit
def _paged_attention_kernel(
    # pointers
    q_ptr, kc_ptr, vc_ptr, bt_ptr, len_ptr, out_ptr, part_ptr, ml_ptr, ks_ptr, vs_ptr,
    # shapes, strides
    hkv, group, d, dv, block_size, num_blocks, capacity, window, n_parts,
    q_sb, q_sh, q_sd, len_s,
    k_sb, k_so, k_sh, k_sd,
    v_sb, v_so, v_sh, v_sd,
    bt_sb, bt_sm,
    o_sb, o_sh, o_sd,
    ks_sb, ks_so, ks_sh, vs_sb, vs_so, vs_sh,
    scale, softcap,
    # meta-parameters
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr, PART_LEN: tl.constexpr,
    KV_SCALE: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, E5M2: tl.constexpr, SUB_UNIT: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """One partition of one (sequence, KV head): online softmax over its visible positions.

    Dimensions: q [B, Hq, D], caches [num_blocks, block_size, Hkv, D/Dv], block_tables [B, max_blocks] int32,
    context_lens [B] int32, out [B, Hq, Dv]; all strided. With SPLIT, part [B * Hkv, n_parts, BLOCK_G, Dv] and
    ml [B * Hkv, n_parts, BLOCK_G, 2] float32. fp8 caches (KV_SCALE): k_scale, v_scale float32, [1] (PER_TENSOR) or
    [num_blocks, block_size, Hkv] (PER_TOKEN, strided like the caches' first three axes).
    Args: window: sliding window W (WINDOW) — positions >= len - W; softcap: c (SOFTCAP) — s = c tanh(s / c);
    KV_SCALE: NO_SCALE (caches in q's dtype; ks_ptr, vs_ptr unused), PER_TENSOR or PER_TOKEN; MANT, BIAS, E5M2,
    SUB_UNIT: the fp8 format (the interpreter's exact decoding).
    Returns: out (without SPLIT) or the partition's unnormalised accumulator, running max and sum (SPLIT).
    Notes: tables and lengths are checked on the host before the launch, except on device arrays without
    OPPORT_CHECK_VALUES=1 (a host read per call would break CUDA-graph capture): then a length outside
    [0, capacity] or a visited block outside [0, num_blocks) is never followed (clamped; block 0 read instead)
    and the sequence's rows come out NaN (a stray block's scores are NaN, an invalid length sets the denominator
    to NaN; the reduce carries it).
    Only positions in [max(lo, p * PART), min(len, (p + 1) * PART)) are loaded (masked loads read no
    memory): the tail of a sequence's last block, blocks outside its window and table entries past its last
    block are never touched, so NaN in unseen slots cannot reach the output. Scores are scaled (and
    softcapped) in float32, then taken to base 2 for exp2. A partition that sees nothing leaves m = -inf,
    l = 0, which adds exactly 0 in the reduce; a sequence of length 0 outputs 0. P stays float32 for the
    second dot (tf32 on 16-bit inputs): rounding it to bfloat16, as FlashAttention does, put the error 3x
    above a plain NumPy bfloat16 computation (the conformance noise floor) on short contexts; decode is
    memory-bound, so the wider dot costs no time. fp8: K's codes enter the dot in q's dtype (exact) and the scores
    are multiplied by k_scale (per tensor: folded into `scale`; per token: one factor per column), so the dot adds
    no rounding of code x scale; V's codes are widened exactly to float32 and multiplied by v_scale before the P @ V
    dot. Scales are loaded with the same masks as the codes (masked lanes 0): the NaN scales of slots no sequence
    sees are never read.
    Pseudocode: for each BLOCK_N positions: blk = table[pos // bs]; k, v = cache[blk, pos % bs, h];
                s = q k^T (x k_scale[blk, pos % bs, h]); v = v (x v_scale[...]);
                m' = max(m, rowmax s); p = exp2(s - m'); l = l exp2(m - m') + sum p; acc = acc exp2(m - m') + p v
    """
    bh = tl.program_id(0)
    p = tl.program_id(1)
    b = (bh // hkv).to(tl.int64)
    h = (bh % hkv).to(tl.int64)
    n = tl.load(len_ptr + b * len_s)
    invalid = (n < 0) | (n > capacity)  # checked on the host except for device arrays (see the notes)
    n = tl.minimum(tl.maximum(n, 0), capacity)
    lo = 0
    if WINDOW:
        lo = tl.maximum(n - window, 0)
    start = tl.maximum(lo, p * PART_LEN)
    end = tl.minimum(n, (p + 1) * PART_LEN)
    g = tl.arange(0, BLOCK_G)
    g_ok = g < group
    head = h * group + g
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + b * q_sb + head[:, None] * q_sh + offs_d[None, :] * q_sd,
                mask=g_ok[:, None] & (offs_d[None, :] < d), other=0.0)
    q = dot_operand(q)
    v_mul = 1.0  # per tensor: v_scale (k_scale joins `scale`)
    if KV_SCALE == PER_TENSOR:
        scale = scale * tl.load(ks_ptr)
        v_mul = tl.load(vs_ptr)
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_sum = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_DV), tl.float32)
    for s0 in range(start, end, BLOCK_N):
        pos = s0 + tl.arange(0, BLOCK_N)
        ok = pos < end
        blk = tl.load(bt_ptr + b * bt_sb + (pos // block_size) * bt_sm, mask=ok, other=0).to(tl.int64)
        stray = ok & ((blk < 0) | (blk >= num_blocks))  # read block 0 instead; its scores NaN (below)
        blk = tl.where(stray, 0, blk)
        off = (pos % block_size).to(tl.int64)
        k_rows = kc_ptr + blk * k_sb + off * k_so + h * k_sh
        kt = tl.load(k_rows[None, :] + offs_d[:, None] * k_sd, mask=ok[None, :] & (offs_d[:, None] < d), other=0.0)
        s = tl.dot(q, k_operand(kt, q, KV_SCALE, MANT, BIAS, E5M2, SUB_UNIT), input_precision=PRECISION) * scale
        if KV_SCALE == PER_TOKEN:
            ks = tl.load(ks_ptr + blk * ks_sb + off * ks_so + h * ks_sh, mask=ok, other=0.0)
            s = s * ks[None, :]
        if SOFTCAP:
            s = softcap * _tanh(s / softcap)
        s = tl.where(ok[None, :], s * 1.4426950408889634, float("-inf"))  # log2(e): exp2 from here on
        s = tl.where(stray[None, :], float("nan"), s)  # a stray block: p, l and acc turn NaN (no loop-carried flag)
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        pr = tl.exp2(s - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(pr, 1)
        v_rows = vc_ptr + blk * v_sb + off * v_so + h * v_sh
        v = tl.load(v_rows[:, None] + offs_dv[None, :] * v_sd, mask=ok[:, None] & (offs_dv[None, :] < dv), other=0.0)
        acc = acc * alpha[:, None]
        if KV_SCALE == PER_TOKEN:
            vs = tl.load(vs_ptr + blk * vs_sb + off * vs_so + h * vs_sh, mask=ok, other=0.0)
            vf = v_values(v, vs, KV_SCALE, MANT, BIAS, E5M2, SUB_UNIT)
        else:
            vf = v_values(v, v_mul, KV_SCALE, MANT, BIAS, E5M2, SUB_UNIT)
        acc = tl.dot(pr, vf, acc, input_precision=PRECISION)  # P kept in float32 (tf32 on 16-bit inputs)
        m = m_new
    if invalid:  # an invalid length: the sequence's rows are NaN (as cross_entropy's unchecked device targets)
        l_sum = tl.full((BLOCK_G,), float("nan"), tl.float32)
    if SPLIT:
        at = (bh.to(tl.int64) * n_parts + p) * BLOCK_G + g
        tl.store(ml_ptr + at * 2, m, mask=g_ok)
        tl.store(ml_ptr + at * 2 + 1, l_sum, mask=g_ok)
        tl.store(part_ptr + at[:, None] * dv + offs_dv[None, :], acc, mask=g_ok[:, None] & (offs_dv[None, :] < dv))
    else:
        _store_out(out_ptr, acc, l_sum, b, head, offs_dv, g_ok[:, None] & (offs_dv[None, :] < dv), o_sb, o_sh, o_sd)


@triton.jit
def _paged_reduce_kernel(
    # pointers
    part_ptr, ml_ptr, out_ptr,
    # shapes, strides
    hkv, group, dv, n_parts, o_sb, o_sh, o_sd,
    # meta-parameters
    BLOCK_G: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Merge the partitions of one (sequence, KV head): out = sum_p acc_p 2^(m_p - M) / sum_p l_p 2^(m_p - M).

    Dimensions: part [B * Hkv, n_parts, BLOCK_G, Dv], ml [B * Hkv, n_parts, BLOCK_G, 2] float32; out [B, Hq, Dv].
    Notes: a partition that saw nothing (m = -inf, l = 0) adds exactly 0; rows with a zero total output 0.
    Pseudocode: M = running max over partitions; l = sum l_p 2^(m_p - M); acc = sum acc_p 2^(m_p - M); out = acc / l
    """
    bh = tl.program_id(0)
    g = tl.arange(0, BLOCK_G)
    g_ok = g < group
    cols = tl.arange(0, BLOCK_DV)
    mask = g_ok[:, None] & (cols[None, :] < dv)
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_sum = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_DV), tl.float32)
    for p in range(0, n_parts):
        at = (bh.to(tl.int64) * n_parts + p) * BLOCK_G + g
        m_p = tl.load(ml_ptr + at * 2, mask=g_ok, other=float("-inf"))
        l_p = tl.load(ml_ptr + at * 2 + 1, mask=g_ok, other=0.0)
        a_p = tl.load(part_ptr + at[:, None] * dv + cols[None, :], mask=mask, other=0.0)
        m_new = tl.maximum(m, m_p)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        beta = tl.exp2(m_p - m_safe)
        l_sum = l_sum * alpha + l_p * beta
        acc = acc * alpha[:, None] + a_p * beta[:, None]
        m = m_new
    b = (bh // hkv).to(tl.int64)
    head = (bh % hkv).to(tl.int64) * group + g
    _store_out(out_ptr, acc, l_sum, b, head, cols, mask, o_sb, o_sh, o_sd)


@triton.jit
def _store_out(out_ptr, acc, l_sum, b, head, cols, mask, o_sb, o_sh, o_sd):
    """out[b, head, cols] = acc / l_sum in out's dtype; rows with l_sum == 0 (nothing visible) get 0."""
    out = tl.where(l_sum[:, None] == 0.0, 0.0, acc / l_sum[:, None])
    ptrs = out_ptr + b * o_sb + head[:, None].to(tl.int64) * o_sh + cols[None, :] * o_sd
    tl.store(ptrs, narrow(out, out_ptr.dtype.element_ty), mask=mask)


def _supports(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, sliding_window, k_scale=None,
              v_scale=None):
    if q.shape[-1] > MAX_HEAD_DIM or v_cache.shape[-1] > MAX_HEAD_DIM:
        return f"head dims D={q.shape[-1]}, Dv={v_cache.shape[-1]}: the Triton kernel takes D, Dv <= {MAX_HEAD_DIM}"
    if q.shape[1] // k_cache.shape[2] > MAX_GROUP:
        return f"{q.shape[1] // k_cache.shape[2]} query heads per KV head: the tile holds at most {MAX_GROUP}"
    if cdiv(block_tables.shape[1] * k_cache.shape[1], PART) > MAX_GRID_Y:
        return f"a table capacity of {block_tables.shape[1] * k_cache.shape[1]} positions exceeds the grid's partitions"
    return None


def _config(d: int, dv: int, group: int, dtype: torch.dtype, fp8: bool = False) -> dict:
    """Tile shape: the group padded to a tl.dot's 16 rows; 64 positions per step (32 in float32, whose ieee
    dots run on the FMA units). Checked for sm_90 spills by `python tools/cuda_aot.py`; not yet timed on hardware."""
    fp32 = dtype == torch.float32 and not INTERPRET
    block_d, block_dv = max(16, next_pow2(d)), max(16, next_pow2(dv))
    # float32 D = 128 spilled ~800 B at 4 warps (sm_90); an fp8 cache's bf16 D = 128 (the codes widened, the scales)
    # spilled 12 B at 4 warps
    warps = 8 if (fp32 or fp8) and max(block_d, block_dv) >= 128 else 4
    return {"BLOCK_G": max(16, next_pow2(group)), "BLOCK_N": 32 if fp32 else 64, "BLOCK_D": block_d,
            "BLOCK_DV": block_dv, "num_warps": warps, "num_stages": 2}


@impl(spec, "cuda", supports=_supports)
def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, scale, softcap, sliding_window, k_scale=None,
                    v_scale=None) -> torch.Tensor:
    bsz, hq, d = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[3]
    out = torch.empty((bsz, hq, dv), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    group = hq // hkv
    cfg = _config(d, dv, group, q.dtype, k_scale is not None)
    # partitions from the tables' capacity, not the longest context: no device-to-host read of context_lens;
    # programs past a sequence's end (or before its window) exit after one load
    n_parts = max(1, cdiv(block_tables.shape[1] * k_cache.shape[1], PART))
    split = n_parts > 1
    fp32 = dict(dtype=torch.float32, device=q.device)
    part, ml = ((torch.empty((bsz * hkv, n_parts, cfg["BLOCK_G"], dv), **fp32),
                 torch.empty((bsz * hkv, n_parts, cfg["BLOCK_G"], 2), **fp32)) if split else (out, out))
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    (ks, vs, *scale_strides), fp8 = kv_scale_args(k_cache, k_scale, v_scale, q)
    _paged_attention_kernel[(bsz * hkv, n_parts)](
        q, cache_view(k_cache), cache_view(v_cache), block_tables, context_lens, out, part, ml, ks, vs,
        hkv, group, d, dv, k_cache.shape[1], k_cache.shape[0], block_tables.shape[1] * k_cache.shape[1],
        sliding_window or 0, n_parts,
        *q.stride(), context_lens.stride(0), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        *scale_strides, scale, float(softcap or 1.0),
        SOFTCAP=softcap is not None, WINDOW=sliding_window is not None, SPLIT=split,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PART_LEN=PART, **fp8, **cfg)
    if split:
        _paged_reduce_kernel[(bsz * hkv,)](part, ml, out, hkv, group, dv, n_parts, *out.stride(),
                                           BLOCK_G=cfg["BLOCK_G"], BLOCK_DV=cfg["BLOCK_DV"], num_warps=4)
    return out
