"""linear_cross_entropy on NumPy: logits made one ROW_BLOCK x VOCAB_CHUNK tile at a time by BLAS, online logsumexp.

Peak extra memory: a few float32 (float64 for float64 inputs) tiles of ROW_BLOCK x VOCAB_CHUNK (4 MiB each),
per-row statistics [N], and in the backward a VOCAB_CHUNK x H dweight accumulator, the float32 dhidden
accumulator [N, H] (the output itself for float32/float64) and the upcast 16-bit operand tiles; never N x V.
"""

import numpy as np

from opport.arraymath import reduce_losses
from opport.backends.cpu import _fused, _invariant
from opport.backends.cpu._common import gemm, gemm_add, upcast, uses_blas
from opport.backends.cpu.cross_entropy import _at_target, _coefficients, _fix_rows, _row_losses, _write_grad
from opport.dispatch import impl
from opport.dtypes import acc_of
from opport.ops.linear_cross_entropy import linear_cross_entropy as spec

ROW_BLOCK = 256  # tokens per tile
VOCAB_CHUNK = 4096  # vocabulary entries per tile: 256 x 4096 float32 = 4 MiB, GEMMs large enough for BLAS


@impl(spec, "cpu")
@uses_blas()
def linear_cross_entropy(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap):
    """The loss of hidden @ weight.T (+ bias), softcapped, without the N x V logits (module docstring).

    Dimensions: hidden [N, H], weight [V, H], target [N], bias [V]. Per block of ROW_BLOCK rows the
    vocabulary is walked in VOCAB_CHUNK tiles: z = x @ w_tile^T (+ b) by BLAS in float32 (float64 stays
    float64), the row max m, the scaled sum s of exp(z - m), the target's logit and (with smoothing) the
    row sum of z are carried across tiles. Loss = (m - z_t) + log s, as cpu cross_entropy's.
    """
    return _forward(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap)[0]


@impl(spec.train_forward, "cpu")
@uses_blas()
def linear_cross_entropy_forward(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap):
    """The forward plus the per-row logsumexp m + log s [N] it has at hand, for the backward."""
    return _forward(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap)


def _tile_logits(x, weight, bias, c0, c1, softcap) -> tuple:
    """(z, 1 - tanh² or None) for the rows x (already upcast) and vocabulary entries [c0, c1); row-invariant
    logits under opport.batch_invariant()."""
    z = _invariant.dot(x, upcast(weight[c0:c1]).T)
    if bias is not None:
        z += upcast(bias[c0:c1])
    if softcap is None:
        return z, None
    th = np.tanh(z / z.dtype.type(softcap))
    np.multiply(th, z.dtype.type(softcap), out=z)
    return z, 1 - th * th


def _forward(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap) -> tuple:
    """(reduced float32 loss, lse [N] in the accumulation dtype)."""
    n, v = hidden.shape[0], weight.shape[0]
    acc = acc_of(hidden.dtype)
    t = target.astype(np.int64)
    ignored, valid = t == ignore_index, (t >= 0) & (t < v)
    eps = acc.type(label_smoothing)
    loss, lse = np.empty(n, acc), np.empty(n, acc)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for r0 in range(0, n, ROW_BLOCK):
            rows = slice(r0, min(r0 + ROW_BLOCK, n))
            loss[rows], lse[rows] = _block_loss(upcast(hidden[rows]), weight, bias, t[rows], eps, softcap)
        loss = np.where(ignored, acc.type(0), np.where(valid, loss, acc.type(np.nan)))
        return reduce_losses(loss, ignored, reduction).astype(np.float32), lse


def _block_loss(x, weight, bias, t, eps, softcap) -> tuple:
    """(loss, lse) of one block of rows, over every vocabulary tile (online logsumexp)."""
    rows, v = x.shape[0], weight.shape[0]
    acc = x.dtype
    m = np.full(rows, -np.inf, acc)
    s, total, zt = np.zeros(rows, acc), np.zeros(rows, acc), np.zeros(rows, acc)
    for c0 in range(0, v, VOCAB_CHUNK):
        c1 = min(c0 + VOCAB_CHUNK, v)
        z, _ = _tile_logits(x, weight, bias, c0, c1, softcap)
        m_new = np.maximum(m, z.max(axis=1))
        m_ref = np.where(m_new == -np.inf, acc.type(0), m_new)
        s = s * np.exp(m - m_ref) + np.exp(z - m_ref[:, None]).sum(axis=1)
        m = m_new
        hit = np.flatnonzero((t >= c0) & (t < c1))
        zt[hit] = z[hit, t[hit] - c0]
        if eps:
            total += z.sum(axis=1)
    log_s = np.log(s)
    nll = (m - zt) + log_s
    if eps:
        nll = (1 - eps) * nll + eps * ((m - total / acc.type(v)) + log_s)  # not (m + log s) - mean: log s lost at 1e35
    return nll, m + log_s


