"""attention in Triton: FlashAttention-2-style forward with an online softmax, GQA-packed query tiles.

Query rows of one KV head's whole group share a tile ((g, i) -> row g*Sq + i), so grouped-query and
decode calls (Sq = 1, Hq/Hkv query heads per KV head) read each K/V block once per group, not per head.
"""

import math

import torch

from opport.backends.cuda._launch import INTERPRET, cdiv, dot_operand, f32, narrow, next_pow2, sm_count, tl, triton
from opport.dispatch import impl
from opport.ops.attention import attention as spec

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256  # q tile [BLOCK_M, D] and accumulator [BLOCK_M, Dv] live in registers
MAX_GRID_Y = 65535  # CUDA's limit on grid axis 1, which holds B * Hkv
MIN_SPLIT_BLOCKS = 4  # key blocks per split-KV program at least: its partial write stays small against its reads


@triton.jit
def _attention_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, out_ptr, flag_ptr, part_ptr, ml_ptr, lse_ptr,
    # shapes, strides
    n_kv_heads, group, sq, sk, d, dv, split_len,
    q_sb, q_sh, q_ss, q_sd,
    k_sb, k_sh, k_ss, k_sd,
    v_sb, v_sh, v_ss, v_sd,
    o_sb, o_sh, o_ss, o_sd,
    qk_scale, flag_block, cap2, window,
    # meta-parameters
    CAUSAL: tl.constexpr, EXACT: tl.constexpr, SPLIT: tl.constexpr, STORE_LSE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    SOFTCAP: tl.constexpr = False, WINDOW: tl.constexpr = False,
):
    """out = softmax(q k^T * scale, masked) v for BLOCK_M query rows of one (batch, KV head).

    Dimensions: q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv], out [B, Hq, Sq, Dv]; all strided;
    flags [B * Hkv, cdiv(group * Sq, flag_block)] int32; with SPLIT, part [splits, B * Hkv, group * Sq, Dv]
    and ml [splits, B * Hkv, group * Sq, 2] float32; with STORE_LSE (the training forward), lse [B, Hq, Sq] float32.
    Notes: scores are scaled by scale*log2(e) and exponentiated with exp2. Keys are visited in two
    stages: blocks every row of the tile sees in full (no score masking), then the blocks that need
    the causal/tail mask (bottom-right: key j is visible to query i iff j <= i + Sk - Sq). A running max
    of -inf (nothing visible yet) is replaced by 0 inside exp2, so masked scores add exactly 0; rows
    that end with a zero denominator (see no key, or only -inf scores) output 0. P is rounded to v's
    dtype for the second dot on 16-bit inputs (as FlashAttention does).
    NaN/inf in v under the causal mask would turn 0 * v into NaN inside the dot. The fast launch
    (EXACT=False) zeroes such entries in its diagonal blocks and raises its tile's flag; a second
    launch (EXACT=True, small tiles) recomputes only flagged tiles, splitting each diagonal block into
    its finite part (through the dot) and its non-finite entries, which reach only the rows that see
    them. Keeping that path out of the fast kernel keeps its registers and shared memory in budget.
    SPLIT (flash-decoding, non-causal only): program (., ., s) covers keys [s * split_len, (s + 1) * split_len)
    and writes its unnormalised accumulator, running max and denominator; `_combine_kernel` merges the splits.
    STORE_LSE: each row's log-sum-exp from the running max and denominator (`_store_lse`), for the backward.
    SOFTCAP: scores s (log2-scaled) become cap2·tanh(s / cap2), cap2 = softcap·log2(e). WINDOW (causal only):
    key j is also hidden from query i when j <= i + Sk - Sq - window; key blocks before the tile's first row's
    window are skipped, blocks that some row's window starts inside are masked, the rest run as without it.
    Pseudocode: for each key block: s = q k^T; m' = max(m, rowmax s); p = exp2(s - m'); l = l*exp2(m - m') + sum p;
                acc = acc*exp2(m - m') + p v.  out = acc / l (0 where l == 0)
    """
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    r0 = pid_m * BLOCK_M
    flag = flag_ptr + bh.to(tl.int64) * tl.cdiv(group * sq, flag_block) + r0 // flag_block
    if EXACT:
        run = tl.load(flag) != 0
    else:
        run = True
    if run:
        b = (bh // n_kv_heads).to(tl.int64)
        hkv = (bh % n_kv_heads).to(tl.int64)
        r = r0 + tl.arange(0, BLOCK_M)
        row_ok = r < group * sq
        i = r % sq  # query position
        head = hkv * group + (r // sq)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        q_rows = q_ptr + b * q_sb + head.to(tl.int64) * q_sh + i.to(tl.int64) * q_ss
        q = tl.load(q_rows[:, None] + offs_d[None, :] * q_sd, mask=row_ok[:, None] & (offs_d[None, :] < d), other=0.0)
        q = dot_operand(q)
        k_base = k_ptr + b * k_sb + hkv * k_sh
        v_base = v_ptr + b * v_sb + hkv * v_sh
        off = sk - sq
        i_lo = tl.min(tl.where(row_ok, i, sq), 0)
        i_hi = tl.max(tl.where(row_ok, i, 0), 0)
        tl.static_assert(not (CAUSAL and SPLIT), "split-KV runs without a causal mask")
        kv_lo = tl.program_id(2) * split_len  # 0 without SPLIT (split_len = sk)
        kv_hi = tl.minimum(sk, kv_lo + split_len)
        if CAUSAL:
            full_end = tl.minimum(tl.maximum(i_lo + off + 1, 0), sk) // BLOCK_N * BLOCK_N
            end = tl.minimum(tl.maximum(i_hi + off + 1, 0), sk)
        else:
            full_end = kv_lo + (kv_hi - kv_lo) // BLOCK_N * BLOCK_N
            end = kv_hi
        start0 = kv_lo  # blocks [start0, mid) are masked by some row's window start (none without WINDOW)
        mid = kv_lo
        if WINDOW:
            start0 = tl.minimum(tl.maximum(i_lo + off + 1 - window, 0), sk) // BLOCK_N * BLOCK_N
            mid = tl.minimum(tl.cdiv(tl.minimum(tl.maximum(i_hi + off + 1 - window, 0), sk), BLOCK_N) * BLOCK_N, end)
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_sum = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
        hidden = 0  # diagonal blocks with non-finite v (fast launch only)
        for start in range(start0, mid, BLOCK_N):
            acc, m, l_sum, bad = _attn_block(acc, m, l_sum, q, k_base, v_base, start, i, off, kv_hi, d, dv, k_ss, k_sd,
                                             v_ss, v_sd, qk_scale, offs_d, offs_dv, True, CAUSAL, EXACT, PRECISION,
                                             BLOCK_N, cap2, window, SOFTCAP, WINDOW)
            hidden += bad
        for start in range(mid, full_end, BLOCK_N):
            acc, m, l_sum, _ = _attn_block(acc, m, l_sum, q, k_base, v_base, start, i, off, kv_hi, d, dv, k_ss, k_sd,
                                           v_ss, v_sd, qk_scale, offs_d, offs_dv, False, False, False, PRECISION, BLOCK_N,
                                           cap2, window, SOFTCAP, False)
        for start in range(tl.maximum(mid, full_end), end, BLOCK_N):
            acc, m, l_sum, bad = _attn_block(acc, m, l_sum, q, k_base, v_base, start, i, off, kv_hi, d, dv, k_ss, k_sd,
                                             v_ss, v_sd, qk_scale, offs_d, offs_dv, True, CAUSAL, EXACT, PRECISION,
                                             BLOCK_N, cap2, window, SOFTCAP, WINDOW)
            hidden += bad
        if SPLIT:
            at_row = (tl.program_id(2) * tl.num_programs(1) + bh).to(tl.int64) * (group * sq) + r
            tl.store(ml_ptr + at_row * 2, m, mask=row_ok)
            tl.store(ml_ptr + at_row * 2 + 1, l_sum, mask=row_ok)
            tl.store(part_ptr + at_row[:, None] * dv + offs_dv[None, :], acc, mask=row_ok[:, None] & (offs_dv[None, :] < dv))
        else:
            _store_out(out_ptr, acc, l_sum, b, head, i, offs_dv, row_ok[:, None] & (offs_dv[None, :] < dv),
                       o_sb, o_sh, o_ss, o_sd)
            if STORE_LSE:
                _store_lse(lse_ptr, m, l_sum, (b * n_kv_heads * group + head) * sq + i, row_ok)
        if not EXACT and CAUSAL:
            tl.store(flag, hidden)


@triton.jit
def _combine_kernel(
    part_ptr, ml_ptr, out_ptr, lse_ptr,
    n_kv_heads, group, sq, dv, n_splits,
    o_sb, o_sh, o_ss, o_sd,
    STORE_LSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Merge split-KV partials: out = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M), M the largest m_s.

    Dimensions: part [splits, B * Hkv, rows, Dv], ml [splits, B * Hkv, rows, 2] (rows = group * Sq), out strided.
    Notes: the same online rescaling as the main kernel, over splits instead of key blocks: a split that
    saw no key (m = -inf, l = 0) adds exactly 0; rows with a zero total output 0; NaN propagates.
    """
    bh = tl.program_id(1)
    rows = group * sq
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < rows
    cols = tl.arange(0, BLOCK_DV)
    mask = row_ok[:, None] & (cols[None, :] < dv)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    for s in range(0, n_splits):
        at_row = (s * tl.num_programs(1) + bh).to(tl.int64) * rows + r
        m_s = tl.load(ml_ptr + at_row * 2, mask=row_ok, other=float("-inf"))
        l_s = tl.load(ml_ptr + at_row * 2 + 1, mask=row_ok, other=0.0)
        a_s = tl.load(part_ptr + at_row[:, None] * dv + cols[None, :], mask=mask, other=0.0)
        m_new, m_safe, alpha = _running_max(m, m_s)
        beta = tl.exp2(m_s - m_safe)
        l_sum = l_sum * alpha + l_s * beta
        acc = acc * alpha[:, None] + a_s * beta[:, None]
        m = m_new
    head = (bh % n_kv_heads).to(tl.int64) * group + (r // sq)
    b = (bh // n_kv_heads).to(tl.int64)
    _store_out(out_ptr, acc, l_sum, b, head, r % sq, cols, mask, o_sb, o_sh, o_ss, o_sd)
    if STORE_LSE:
        _store_lse(lse_ptr, m, l_sum, (b * n_kv_heads * group + head) * sq + r % sq, row_ok)


@triton.jit
def _store_lse(lse_ptr, m, l_sum, at_row, mask):
    """lse = (m + log2(l)) ln 2 per row (m: the running max of the log2-scaled scores): the natural-log
    log-sum-exp of the scaled scores; -inf for a row that saw no key or only -inf scores (l = 0)."""
    lse = tl.where(l_sum == 0.0, float("-inf"), (m + tl.log2(l_sum)) * 0.6931471805599453)
    tl.store(lse_ptr + at_row, lse, mask=mask)


@triton.jit
def _store_out(out_ptr, acc, l_sum, b, head, i, cols, mask, o_sb, o_sh, o_ss, o_sd):
    """out[b, head, i, cols] = acc / l_sum in out's dtype; rows with l_sum == 0 (no visible key) get 0."""
    out = tl.where(l_sum[:, None] == 0.0, 0.0, acc / l_sum[:, None])
    o_rows = out_ptr + b * o_sb + head.to(tl.int64) * o_sh + i.to(tl.int64) * o_ss
    tl.store(o_rows[:, None] + cols[None, :] * o_sd, narrow(out, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _running_max(m, m_block):
    """(new running max, the max exp2 subtracts (0 while it is -inf: nothing seen yet), old-to-new scale)."""
    m_new = tl.maximum(m, m_block)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, m_safe, tl.exp2(m - m_safe)


@triton.jit
def _softcap(s, cap):
    """cap·tanh(s / cap) from one exp2 of -2|s / cap|: ±cap for ±inf, NaN stays NaN."""
    x = s / cap
    e = tl.exp2(tl.abs(x) * (-2.0 * 1.4426950408889634))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0, -t, t)


@triton.jit
def _attn_block(acc, m, l_sum, q, k_base, v_base, start, i, off, sk, d, dv, k_ss, k_sd, v_ss, v_sd, qk_scale,
                offs_d, offs_dv, MASKED: tl.constexpr, CAUSAL: tl.constexpr, EXACT: tl.constexpr,
                PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, cap2=1.0, window=0, SOFTCAP: tl.constexpr = False,
                WINDOW: tl.constexpr = False):
    """One key block of the online softmax; returns the updated (acc, m, l_sum) and whether v held
    non-finite entries under the causal mask (which the fast launch zeroed; see the kernel's notes)."""
    keys = start + tl.arange(0, BLOCK_N)
    kmask = (keys[None, :] < sk) & (offs_d[:, None] < d)
    kt = tl.load(k_base + keys.to(tl.int64)[None, :] * k_ss + offs_d[:, None] * k_sd, mask=kmask, other=0.0)
    s = tl.dot(q, dot_operand(kt), input_precision=PRECISION) * qk_scale
    if SOFTCAP:
        s = _softcap(s, cap2)
    if MASKED:
        vis = keys[None, :] < sk
        if CAUSAL:
            vis = vis & (keys[None, :] <= i[:, None] + off)
        if WINDOW:
            vis = vis & (keys[None, :] > i[:, None] + off - window)
        s = tl.where(vis, s, float("-inf"))
    m_new, m_safe, alpha = _running_max(m, tl.max(s, 1))
    p = tl.exp2(s - m_safe[:, None])
    l_sum = l_sum * alpha + tl.sum(p, 1)
    vmask = (keys[:, None] < sk) & (offs_dv[None, :] < dv)
    v = tl.load(v_base + keys.to(tl.int64)[:, None] * v_ss + offs_dv[None, :] * v_sd, mask=vmask, other=0.0)
    acc = acc * alpha[:, None]
    hidden = 0
    if MASKED and CAUSAL:  # beyond-the-tail keys load as 0: only the causal mask can hide NaN/inf
        vf = f32(v)  # compares on float32: the interpreter holds bfloat16 as raw bits, where NaN == NaN
        bad = (vf != vf) | (tl.abs(vf) == float("inf"))
        hidden = tl.max(tl.max(bad.to(tl.int32), 1), 0)
        if hidden > 0:  # rare
            if EXACT:
                acc += _nonfinite_part(vis, p, v)
            v = tl.where(bad, tl.zeros_like(v), v)
    acc = tl.dot(dot_operand(narrow(p, v.dtype)), dot_operand(v), acc, input_precision=PRECISION)
    return acc, m_new, l_sum, hidden


@triton.jit
def _nonfinite_part(vis, p, v):
    """The contribution of v's NaN/inf entries to p @ v, counting only (row, key) pairs that are visible.

    0/1 matrices through tl.dot count, per output element, the visible NaNs, the visible infs of each
    sign with weight > 0, and the visible infs whose weight underflowed to 0 (0 * inf = NaN, as the
    reference computes it). Counts are small integers, exact in any dot precision.
    """
    vf = f32(v)
    seen = vis.to(tl.float32)
    pos_w = (vis & (p > 0)).to(tl.float32)
    zero_w = (vis & (p == 0)).to(tl.float32)
    is_pinf = (vf == float("inf")).to(tl.float32)
    is_ninf = (vf == float("-inf")).to(tl.float32)
    n_nan = tl.dot(seen, (vf != vf).to(tl.float32), input_precision="ieee")
    n_pinf = tl.dot(pos_w, is_pinf, input_precision="ieee")
    n_ninf = tl.dot(pos_w, is_ninf, input_precision="ieee")
    n_zinf = tl.dot(zero_w, is_pinf + is_ninf, input_precision="ieee")
    nan = (n_nan > 0) | (n_zinf > 0) | ((n_pinf > 0) & (n_ninf > 0))
    return tl.where(nan, float("nan"), tl.where(n_pinf > 0, float("inf"), tl.where(n_ninf > 0, float("-inf"), 0.0)))


def _supports(q, k, v, causal, scale, softcap=None, sliding_window=None):
    if q.shape[-1] > MAX_HEAD_DIM or v.shape[-1] > MAX_HEAD_DIM:
        return f"head dims D={q.shape[-1]}, Dv={v.shape[-1]}: the Triton kernel takes D, Dv <= {MAX_HEAD_DIM}"
    if q.shape[0] * k.shape[1] > MAX_GRID_Y:
        return f"B * Hkv = {q.shape[0] * k.shape[1]} exceeds the grid's {MAX_GRID_Y} (axis 1)"
    return None


def _config(rows: int, sk: int, d: int, dv: int, dtype: torch.dtype, causal: bool) -> dict:
    """Tile shape per problem: the largest tiles that compile for sm_90 without register spills and
    within shared memory (checked by `python tools/cuda_aot.py`); not yet timed on hardware."""
    block_d, block_dv = max(16, next_pow2(d)), max(16, next_pow2(dv))
    fit = lambda n, cap: max(16, min(cap, next_pow2(n)))  # noqa: E731 (tl.dot needs every dim >= 16)
    if INTERPRET:  # few, large programs: each tl.dot is one NumPy matmul
        return {"BLOCK_M": fit(rows, 128), "BLOCK_N": fit(sk, 128), "BLOCK_D": block_d, "BLOCK_DV": block_dv,
                "num_warps": 4, "num_stages": 1}
    wide = max(block_d, block_dv)
    dims = {"BLOCK_D": block_d, "BLOCK_DV": block_dv}
    if dtype == torch.float32:  # ieee float32 dots run on the FMA units: small tiles keep them in registers
        return {"BLOCK_M": 16, "BLOCK_N": 64 if wide <= 128 else 16, **dims, "num_warps": 8, "num_stages": 2}
    if rows <= 64:  # decode: the packed GQA group is the whole M tile
        m = fit(rows, 64)
        n = (128 if wide <= 128 else 64) if m == 16 else (64 if wide <= 128 else 32)
        return {"BLOCK_M": m, "BLOCK_N": n, **dims, "num_warps": 8 if n == 128 and causal else 4, "num_stages": 3}
    # FA2 on Hopper: 128 query rows per program; the key block shrinks as the head dim grows
    if wide <= 128:
        return {"BLOCK_M": 128, "BLOCK_N": 128 if wide <= 64 else 64, **dims, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 32, **dims, "num_warps": 8, "num_stages": 2}


def _exact_config(cfg: dict) -> dict:
    """Tiles of the launch that recomputes flagged tiles: small, so its four extra 0/1 dots fit an SM.

    Its BLOCK_M divides the fast launch's, so each of its tiles lies inside one flagged tile.
    """
    if INTERPRET:
        return cfg
    return {**cfg, "BLOCK_M": min(cfg["BLOCK_M"], 32), "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}


def _kv_splits(programs: int, sk: int, block_n: int, device) -> int:
    """Key splits for flash-decoding: a grid of fewer programs than the GPU has SMs (decode with few KV
    heads and a long cache) splits each program's keys so that about two programs run per SM, each
    split keeping at least MIN_SPLIT_BLOCKS key blocks (one in the interpreter, so that CI runs the path)."""
    sms = sm_count(device)
    if programs >= sms:
        return 1
    min_keys = block_n * (1 if INTERPRET else MIN_SPLIT_BLOCKS)
    return max(1, min(cdiv(2 * sms, programs), sk // min_keys))


@impl(spec, "cuda", supports=_supports)
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale, softcap=None,
              sliding_window=None) -> torch.Tensor:
    return _forward(q, k, v, causal, scale, None, softcap, sliding_window)


@impl(spec.train_forward, "cuda", supports=_supports)
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale, softcap=None,
                      sliding_window=None):
    """The forward plus each row's log-sum-exp [B, Hq, Sq] (float32) from the same launch's running max and sum."""
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    return _forward(q, k, v, causal, scale, lse, softcap, sliding_window), lse


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale, lse, softcap=None,
             window=None) -> torch.Tensor:
    bsz, hq, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    out = torch.empty((bsz, hq, sq, dv), dtype=q.dtype, device=q.device)
    if bsz * hq * sq == 0 or (out.numel() == 0 and lse is None):
        return out
    if sk == 0:
        if lse is not None:
            lse.fill_(float("-inf"))
        return out.zero_()
    causal = causal and (sq > 1 or window is not None)  # bottom-right alignment: one query row sees every key
    group = hq // hkv
    rows = group * sq
    cfg = _config(rows, sk, d, dv, q.dtype, causal)
    tiles = cdiv(rows, cfg["BLOCK_M"])
    splits = 1 if causal else _kv_splits(tiles * bsz * hkv, sk, cfg["BLOCK_N"], q.device)
    split_len = cdiv(cdiv(sk, splits), cfg["BLOCK_N"]) * cfg["BLOCK_N"] if splits > 1 else sk
    splits = cdiv(sk, split_len)
    fp32 = dict(dtype=torch.float32, device=q.device)
    part, ml = ((torch.empty((splits, bsz * hkv, rows, dv), **fp32), torch.empty((splits, bsz * hkv, rows, 2), **fp32))
                if splits > 1 else (out, out))
    flags = torch.empty((bsz * hkv, tiles), dtype=torch.int32, device=q.device) if causal else out
    qk_scale = _softmax_scale(scale, d) * LOG2E
    store_lse = lse is not None
    args = (q, k, v, out, flags, part, ml, lse if store_lse else out, hkv, group, sq, sk, d, dv, split_len,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), qk_scale, cfg["BLOCK_M"],
            1.0 if softcap is None else float(softcap) * LOG2E, 0 if window is None else min(int(window), sk + sq))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    cfg = {**cfg, "SOFTCAP": softcap is not None, "WINDOW": window is not None}
    _attention_kernel[(tiles, bsz * hkv, splits)](*args, CAUSAL=causal, EXACT=False, SPLIT=splits > 1,
                                                  STORE_LSE=store_lse and splits == 1, PRECISION=precision, **cfg)
    if splits > 1:
        bm = min(64, next_pow2(rows))
        _combine_kernel[(cdiv(rows, bm), bsz * hkv)](part, ml, out, lse if store_lse else out, hkv, group, sq, dv,
                                                     splits, *out.stride(), STORE_LSE=store_lse, BLOCK_M=bm,
                                                     BLOCK_DV=cfg["BLOCK_DV"], num_warps=4)
    if causal:  # recompute the tiles whose diagonal blocks hid NaN/inf in v (programs of unflagged tiles exit at once)
        fix = _exact_config(cfg)
        _attention_kernel[(cdiv(rows, fix["BLOCK_M"]), bsz * hkv, 1)](*args, CAUSAL=True, EXACT=True, SPLIT=False,
                                                                      STORE_LSE=store_lse, PRECISION=precision, **fix)
    return out


def _softmax_scale(scale, d: int) -> float:
    return 1.0 / math.sqrt(d) if scale is None else float(scale)
