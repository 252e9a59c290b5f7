"""The sampling filters in Triton, shared by sample and sampling_probs: one program per row, no sort.

Every filter keeps a prefix of the row's order (descending logit, ties to the lowest index), so each is one
threshold on an int64 order key: key = rank(x) * 2^20 + (2^20 - 1 - index), rank(x) the float32 bits made
monotone (distinct keys; larger = earlier). A threshold is found by a P-ary search (P = 31 pivots a pass over
the row, ~5 bits a pass): the largest key whose count (top-k) or kept mass (top-p) above it still reaches the
target, the FlashInfer sorting-free idea made exact by searching keys rather than probabilities.
"""

import torch

from opport.backends.cuda._launch import INTERPRET, exp_f32, f32, next_pow2, tl, triton, warps_for

IDX_BITS = 20
MAX_V = 1 << IDX_BITS  # the index's bits in the order key
IDX_SPAN = tl.constexpr(MAX_V)
KEY_LO = tl.constexpr(-(1 << 52))  # below every key (|rank| < 2^31, so |key| < 2^51)
KEY_HI = tl.constexpr(1 << 52)
# pivot slots per pass (P - 1 used: the pivots split the range in P): 32 on a GPU ([P, BLOCK] compare tiles in
# registers); 1024 in the interpreter, where a pass costs its number of ops, not its width (6 passes, not 11)
P = 1024 if INTERPRET else 32
KEY_ITERS = next(n for n in range(1, 64) if P ** n >= 1 << 53)  # passes that take the 2^53 key range to one key


@triton.jit
def _keys(x, i):
    """int64 order keys of float32 logits x at indices i: larger = earlier in the order (-0 ties +0)."""
    x = tl.where(x == 0.0, 0.0, x)
    b = x.to(tl.int32, bitcast=True)
    r = tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.int64)
    return r * IDX_SPAN + (IDX_SPAN - 1 - i.to(tl.int64))


@triton.jit
def _weights(x, m, t, PRECISE: tl.constexpr):
    """w = exp((x - m) / t) in float32 (-inf logits: 0)."""
    return exp_f32((x - m) / t, PRECISE)


@triton.jit
def _search(xr, s_v, V, lo, hi, target, m, t, kap_k, kap_p, min_p,
            MODE: tl.constexpr, ITERS: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr, PRECISE: tl.constexpr):
    """The largest c in [lo, hi] with f(c) >= target (MODE 0, 1) or f(c) <= target (MODE 2), f monotone:
    MODE 0: count(key >= c); MODE 1: sum of w over key >= c and key >= kap_k (what top-k kept);
    MODE 2: sum of the kept w (key >= kap_k, key >= kap_p, w >= min_p) over indices < c.
    Each pass evaluates f at P - 1 pivots splitting [lo, hi] evenly (one read of the row) and keeps the piece
    between the last pivot that satisfies and the next."""
    j = (tl.arange(0, P) + 1).to(tl.int64)
    for _ in range(ITERS):
        step = (hi - lo) // P + 1
        piv = lo + step * j
        valid = (piv <= hi) & (j < P)
        f = tl.zeros((P,), tl.float32)
        for off in range(0, V, BLOCK):
            i = off + tl.arange(0, BLOCK)
            msk = i < V
            x = f32(tl.load(xr + i.to(tl.int64) * s_v, mask=msk, other=0.0))
            key = _keys(x, i)
            if MODE == 0:
                on = key[None, :] >= piv[:, None]
                val = msk.to(tl.float32)
            elif MODE == 1:
                on = key[None, :] >= piv[:, None]
                val = tl.where(msk & (key >= kap_k), _weights(x, m, t, PRECISE), 0.0)
            else:
                on = i[None, :].to(tl.int64) < piv[:, None]
                w = _weights(x, m, t, PRECISE)
                val = tl.where(msk & (key >= kap_k) & (key >= kap_p) & (w >= min_p), w, 0.0)
            f += tl.sum(tl.where(on, val[None, :], 0.0), axis=1)
        if MODE == 2:
            ok = valid & (f <= target)
        else:
            ok = valid & (f >= target)
        best = tl.max(tl.where(ok, j, 0), axis=0)
        lo_new = lo + step * best
        hi = tl.minimum(hi, lo_new + step - 1)
        lo = lo_new
    return lo