@impl(spec.backward_op, "cpu")
@uses_blas()
def linear_cross_entropy_backward(grad, hidden, weight, target, lse, bias, ignore_index, reduction, label_smoothing,
                                  softcap):
    """dhidden, dweight, dbias from the logits recomputed tile by tile (module docstring for the memory).

    Dimensions: as the forward; lse [N]. Vocabulary tiles outside, row blocks inside: each tile's dweight
    and dbias are summed in float32 over every row block, then rounded once into the output; dhidden
    accumulates dlogits @ w_tile over the tiles. dlogits = c (exp(z - lse) - eps/V - (1 - eps) onehot) (the
    target's entry through expm1 where p_t > 1/2, as cpu cross_entropy), times 1 - tanh² with a softcap.
    Notes: ignored rows are 0, rows with a target outside [0, V) NaN (spreading to every dweight/dbias entry).
    """
    v = weight.shape[0]
    acc = acc_of(hidden.dtype)
    t = target.astype(np.int64)
    ignored, valid = t == ignore_index, (t >= 0) & (t < v)
    coef = _coefficients(np.asarray(grad, acc), ignored, reduction)
    eps, lse = acc.type(label_smoothing), lse.astype(acc, copy=False)

    def dlogits(x, rows, c0, c1):
        return _dlogits(x, weight, bias, c0, c1, softcap, t[rows], lse[rows], coef[rows], ignored[rows], valid[rows],
                        eps)

    return head_gradients(hidden, weight, bias, t, dlogits)


