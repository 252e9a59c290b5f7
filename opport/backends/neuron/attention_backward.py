"""attention's backward on NKI: FlashAttention-2 from the saved output and log-sum-exp, a dk/dv pass over key
blocks and a dq pass over query tiles (the forward, and the window geometry both share, are in attention.py)."""

from __future__ import annotations

import math

import numpy as np

from opport.backends.neuron import _host
from opport.backends.neuron._tiles import cdiv, spans
from opport.backends.neuron.attention import KP, Q_ROWS, cap_window, declines, window_edge, window_start
from opport.backends.neuron.nki_compat import nisa, nki, nl
from opport.dispatch import impl
from opport.dtypes import np_dtype
from opport.ops.attention import attention as spec

KB = 128  # keys per backward block: dS^T is one TensorE transpose, dK/dV one [128 keys, D] PSUM accumulator
BWD_KEYS_RESIDENT = 48 * 1024  # bytes per partition for one KV head's key tiles, kept across both passes
BWD_ROWS_RESIDENT = 64 * 1024  # bytes per partition for one KV head group's query-side tiles, kept likewise


@nki.jit
def _attention_backward_kernel(do_hbm, q_hbm, k_hbm, v_hbm, o_hbm, lse_hbm, causal, scale, q_rows, dead, softcap=0.0,
                                window=0):
    """dq, dk, dv of attention from the saved output and log-sum-exp: FlashAttention-2's backward.

    Dimensions:
        B: batch; Hq / Hkv: query / KV heads (group = Hq / Hkv query heads per KV head); Sq: queries (tiles of
        q_rows on the partitions); Sk: keys (blocks of KB = 128); D <= 128: head dim; Dv <= 512: value dim.

    Args:
        do_hbm, o_hbm: [B, Hq, Sq, Dv] upstream gradient and saved output; q_hbm: [B, Hq, Sq, D];
            k_hbm: [B, Hkv, Sk, D]; v_hbm: [B, Hkv, Sk, Dv]; all float32/float16/bfloat16.
        lse_hbm: [B, Hq, Sq] float32, the training forward's log-sum-exp (-inf: a row with output 0).
        causal, scale: compile-time, as in the forward (bottom-right mask: query i sees key j <= i + Sk - Sq).
        q_rows: compile-time queries per tile: 128, or 1 to cut every row's keys exactly at its last visible
            key (the host's choice when q, k or dO holds inf/NaN under the causal mask: TensorE computes
            0 * NaN = NaN, so a masked pair must never meet in a contraction).
        dead: compile-time bool: some row has lse = -inf; its q and dO are zeroed (they must reach no dK or
            dV), its P and dS too, and its dq is written 0.
        softcap, window: compile-time, as in the forward (0.0 / 0: none). With a soft cap, P = exp(c t - lse)
            with t = tanh(scale S / c), and dS is multiplied by the cap's slope 1 - t^2. With a window, blocks
            wholly before a query tile's first row's window are skipped, the window's start is masked, and D
            is formed before the passes (key block 0 may be outside a tile's window).

    Returns:
        (dq_hbm, dk_hbm, dv_hbm) in q's dtype, shaped like q, k, v.

    Notes:
        Per (batch, KV head) the key tiles (k, k^T, v^T) and the query-side tiles of the group's query
        heads (q, q^T, dO, dO^T, -lse, delta) are loaded once and kept in SBUF while they fit
        BWD_KEYS_RESIDENT / BWD_ROWS_RESIDENT bytes per partition (else re-read where used), so every input
        is read once and every output written once. Each block recomputes S = q k^T on TensorE and
        P = exp(scale S - lse) on ScalarE (masked to 0 by GpSimd affine_select where the diagonal crosses;
        blocks no row sees are skipped), dP = dO v^T on TensorE and dS = P (dP - D) in one VectorE
        instruction. The dk/dv pass runs over key blocks outside and the group's query tiles inside, so
        dV += P^T dO and dK += dS^T q accumulate over every query head of the group (the GQA sum) in two
        PSUM banks; the dq pass runs over query tiles outside, dQ += dS K in one PSUM bank (dS transposed
        on TensorE). P and dS are rounded to q's dtype for the matmuls, as the forward rounds P.
        D = rowsum(dO * O) is formed as dP[:, key 0] + rowsum(dO * (O - v_0)): equal in exact arithmetic,
        but dP - D then cancels exactly where a row sees key 0 only (one key, or the first causal row:
        O = v_0, dq = dk = 0), where two float32 dot products of |dO| |v| would leave eps |dO| |v| of noise.
        Key 0 is visible to every row that sees any key (the visible keys are a prefix) unless a window
        hides it; then the diagonal key plays its part (see _diag_dhat).

    Pseudocode:
        for b, KV head g:
            keys = k, k^T, v^T per 128-key block; rows = q, q^T, dO, dO^T, -lse, delta per query tile
            for key block j: dK = dV = 0
                for query head h of g, query tile i that sees block j:
                    P = exp(scale q_i k_j^T - lse_i); dP = dO_i v_j^T; D_i = dP[:, 0] + delta_i (j = 0)
                    dS = P (dP - D_i); dV += P^T dO_i; dK += dS^T q_i
                dk[j] = scale dK; dv[j] = dV
            for query head h, query tile i: dQ = sum over visible key blocks j of dS_ij k_j; dq[i] = scale dQ
    """
    B, Hq, Sq, D = q_hbm.shape
    Hkv, Sk, Dv = k_hbm.shape[1], k_hbm.shape[2], v_hbm.shape[3]
    dq_hbm = nl.ndarray((B, Hq, Sq, D), dtype=q_hbm.dtype, buffer=nl.shared_hbm)
    dk_hbm = nl.ndarray((B, Hkv, Sk, D), dtype=k_hbm.dtype, buffer=nl.shared_hbm)
    dv_hbm = nl.ndarray((B, Hkv, Sk, Dv), dtype=v_hbm.dtype, buffer=nl.shared_hbm)
    group = Hq // Hkv
    item = 4 if q_hbm.dtype == nl.float32 else 2
    n_dvc = cdiv(Dv, KP)
    n_kb = cdiv(Sk, KB)
    keys_resident = n_kb * (D + Dv + KB * (1 + n_dvc)) * item <= BWD_KEYS_RESIDENT
    descs = []  # (query head in group, first row, rows) of every query tile of a group
    for hh in range(group):
        for q0, p in spans(Sq, q_rows):
            descs.append((hh, q0, p))
    rows_resident = len(descs) * ((D + Dv + q_rows * (1 + n_dvc)) * item + 16) <= BWD_ROWS_RESIDENT
    ins = (do_hbm, q_hbm, k_hbm, v_hbm, o_hbm, lse_hbm)
    outs = (dq_hbm, dk_hbm, dv_hbm)
    meta = (causal, float(scale), dead, softcap, window, q_rows == 1)
    for b in range(B):
        for g in range(Hkv):
            keys = []
            v0_sb = None  # key 0's values: D's reference row without a window (with one, each row's diagonal key)
            if keys_resident:
                for k0, kp in spans(Sk, KB):  # blocks before every row's window: never loaded
                    seen = k0 >= _visible_start(window, 0, Sq, Sk)
                    keys.append(_key_tile(k_hbm, v_hbm, b, g, k0, kp) if seen else None)
                if window == 0:
                    v0_sb = _v0_rows(keys[0][3][0:1, 0:Dv], min(q_rows, Sq))
            elif window == 0:
                v_row_sb = nl.ndarray((1, Dv), dtype=v_hbm.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=v_row_sb, src=v_hbm[b, g, 0:1, 0:Dv])
                v0_sb = _v0_rows(v_row_sb, min(q_rows, Sq))
            rows = []
            if rows_resident:
                for hh, q0, p in descs:
                    rows.append(_row_tile(ins, v0_sb, b, g * group + hh, q0, p, dead, window))
            _dkdv_pass(ins, outs, meta, keys, rows, descs, v0_sb, b, g)
            _dq_pass(ins, outs, meta, keys, rows, descs, v0_sb, b, g)
    return dq_hbm, dk_hbm, dv_hbm