@triton.jit
def _sampling_kernel(
    # pointers
    x_ptr, u_ptr, t_ptr, k_ptr, p_ptr, mp_ptr, out_ptr,
    # shapes, strides
    V, s_b, s_v, s_u, s_t, s_k, s_p, s_mp, o_b, o_v,
    # meta-parameters
    PROBS: tl.constexpr, IDX_ITERS: tl.constexpr, KEY_ITERS: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr,
    PRECISE: tl.constexpr,
):
    """One row's token (PROBS=False) or its filtered, renormalised probabilities (PROBS=True).

    Dimensions: logits [B, V] (V <= 2^20), per-row settings [B], tokens [B] int32 or probs [B, V] float32; strided.
    Args: IDX_ITERS: passes of the index search (inverse CDF); P: pivots per pass; PRECISE: libdevice's expf.
    Returns: nothing; the token or the row of probabilities is written.
    Notes: pass 1: max m, NaN/+inf count, lowest index of the max (greedy). Then w = exp((x - m) / T) and three
    thresholds, each a P-ary search over the row (see _search): kap_k (top-k: the k-th key), kap_p (top-p: the
    last key of the shortest prefix of what top-k kept whose mass reaches top_p times that mass), and for a token
    the inverse CDF over the kept weights in vocabulary order (the last index whose preceding kept mass is at
    most u * S). kept = key >= kap_k, key >= kap_p, w >= min_p. Invalid rows (NaN, +inf, all -inf): -1 or NaN;
    T == 0: the argmax, or one-hot. Sums are float32 (a boundary within their rounding may fall either way).
    Pseudocode: m, bad, g = pass1; kap_k = search(count >= k); S_k = mass(key >= kap_k);
        kap_p = search(mass >= top_p S_k); S = mass(kept); token = search(cum_before <= u S) | probs = w kept / S
    """
    row = tl.program_id(0).to(tl.int64)
    xr = x_ptr + row * s_b
    t = tl.load(t_ptr + row * s_t)
    k = tl.load(k_ptr + row * s_k)
    top_p = tl.load(p_ptr + row * s_p)
    min_p = tl.load(mp_ptr + row * s_mp)
    mv = tl.full((BLOCK,), float("-inf"), tl.float32)
    badv = tl.zeros((BLOCK,), tl.int32)
    for off in range(0, V, BLOCK):
        i = off + tl.arange(0, BLOCK)
        msk = i < V
        x = f32(tl.load(xr + i.to(tl.int64) * s_v, mask=msk, other=float("-inf")))
        badv += ((x != x) | (x == float("inf"))).to(tl.int32)
        mv = tl.maximum(mv, tl.where(x != x, float("-inf"), x))
    m = tl.max(mv, axis=0)
    invalid = (tl.sum(badv, axis=0) > 0) | (m == float("-inf"))
    gv = tl.full((BLOCK,), 2147483647, tl.int32)
    for off in range(0, V, BLOCK):
        i = off + tl.arange(0, BLOCK)
        msk = i < V
        x = f32(tl.load(xr + i.to(tl.int64) * s_v, mask=msk, other=float("-inf")))
        gv = tl.minimum(gv, tl.where(msk & (x == m), i, 2147483647))
    g = tl.min(gv, axis=0)
    live = (t > 0) & (invalid == 0)
    ts = tl.where(live, t, 1.0)
    ms = tl.where(live, m, 0.0)
    kap_k = KEY_LO + tl.zeros((), tl.int64)
    kap_p = KEY_LO + tl.zeros((), tl.int64)
    if live & (k > 0) & (k < V):
        kap_k = _search(xr, s_v, V, KEY_LO + tl.zeros((), tl.int64), KEY_HI + tl.zeros((), tl.int64),
                        k.to(tl.float32), ms, ts, kap_k, kap_p, min_p, 0, KEY_ITERS, P, BLOCK, PRECISE)
    sk = tl.zeros((BLOCK,), tl.float32)
    for off in range(0, V, BLOCK):
        i = off + tl.arange(0, BLOCK)
        msk = i < V
        x = f32(tl.load(xr + i.to(tl.int64) * s_v, mask=msk, other=0.0))
        sk += tl.where(msk & (_keys(x, i) >= kap_k), _weights(x, ms, ts, PRECISE), 0.0)
    s_top_k = tl.sum(sk, axis=0)
    if live & (top_p < 1.0):
        kap_p = _search(xr, s_v, V, KEY_LO + tl.zeros((), tl.int64), KEY_HI + tl.zeros((), tl.int64),
                        top_p * s_top_k, ms, ts, kap_k, kap_p, min_p, 1, KEY_ITERS, P, BLOCK, PRECISE)
    sv = tl.zeros((BLOCK,), tl.float32)
    lastv = tl.full((BLOCK,), -1, tl.int32)
    for off in range(0, V, BLOCK):
        i = off + tl.arange(0, BLOCK)
        msk = i < V
        x = f32(tl.load(xr + i.to(tl.int64) * s_v, mask=msk, other=0.0))
        key = _keys(x, i)
        w = _weights(x, ms, ts, PRECISE)
        kept = msk & (key >= kap_k) & (key >= kap_p) & (w >= min_p)
        sv += tl.where(kept, w, 0.0)
        lastv = tl.maximum(lastv, tl.where(kept & (w > 0), i, -1))
    s = tl.sum(sv, axis=0)
    if PROBS:
        for off in range(0, V, BLOCK):
            i = off + tl.arange(0, BLOCK)
            msk = i < V
            x = f32(tl.load(xr + i.to(tl.int64) * s_v, mask=msk, other=0.0))
            key = _keys(x, i)
            w = _weights(x, ms, ts, PRECISE)
            kept = (key >= kap_k) & (key >= kap_p) & (w >= min_p)
            pr = tl.where(kept, w / s, 0.0)
            pr = tl.where(live, pr, tl.where(i == g, 1.0, 0.0))
            pr = tl.where(invalid, float("nan"), pr)
            tl.store(out_ptr + row * o_b + i.to(tl.int64) * o_v, pr, mask=msk)
    else:
        tok = g.to(tl.int64)
        if live:
            u = tl.load(u_ptr + row * s_u)
            c = _search(xr, s_v, V, tl.zeros((), tl.int64), (V - 1) + tl.zeros((), tl.int64), u * s, ms, ts,
                        kap_k, kap_p, min_p, 2, IDX_ITERS, P, BLOCK, PRECISE)
            # c: the last index whose preceding kept mass is <= u S; its own weight takes the sum past u S unless
            # rounding left the total at or below u S (then the last kept token)
            tok = tl.minimum(c, tl.max(lastv, axis=0).to(tl.int64))
        tok = tl.where(invalid, -1, tok)
        tl.store(out_ptr + row * o_b, tok.to(tl.int32))