def head_gradients(hidden, weight, bias, t, dlogits) -> tuple:
    """dhidden, dweight, dbias of an LM head's loss from its dlogits tiles (shared with linear_logprobs).

    Vocabulary tiles outside, row blocks inside: `dlogits(x, rows, c0, c1)` gives the tile's gradient w.r.t. the
    logits (x the block's upcast rows); each tile's dweight and dbias are summed in the accumulation dtype over
    every row block, then rounded once into the output; dhidden accumulates d @ w_tile over the tiles. The target
    entries are added after the GEMMs (`_take_targets`)."""
    n, h = hidden.shape
    v = weight.shape[0]
    acc = acc_of(hidden.dtype)
    dh = np.zeros((n, h), acc)
    dw = np.empty((v, h), weight.dtype)
    db = None if bias is None else np.empty(v, bias.dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        for c0 in range(0, v, VOCAB_CHUNK):
            c1 = min(c0 + VOCAB_CHUNK, v)
            wc = upcast(weight[c0:c1])
            dw_acc, db_acc = np.zeros((c1 - c0, h), acc), np.zeros(c1 - c0, acc)
            for r0 in range(0, n, ROW_BLOCK):
                rows = slice(r0, min(r0 + ROW_BLOCK, n))
                x = upcast(hidden[rows])
                d = dlogits(x, rows, c0, c1)
                hit, col, dt = _take_targets(d, t[rows], c0, c1)
                dh_tile = gemm(d, wc)
                _fused.add_scaled_rows(dh_tile, hit, dt, wc, col)  # dh_tile[hit] += dt w[col] (rows distinct)
                dh[rows] += dh_tile
                dw_acc += gemm(d.T, x)
                _fused.add_scaled_rows(dw_acc, col, dt, x, hit)  # in row order: deterministic
                db_acc += d.sum(axis=0)
                np.add.at(db_acc, col, dt)
            dw[c0:c1] = dw_acc
            if db is not None:
                db[c0:c1] = db_acc
        return dh.astype(hidden.dtype, copy=False), dw, db


def _take_targets(d, t, c0, c1) -> tuple:
    """(rows, columns, values) of the target entries of a dlogits tile, set to 0 in `d`: the GEMMs then sum only the
    small p_v terms, and each row's ~-1 target term is added once after them. Summed inside the GEMM, the big term
    comes first in some BLAS kernels' order and every p_v ~ 1/V after it is rounded to an ulp of it: with V equal
    terms the errors add up instead of cancelling (3.6e-05 in a float32 dhidden of 1.3, V = 1000, with OpenBLAS's
    SkylakeX kernels; 8e-06 with its Haswell ones), so the verdict depended on the machine's CPU."""
    hit = np.flatnonzero((t >= c0) & (t < c1))
    col = t[hit] - c0
    dt = d[hit, col].copy()
    d[hit, col] = 0
    return hit, col, dt


def _dlogits(x, weight, bias, c0, c1, softcap, t, lse, coef, ignored, valid, eps) -> np.ndarray:
    """The loss's gradient for the logits of one tile (rows x [c0, c1)), before the tile's two GEMMs."""
    v = weight.shape[0]
    z, dcap = _tile_logits(x, weight, bias, c0, c1, softcap)
    zl = z - lse[:, None]
    y = np.exp(zl)
    if eps:
        y -= eps / y.dtype.type(v)
    hit = np.flatnonzero(valid & ~ignored & (t >= c0) & (t < c1))
    if hit.size:
        col = t[hit] - c0
        y[hit, col] = _at_target(y[hit, col], zl[hit, col], eps, v)
    y *= coef[:, None]
    _fix_rows(y, ignored, valid)
    if dcap is not None:
        y *= dcap
    return y


# --------------------------------------------------------------------------- forward fused with the backward

FUSED_LOGITS = 1 << 23  # elements of a row block's logits kept from its loss to its gradient: 32 MiB of float32
FUSED_ROWS_MIN = 64  # fewer rows per block and dweight's update per block (a pass over V x H) outweighs its GEMM
FUSED_DWEIGHT = 1 << 26  # elements of the float32 dweight accumulator 16-bit inputs need (256 MiB)


# rows per block of the fused kernel: fewer, larger products on torch's pool (a tiny Llama's head, 512 x 256 x 2048
# fwd + bwd at 2 threads: 14.0 -> 13.4 ms against 256 rows)
FUSED_ROW_BLOCK = 512


def _fused_rows(v: int) -> int:
    """Rows per block of the fused kernel: FUSED_ROW_BLOCK, fewer where a block's logits would pass FUSED_LOGITS."""
    return min(FUSED_ROW_BLOCK, FUSED_LOGITS // max(v, 1))


def _vag_supports(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap):
    """None where the fused kernel takes the call, else why not (the training forward and backward then run). Decided
    on dtypes and the reduction only (torch.compile fixes the choice when it traces, before sizes are known)."""
    if reduction == "none":
        return "reduction 'none': a per-row upstream gradient has to enter dweight's sum over rows"
    return None


def _one_pass(v: int, h: int, dtype: np.dtype) -> bool:
    """Whether the block layout pays: at least FUSED_ROWS_MIN rows per block, and for 16-bit inputs a float32
    dweight accumulator of at most FUSED_DWEIGHT elements."""
    return _fused_rows(v) >= FUSED_ROWS_MIN and (dtype in (np.float32, np.float64) or v * h <= FUSED_DWEIGHT)


@impl(spec.value_and_grad_op, "cpu", supports=_vag_supports)
@uses_blas()
def linear_cross_entropy_value_and_grad(hidden, weight, target, bias, ignore_index, reduction, label_smoothing,
                                        softcap):
    """(loss, dhidden, dweight, dbias) at a unit upstream gradient, the logits' GEMM run once.

    Dimensions: as the forward. Per block of rows (FUSED_ROW_BLOCK, fewer for a large vocabulary: FUSED_LOGITS) the
    logits against every vocabulary entry are formed once (by VOCAB_CHUNK tiles for 16-bit weights) and kept: the
    rows' losses come from them, then dlogits = c (p - eps/V - (1 - eps) onehot) in place of their exponentials
    (p = exp(z - m) / s, the target's entry through expm1 as cross_entropy's), then dhidden = dlogits @ weight and
    dweight, dbias += dlogits^T @ x, column sums, with the target entries added after the GEMMs (_take_targets).
    dweight and dbias accumulate in float32 (float64 for float64 inputs) over the blocks, rounded once.
    Where that layout does not pay (`_one_pass`: a vocabulary above 131072, a 16-bit dweight above 2^26 elements)
    the forward and backward kernels' tiles run instead, the logits formed twice, as without this op.
    """
    n, h = hidden.shape
    v = weight.shape[0]
    args = (hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap)
    if not _one_pass(v, h, hidden.dtype):
        loss, lse = _forward(*args)
        unit = np.ones((), np.float32)
        return (loss, *linear_cross_entropy_backward.__wrapped__(unit, hidden, weight, target, lse, *args[3:]))
    acc = acc_of(hidden.dtype)
    t = target.astype(np.int64)
    ignored, valid = t == ignore_index, (t >= 0) & (t < v)
    coef = _coefficients(np.ones((), acc), ignored, reduction)
    eps = acc.type(label_smoothing)
    loss, dh = np.empty(n, acc), np.empty((n, h), hidden.dtype)
    dw, db = np.zeros((v, h), acc), None if bias is None else np.zeros(v, acc)
    step = _fused_rows(v)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for r0 in range(0, n, step):
            rows = slice(r0, min(r0 + step, n))
            x = upcast(hidden[rows])
            z, dcap = _block_logits(x, weight, bias, softcap)
            loss[rows], d = _loss_and_dlogits(z, t[rows], eps, coef[rows], ignored[rows], valid[rows])
            if dcap is not None:
                d *= dcap
            dh[rows] = _block_gradients(x, d, weight, t[rows], dw, db)
        loss = np.where(ignored, acc.type(0), np.where(valid, loss, acc.type(np.nan)))
        out = reduce_losses(loss, ignored, reduction).astype(np.float32)
    return (out, dh, dw.astype(weight.dtype, copy=False),
            None if db is None else db.astype(bias.dtype, copy=False))


def _block_logits(x, weight, bias, softcap) -> tuple:
    """(z [rows, V], 1 - tanh² or None) of the block's rows against the whole vocabulary, by VOCAB_CHUNK tiles."""
    v = weight.shape[0]
    if v <= VOCAB_CHUNK:
        return _tile_logits(x, weight, bias, 0, v, softcap)
    z = np.empty((x.shape[0], v), x.dtype)
    dcap = None if softcap is None else np.empty_like(z)
    for c0 in range(0, v, VOCAB_CHUNK):
        c1 = min(c0 + VOCAB_CHUNK, v)
        z[:, c0:c1], dc = _tile_logits(x, weight, bias, c0, c1, softcap)
        if dcap is not None:
            dcap[:, c0:c1] = dc
    return z, dcap


def _loss_and_dlogits(z, t, eps, coef, ignored, valid) -> tuple:
    """(the rows' losses, dlogits) of one block's logits z [rows, V]: cross_entropy's value-and-grad kernel on them (its
    row statistics and gradient rows, fused loops included), so the head's loss is cross_entropy's of its logits."""
    nll, m, log_s = _row_losses(z, np.clip(t, 0, z.shape[1] - 1), eps)
    d = np.empty_like(z)
    _write_grad(d, z, slice(0, z.shape[0]), t, (m, log_s), coef, ignored, valid, eps)
    return nll, d


def _block_gradients(x, d, weight, t, dw, db) -> np.ndarray:
    """dhidden of the block's rows (returned, accumulation dtype); dweight and dbias added into dw, db. The target
    entries leave d before the GEMMs and are added after them (_take_targets: why)."""
    v = weight.shape[0]
    hit, col, dt = _take_targets(d, t, 0, v)
    dh = np.zeros((x.shape[0], weight.shape[1]), x.dtype)
    for c0 in range(0, v, VOCAB_CHUNK):
        c1 = min(c0 + VOCAB_CHUNK, v)
        wc, dc = upcast(weight[c0:c1]), d[:, c0:c1]
        gemm_add(dh, dc, wc)
        gemm_add(dw[c0:c1], dc.T, x)
        if db is not None:
            db[c0:c1] += dc.sum(axis=0)
    if hit.size:
        w = weight if weight.dtype == dh.dtype else upcast(weight[col])  # a 16-bit weight: only the target rows
        _fused.add_scaled_rows(dh, hit, dt, w, col if w is weight else np.arange(col.size))  # rows distinct
        _fused.add_scaled_rows(dw, col, dt, x, hit)  # in row order: deterministic
        if db is not None:
            np.add.at(db, col, dt)
    return dh