def _visible_end(causal, q0, p, Sq, Sk):
    """Keys [0, end) hold every key some row of the tile q0:q0+p sees (the last row sees the most)."""
    return min(Sk, max(0, q0 + p + Sk - Sq)) if causal else Sk


def _visible_start(window, q0, Sq, Sk):
    """The first key of the block grid (KB-aligned) that some row of the tile from q0 sees under a window."""
    return window_start(window, q0, Sk - Sq, Sk) // KB * KB


def _diagonal(causal, q0, p, k0, kc, Sq, Sk):
    """affine_select's offset where the causal diagonal crosses the block (some row misses some key), else None."""
    off = Sk - Sq
    return q0 + off - k0 if causal and k0 + kc - 1 > q0 + off else None


def _dkdv_pass(ins, outs, meta, keys, rows, descs, v0_sb, b, g):
    """dk, dv of KV head g: per key block, dV and dK accumulate in PSUM over every query tile of the group."""
    q_hbm, k_hbm, v_hbm = ins[1], ins[2], ins[3]
    dk_hbm, dv_hbm = outs[1], outs[2]
    causal, scale, dead, softcap, window, exact = meta
    Sq, D, Sk, Dv = q_hbm.shape[2], q_hbm.shape[3], k_hbm.shape[2], v_hbm.shape[3]
    group = q_hbm.shape[1] // k_hbm.shape[1]
    dhat_tiles = []  # D of each query tile, set by its first block (key block 0, always visible without a window)
    for idx in range(len(descs)):
        hh, q0, p = descs[idx]
        dhat_tiles.append(nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf))
        if window > 0:
            rt = rows[idx] if len(rows) else _row_tile(ins, v0_sb, b, g * group + hh, q0, p, dead, window)
            _diag_dhat(rt, _key_block(k_hbm, v_hbm, keys, b, g), q0, p, _visible_end(causal, q0, p, Sq, Sk), Sq, Sk,
                       dhat_tiles[idx])
    for j, (k0, kp) in enumerate(spans(Sk, KB)):
        kt = None  # loaded when a query tile sees the block
        if k0 >= _visible_start(window, 0, Sq, Sk):
            kt = keys[j] if len(keys) else _key_tile(k_hbm, v_hbm, b, g, k0, kp)
        dk_psum = nl.ndarray((kp, D), dtype=nl.float32, buffer=nl.psum)
        dv_psum = nl.ndarray((kp, Dv), dtype=nl.float32, buffer=nl.psum)
        seen = False  # some query tile's matmul wrote the PSUM accumulators (a window can leave blocks unseen)
        fix = None  # exact rows crossing the window's start: their dK, dV terms, keys before the window zeroed
        for idx in range(len(descs)):
            hh, q0, p = descs[idx]
            end = _visible_end(causal, q0, p, Sq, Sk)
            if end <= k0 or _visible_start(window, q0, Sq, Sk) > k0:
                continue
            rt = rows[idx] if len(rows) else _row_tile(ins, v0_sb, b, g * group + hh, q0, p, dead, window)
            kc = min(kp, end - k0)
            masks = (_diagonal(causal, q0, p, k0, kc, Sq, Sk), window_edge(window, q0, p, k0, Sk - Sq))
            p_parts, ds_parts = _block(rt, kt, dhat_tiles[idx], j == 0 and window == 0, kc, masks, scale, softcap, True)
            if exact and window > 0:  # all through SBUF: a NaN q or dO row times P = dS = 0 is NaN in PSUM
                fix = _edge_terms(fix, p_parts, ds_parts, rt, kp, kc, k0 - (q0 + Sk - Sq + 1 - window))
                continue
            seen = True
            for part_sb in p_parts:
                nisa.nc_matmul(dst=dv_psum[0:kc, 0:Dv], stationary=part_sb, moving=rt[2])
            for part_sb in ds_parts:
                nisa.nc_matmul(dst=dk_psum[0:kc, 0:D], stationary=part_sb, moving=rt[0])
        dv_sb = nl.ndarray((kp, Dv), dtype=dv_hbm.dtype, buffer=nl.sbuf)
        dk_sb = nl.ndarray((kp, D), dtype=dk_hbm.dtype, buffer=nl.sbuf)
        if seen and fix != None:  # noqa: E711
            nisa.tensor_tensor(dst=fix[0], data1=fix[0], data2=dv_psum, op=nl.add)
            nisa.tensor_tensor(dst=fix[1], data1=fix[1], data2=dk_psum, op=nl.add)
        if fix != None:  # noqa: E711
            nisa.tensor_copy(dst=dv_sb, src=fix[0])
            nisa.activation(dst=dk_sb, op=nl.copy, data=fix[1], scale=scale)
        elif seen:
            nisa.tensor_copy(dst=dv_sb, src=dv_psum)
            nisa.activation(dst=dk_sb, op=nl.copy, data=dk_psum, scale=scale)
        else:
            nisa.memset(dst=dv_sb, value=0.0)
            nisa.memset(dst=dk_sb, value=0.0)
        nisa.dma_copy(dst=dv_hbm[b, g, k0:k0 + kp, 0:Dv], src=dv_sb)
        nisa.dma_copy(dst=dk_hbm[b, g, k0:k0 + kp, 0:D], src=dk_sb)