def config(v: int) -> dict:
    """BLOCK (columns a chunk) and passes of the index search: [P, BLOCK] compare tiles of 8K elements on a GPU
    (P = 32 pivots), up to 1M in the interpreter (P = 1024: fewer, larger NumPy ops)."""
    cap = 1024 if INTERPRET else 256
    block = min(next_pow2(v), cap)
    idx_iters = 1
    while P ** idx_iters < v:
        idx_iters += 1
    return {"BLOCK": max(block, 16), "IDX_ITERS": idx_iters + 1, "KEY_ITERS": KEY_ITERS, "P": P}


def supports(logits, *rest):
    if logits.shape[1] > MAX_V:
        return f"V = {logits.shape[1]}: the order key holds the index in {IDX_BITS} bits (at most {MAX_V})"
    return None


def launch(logits: torch.Tensor, uniforms, temperature, top_k, top_p, min_p, probs: bool) -> torch.Tensor:
    b, v = logits.shape
    if probs:
        out = torch.empty((b, v), dtype=torch.float32, device=logits.device)
    else:
        out = torch.empty((b,), dtype=torch.int32, device=logits.device)
    if b == 0:
        return out
    cfg = config(v)
    u = uniforms if uniforms is not None else temperature
    _sampling_kernel[(b,)](
        logits, u, temperature, top_k, top_p, min_p, out, v, *logits.stride(), u.stride(0), temperature.stride(0),
        top_k.stride(0), top_p.stride(0), min_p.stride(0), out.stride(0), out.stride(1) if probs else 0,
        PROBS=probs, PRECISE=logits.dtype == torch.float32, num_warps=warps_for(P * cfg["BLOCK"]), **cfg)
    return out