def _edge_terms(fix, p_parts, ds_parts, rt, kp, kc, first):
    """An exact (one-row) tile's dV = P^T dO and dK = dS^T q terms on a block under a window, in their own PSUM
    tiles, with the keys before the window (block rows < -first) set to 0 by affine_select (selected:
    0 * a non-finite q or dO is NaN), added to the block's float32 SBUF sums fix = (dV, dK), made if None."""
    D, Dv = rt[0].shape[1], rt[2].shape[1]
    if fix == None:  # noqa: E711
        fix = (nl.ndarray((kp, Dv), dtype=nl.float32, buffer=nl.sbuf), nl.ndarray((kp, D), dtype=nl.float32, buffer=nl.sbuf))
        nisa.memset(dst=fix[0], value=0.0)
        nisa.memset(dst=fix[1], value=0.0)
    for parts, moving, acc_sb in ((p_parts, rt[2], fix[0]), (ds_parts, rt[0], fix[1])):
        n = moving.shape[1]
        t_psum = nl.ndarray((kc, n), dtype=nl.float32, buffer=nl.psum)
        for part_sb in parts:
            nisa.nc_matmul(dst=t_psum, stationary=part_sb, moving=moving)
        t_sb = nl.ndarray((kc, n), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=t_sb, src=t_psum)
        nisa.affine_select(dst=t_sb, pattern=[[0, n]], channel_multiplier=1, on_true_tile=t_sb, on_false_value=0.0,
                           cmp_op=nl.greater_equal, offset=first)
        nisa.tensor_tensor(dst=acc_sb[0:kc, 0:n], data1=acc_sb[0:kc, 0:n], data2=t_sb, op=nl.add)
    return fix


def _masked_keys(k_sb, kc, first):
    """k_sb[0:kc] with the keys before an exact row's window (rows < -first) set to 0: dS = 0 there, but
    0 * a non-finite k is NaN in dQ = dS K."""
    D = k_sb.shape[1]
    km_sb = nl.ndarray((kc, D), dtype=k_sb.dtype, buffer=nl.sbuf)
    nisa.affine_select(dst=km_sb, pattern=[[0, D]], channel_multiplier=1, on_true_tile=k_sb[0:kc, 0:D],
                       on_false_value=0.0, cmp_op=nl.greater_equal, offset=first)
    return km_sb


def _dq_pass(ins, outs, meta, keys, rows, descs, v0_sb, b, g):
    """dq of the group's query heads: per query tile, dQ accumulates dS K in PSUM over the key blocks it sees."""
    q_hbm, k_hbm, v_hbm = ins[1], ins[2], ins[3]
    dq_hbm = outs[0]
    causal, scale, dead, softcap, window, exact = meta
    Sq, D, Sk = q_hbm.shape[2], q_hbm.shape[3], k_hbm.shape[2]
    group = q_hbm.shape[1] // k_hbm.shape[1]
    for idx in range(len(descs)):
        hh, q0, p = descs[idx]
        h = g * group + hh
        end = _visible_end(causal, q0, p, Sq, Sk)
        start = _visible_start(window, q0, Sq, Sk)
        dq_sb = nl.ndarray((p, D), dtype=dq_hbm.dtype, buffer=nl.sbuf)
        if end <= start:  # no row of the tile sees a key: dq = 0
            nisa.memset(dst=dq_sb, value=0.0)
            nisa.dma_copy(dst=dq_hbm[b, h, q0:q0 + p, 0:D], src=dq_sb)
            continue
        rt = rows[idx] if len(rows) else _row_tile(ins, v0_sb, b, h, q0, p, dead, window)
        dhat_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        if window > 0:
            _diag_dhat(rt, _key_block(k_hbm, v_hbm, keys, b, g), q0, p, end, Sq, Sk, dhat_sb)
        dq_psum = nl.ndarray((p, D), dtype=nl.float32, buffer=nl.psum)
        for k0 in range(start, end, KB):
            kp = min(KB, Sk - k0)
            kt = keys[k0 // KB] if len(keys) else _key_tile(k_hbm, v_hbm, b, g, k0, kp)
            kc = min(kp, end - k0)
            masks = (_diagonal(causal, q0, p, k0, kc, Sq, Sk), window_edge(window, q0, p, k0, Sk - Sq))
            _, ds_parts = _block(rt, kt, dhat_sb, k0 == 0 and window == 0, kc, masks, scale, softcap, False)
            k_sb = kt[0][0:kc, 0:D]
            if exact and masks[1] != None:  # noqa: E711
                k_sb = _masked_keys(kt[0], kc, k0 - (q0 + Sk - Sq + 1 - window))
            for part_sb in ds_parts:
                nisa.nc_matmul(dst=dq_psum, stationary=_transposed(part_sb, 0, kc), moving=k_sb)
        nisa.activation(dst=dq_sb, op=nl.copy, data=dq_psum, scale=scale)
        if dead:
            nisa.tensor_copy_predicated(dst=dq_sb, src=0.0, predicate=rt[6].broadcast(1, D))
        nisa.dma_copy(dst=dq_hbm[b, h, q0:q0 + p, 0:D], src=dq_sb)


def _block(rt, kt, dhat_sb, first, kc, masks, scale, softcap, want_p):
    """One (query tile, key block) of kc keys: (P's parts or None, dS's parts), each part [p, kc] in q's dtype.

    P = exp(scale S - lse) and dS = P (dP - D) are formed in float32; masked pairs get exactly 0 in both
    (selected, not multiplied: a masked dP may be inf). masks: the causal diagonal's and the window start's
    affine_select offsets (None: not crossing). On the first block of a query tile D = dP[:, 0] + delta is
    formed. With a soft cap c, P = exp(c t - lse) with t = tanh(scale S / c) and dS carries the slope 1 - t^2.
    The parts sum to the float32 value (see _parts)."""
    q_nat_sb, qT_sb, do_nat_sb, doT_tiles, neg_lse_sb, delta_sb, dead_sb = rt
    kT_sb, vT_tiles = kt[1], kt[2]
    D, p = qT_sb.shape[0], qT_sb.shape[1]
    s_psum = nl.ndarray((p, kc), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=s_psum, stationary=qT_sb, moving=kT_sb[0:D, 0:kc])
    p_sb = nl.ndarray((p, kc), dtype=nl.float32, buffer=nl.sbuf)
    if softcap > 0:
        t_sb = nl.ndarray((p, kc), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=t_sb, op=nl.tanh, data=s_psum, scale=scale / softcap)
        nisa.activation(dst=p_sb, op=nl.exp, data=t_sb, bias=neg_lse_sb, scale=float(softcap))
    else:
        nisa.activation(dst=p_sb, op=nl.exp, data=s_psum, bias=neg_lse_sb, scale=scale)
    dp_psum = nl.ndarray((p, kc), dtype=nl.float32, buffer=nl.psum)
    for c in range(len(doT_tiles)):
        dvc = doT_tiles[c].shape[0]
        nisa.nc_matmul(dst=dp_psum, stationary=doT_tiles[c], moving=vT_tiles[c][0:dvc, 0:kc])
    if first:
        nisa.tensor_tensor(dst=dhat_sb, data1=dp_psum[0:p, 0:1], data2=delta_sb, op=nl.add)
    ds_sb = nl.ndarray((p, kc), dtype=nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=ds_sb, data=dp_psum, op0=nl.subtract, operand0=dhat_sb, op1=nl.multiply,
                              operand1=p_sb)
    if softcap > 0:  # dS_raw = dS (1 - t^2)
        slope_sb = nl.ndarray((p, kc), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=slope_sb, data1=t_sb, data2=t_sb, op=nl.multiply)
        nisa.tensor_scalar(dst=slope_sb, data=slope_sb, op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=1.0)
        nisa.tensor_tensor(dst=ds_sb, data1=ds_sb, data2=slope_sb, op=nl.multiply)
    for t_sb in (p_sb, ds_sb):
        if masks[0] != None:  # noqa: E711 (NKI kernels compare with None by value)
            nisa.affine_select(dst=t_sb, pattern=[[-1, kc]], channel_multiplier=1, on_true_tile=t_sb,
                               on_false_value=0.0, cmp_op=nl.greater_equal, offset=masks[0])
        if masks[1] != None:  # noqa: E711
            nisa.affine_select(dst=t_sb, pattern=[[1, kc]], channel_multiplier=-1, on_true_tile=t_sb,
                               on_false_value=0.0, cmp_op=nl.greater_equal, offset=masks[1])
        if dead_sb != None:  # noqa: E711
            nisa.tensor_copy_predicated(dst=t_sb, src=0.0, predicate=dead_sb.broadcast(1, kc))
    return _parts(p_sb, q_nat_sb.dtype) if want_p else None, _parts(ds_sb, q_nat_sb.dtype)


def _diag_rows(v_hbm, b, g, q0, p, Sq):
    """[p, Dv] float32: row r holds v of its diagonal key q0 + r + Sk - Sq (0 for rows before key 0: they see
    no key, are dead and zeroed)."""
    Sk, Dv = v_hbm.shape[2], v_hbm.shape[3]
    d0 = q0 + Sk - Sq
    n0 = min(p, max(0, -d0))
    rows_sb = nl.ndarray((p, Dv), dtype=v_hbm.dtype, buffer=nl.sbuf)
    nisa.memset(dst=rows_sb, value=0.0)
    if n0 < p:  # DMA reaches any partition; the engines' tiles must start at partition 0 (or 32/64/96)
        nisa.dma_copy(dst=rows_sb[n0:p, 0:Dv], src=v_hbm[b, g, d0 + n0:d0 + p, 0:Dv])
    ref_sb = nl.ndarray((p, Dv), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=ref_sb, src=rows_sb)
    return ref_sb


def _diag_dhat(rt, key_block, q0, p, end, Sq, Sk, dhat_sb):
    """D = dP[i, diagonal key of i] + delta (under a window; delta from _diag_rows' values): the diagonal is the
    one key every live row sees, so dP - D cancels exactly where a row sees only it (window 1). dP is formed by
    the very matmul _block issues on the block(s) holding the tile's diagonal (same operands, same kc: the same
    float32 values) and its diagonal taken by an equality affine_select (exact: x + zeros)."""
    doT_tiles, delta_sb = rt[3], rt[5]
    d0 = q0 + Sk - Sq
    nisa.tensor_copy(dst=dhat_sb, src=delta_sb)
    for k0, kc in spans(end, KB, max(0, d0) // KB * KB):  # end <= Sk
        vT_tiles = key_block(k0)[2]
        dp_psum = nl.ndarray((p, kc), dtype=nl.float32, buffer=nl.psum)
        for c in range(len(doT_tiles)):
            dvc = doT_tiles[c].shape[0]
            nisa.nc_matmul(dst=dp_psum, stationary=doT_tiles[c], moving=vT_tiles[c][0:dvc, 0:kc])
        diag_sb = nl.ndarray((p, kc), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=diag_sb, src=dp_psum)
        nisa.affine_select(dst=diag_sb, pattern=[[-1, kc]], channel_multiplier=1, on_true_tile=diag_sb,
                           on_false_value=0.0, cmp_op=nl.equal, offset=d0 - k0)
        part_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=part_sb, op=nl.add, data=diag_sb, axis=1, keepdims=True)
        nisa.tensor_tensor(dst=dhat_sb, data1=dhat_sb, data2=part_sb, op=nl.add)


def _parts(x_sb, dtype):
    """x (float32) as TensorE operands of `dtype`: [x] for float32; for 16-bit, [hi, lo] with hi = x rounded and
    lo = x - hi rounded (exact before rounding), so two 16-bit matmuls into one float32 PSUM accumulator carry x
    to ~2^-17 relative (bf16) where one would carry it to 2^-9: a P or dS rounded once to bf16 before P^T dO,
    dS^T q and dS k costs up to 14% of dv where two rows' terms cancel (conformance hyp-1, bf16)."""
    if dtype == nl.float32:
        return [x_sb]
    p, f = x_sb.shape[0], x_sb.shape[1]
    hi_sb = nl.ndarray((p, f), dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=hi_sb, src=x_sb)
    lo_sb = nl.ndarray((p, f), dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=lo_sb, data1=x_sb, data2=hi_sb, op=nl.subtract)
    return [hi_sb, lo_sb]


def _key_block(k_hbm, v_hbm, keys, b, g):
    """k0 -> the key tile of the block from k0: the resident one, else loaded."""
    Sk = k_hbm.shape[2]
    return lambda k0: keys[k0 // KB] if len(keys) else _key_tile(k_hbm, v_hbm, b, g, k0, min(KB, Sk - k0))


def _key_tile(k_hbm, v_hbm, b, g, k0, kp):
    """Keys k0:k0+kp of KV head g: (k [kp, D], k^T [D, kp], [v^T [<=128, kp] per 128 value columns], v [kp, Dv])."""
    D, Dv = k_hbm.shape[3], v_hbm.shape[3]
    k_sb = nl.ndarray((kp, D), dtype=k_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=k_sb, src=k_hbm[b, g, k0:k0 + kp, 0:D])
    kT_sb = _transposed(k_sb, 0, D)
    v_sb = nl.ndarray((kp, Dv), dtype=v_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=v_sb, src=v_hbm[b, g, k0:k0 + kp, 0:Dv])
    vT_tiles = []
    for c0, c in spans(Dv, KP):
        vT_tiles.append(_transposed(v_sb, c0, c))
    return k_sb, kT_sb, vT_tiles, v_sb


def _row_tile(ins, v0_sb, b, h, q0, p, dead, window):
    """Query rows q0:q0+p of head h: (q, q^T, dO, [dO^T per 128 value columns], -lse, delta, dead predicate).

    delta = rowsum(dO * (O - v_0)) in float32 (see _attention_backward_kernel); with a window (key 0 may be
    outside it), rowsum(dO * (O - v_i)) with v_i the values of row i's own diagonal key (see _diag_dhat). With `dead`, rows with
    lse = -inf get q = dO = 0 before anything uses them, and their predicate is returned (else None)."""
    do_hbm, q_hbm, o_hbm, lse_hbm = ins[0], ins[1], ins[4], ins[5]
    D, Dv = q_hbm.shape[3], do_hbm.shape[3]
    q_sb = nl.ndarray((p, D), dtype=q_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=q_sb, src=q_hbm[b, h, q0:q0 + p, 0:D])
    do_sb = nl.ndarray((p, Dv), dtype=do_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=do_sb, src=do_hbm[b, h, q0:q0 + p, 0:Dv])
    lse_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=lse_sb, src=lse_hbm[b, h, q0:q0 + p])
    dead_sb = None
    if dead:
        dead_sb = nl.ndarray((p, 1), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=dead_sb, data=lse_sb, op0=nl.equal, operand0=-math.inf)
        nisa.tensor_copy_predicated(dst=q_sb, src=0.0, predicate=dead_sb.broadcast(1, D))
        nisa.tensor_copy_predicated(dst=do_sb, src=0.0, predicate=dead_sb.broadcast(1, Dv))
    doT_tiles = []
    for c0, c in spans(Dv, KP):
        doT_tiles.append(_transposed(do_sb, c0, c))
    neg_lse_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=neg_lse_sb, data=lse_sb, op0=nl.multiply, operand0=-1.0)
    o_sb = nl.ndarray((p, Dv), dtype=o_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=o_sb, src=o_hbm[b, h, q0:q0 + p, 0:Dv])
    diff_sb = nl.ndarray((p, Dv), dtype=nl.float32, buffer=nl.sbuf)  # O - v_0, then dO * (O - v_0)
    ref_sb = v0_sb[0:p, 0:Dv] if window == 0 else _diag_rows(ins[3], b, h // (q_hbm.shape[1] // ins[2].shape[1]), q0, p,
                                                                q_hbm.shape[2])
    nisa.tensor_tensor(dst=diff_sb, data1=o_sb, data2=ref_sb, op=nl.subtract)
    nisa.tensor_tensor(dst=diff_sb, data1=diff_sb, data2=do_sb, op=nl.multiply)
    delta_sb = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=delta_sb, op=nl.add, data=diff_sb, axis=1, keepdims=True)
    return q_sb, _transposed(q_sb, 0, D), do_sb, doT_tiles, neg_lse_sb, delta_sb, dead_sb


def _transposed(x_sb, c0, c):
    """x[:, c0:c0+c]^T in SBUF, through a TensorE transpose into PSUM (bit-exact from NeuronCore-v3)."""
    p = x_sb.shape[0]
    xT_psum = nl.ndarray((c, p), dtype=x_sb.dtype, buffer=nl.psum)
    nisa.nc_transpose(dst=xT_psum, data=x_sb[0:p, c0:c0 + c])
    xT_sb = nl.ndarray((c, p), dtype=x_sb.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=xT_sb, src=xT_psum)
    return xT_sb


def _v0_rows(v0_sb, rows):
    """The row v_0 [1, Dv] (key 0's values, already in SBUF) on `rows` partitions in float32, replicated by a
    K = 1 TensorE matmul against ones (exact: one term, times 1)."""
    Dv = v0_sb.shape[1]
    ones_sb = nl.ndarray((1, rows), dtype=v0_sb.dtype, buffer=nl.sbuf)
    nisa.memset(dst=ones_sb, value=1.0)
    rep_psum = nl.ndarray((rows, Dv), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=rep_psum, stationary=ones_sb, moving=v0_sb)
    rep_sb = nl.ndarray((rows, Dv), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=rep_sb, src=rep_psum)
    return rep_sb


def _supports(grad, q, k, v, out, lse, causal, scale, softcap=None, sliding_window=None):
    return declines(q, k, v, causal, scale, softcap, sliding_window)


@impl(spec.backward_op, "neuron", supports=_supports)
def attention_backward(grad: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray,
                       lse: np.ndarray, causal: bool, scale, softcap=None, sliding_window=None) -> tuple:
    """Host side: contiguous inputs, the default scale, and the two data-dependent variants the kernel takes as
    compile-time flags: exact one-row query tiles when q, k or grad holds inf/NaN under the causal mask, and the
    dead-row handling when some lse is -inf."""
    if min(q.size, k.size, v.size) == 0:  # no rows or no keys: every sum is empty
        dt = np_dtype(q.dtype.name)
        return np.zeros(q.shape, dt), np.zeros(k.shape, dt), np.zeros(v.shape, dt)
    s = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    finite = np.isfinite(q).all() and np.isfinite(k).all() and np.isfinite(grad).all()
    q_rows = 1 if causal and not finite else Q_ROWS
    dead = bool(np.isneginf(lse).any())
    args = [_host.contiguous(a) for a in (grad, q, k, v, out, lse)]
    dq, dk, dv = _host.run(_attention_backward_kernel, *args, bool(causal), s, q_rows, dead,
                           *cap_window(softcap, sliding_window))
    return tuple(_host.as_dtype(r, q.dtype.name, a.shape) for r, a in zip((dq, dk, dv), (q, k, v)))
