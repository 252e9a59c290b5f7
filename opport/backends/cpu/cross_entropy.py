"""cross_entropy on NumPy: online logsumexp over vocabulary chunks, float32 for 16-bit logits, float32 output."""

import numpy as np

from opport.arraymath import reduce_losses
from opport.backends.cpu import _cfuncs, _fused
from opport.backends.cpu._common import parallel_rows, result_block, store, upcast
from opport.dispatch import impl
from opport.dtypes import acc_of
from opport.ops.cross_entropy import cross_entropy as spec

VOCAB_CHUNK = 32768  # columns per step: a [rows, VOCAB_CHUNK] float32 block, never [N, V]; 4x fewer
# GIL-holding max reductions than 8192 (1.5 ms vs 3.0 ms for 16 x 128256 on 2 threads)


@impl(spec, "cpu")
def cross_entropy(logits: np.ndarray, target: np.ndarray, ignore_index: int, reduction: str, label_smoothing: float):
    """Per-row loss (m - x_t) + log(sum exp(x - m)), smoothed and reduced; float32 out.

    Dimensions: logits [N, V], target [N]. The row max m, the scaled sum of exponentials and (for
    smoothing) sum(x - pivot) are carried across vocabulary chunks; nothing as large as N x V is allocated.
    Notes: the loss is formed as (m - x_t) + log(s), never as logsumexp - x_t, so logits of 1e4 keep
    float32 relative accuracy; a target outside [0, V) gives a NaN row, an ignored row is 0 even if its
    logits hold NaN.
    """
    return _forward(logits, target, ignore_index, reduction, label_smoothing)[0]


@impl(spec.train_forward, "cpu")
def cross_entropy_forward(logits: np.ndarray, target: np.ndarray, ignore_index: int, reduction: str,
                          label_smoothing: float):
    """The forward plus the per-row logsumexp m + log(s) [N] (float32) it has at hand, for the backward."""
    return _forward(logits, target, ignore_index, reduction, label_smoothing)


def _forward(logits, target, ignore_index, reduction, label_smoothing) -> tuple:
    """(reduced float32 loss, lse [N] in the accumulation dtype: float32, float64 for float64 logits)."""
    n, v = logits.shape
    acc = acc_of(logits.dtype)
    t = target.astype(np.int64)
    ignored = t == ignore_index
    valid = (t >= 0) & (t < v)
    loss, lse = np.empty(n, acc), np.empty(n, acc)
    tc = np.clip(t, 0, v - 1)

    def body(rows):
        loss[rows], m, log_s = _row_losses(logits[rows], tc[rows], acc.type(label_smoothing))
        lse[rows] = m + log_s

    parallel_rows(n, min(v, VOCAB_CHUNK), body)  # blocks of rows x one vocabulary chunk
    loss = np.where(ignored, acc.type(0), np.where(valid, loss, acc.type(np.nan)))
    with np.errstate(over="ignore"):  # a float64 loss beyond float32's range is inf
        return reduce_losses(loss, ignored, reduction).astype(np.float32), lse


def _row_losses(x: np.ndarray, t: np.ndarray, eps) -> tuple:
    """(loss, m, log(s)) per row: the logsumexp is m + log(s), m the row max."""
    rows, v = x.shape
    xt = upcast(x[np.arange(rows), t])
    acc = xt.dtype
    pivot = np.where(np.isfinite(xt), xt, acc.type(0))  # shift for sum(x): exact near x_t, finite always
    if _fused.enabled(x.dtype) and rows:  # one loop per statistic over whole rows; rows it leaves by the chunk loop
        m, s, d, bad = _fused.ce_stats(upcast(x), pivot, bool(eps), _cfuncs.row_tasks)
        if bad is not None:
            m[bad], log_b, d_b = _chunked_stats(x[bad], pivot[bad], eps)
            s[bad] = 1
        log_s = np.log(s)
        if bad is not None:
            log_s[bad], d[bad] = log_b, d_b
        return _losses(m, log_s, d, xt, pivot, eps, v)
    m, log_s, d = _chunked_stats(x, pivot, eps)
    return _losses(m, log_s, d, xt, pivot, eps, v)


def _chunked_stats(x: np.ndarray, pivot: np.ndarray, eps) -> tuple:
    """(m, log(s), sum(x - pivot)) per row by the online logsumexp over vocabulary chunks."""
    rows, v = x.shape
    acc = pivot.dtype
    m = np.full(rows, -np.inf, acc)
    s = np.zeros(rows, acc)
    d = np.zeros(rows, acc)
    for c0 in range(0, v, VOCAB_CHUNK):
        xc = upcast(x[:, c0:c0 + VOCAB_CHUNK])
        m_new = np.maximum(m, xc.max(axis=1))
        m_ref = np.where(m_new == -np.inf, acc.type(0), m_new)  # all -inf so far: exp() gives 0, not NaN
        s = s * np.exp(m - m_ref) + np.exp(xc - m_ref[:, None]).sum(axis=1)
        if eps:
            d += (xc - pivot[:, None]).sum(axis=1)
        m = m_new
    return m, np.log(s), d


def _losses(m, log_s, d, xt, pivot, eps, v: int) -> tuple:
    """(loss, m, log(s)) from the row statistics."""
    nll = (m - xt) + log_s
    if not eps:
        return nll, m, log_s
    smooth = (m - pivot) + log_s - d / xt.dtype.type(v)  # logsumexp - mean(row)
    return (1 - eps) * nll + eps * smooth, m, log_s


@impl(spec.backward_op, "cpu")
def cross_entropy_backward(grad: np.ndarray, logits: np.ndarray, target: np.ndarray, lse: np.ndarray,
                           ignore_index: int, reduction: str, label_smoothing: float):
    """dlogits = c (exp(x - lse) - eps/V - (1 - eps) onehot(t)) per row, c its share of grad.

    Dimensions: logits [N, V], target and lse [N]. Blocks of rows x one vocabulary chunk, as the forward:
    the softmax comes from the saved lse in one pass, and no temporary is larger than a block.
    Notes: ignored rows are written 0 (NaN logits there cannot leak), rows whose target is out of
    range NaN; the result is computed in float32 (float64 for float64 logits) and rounded once.
    """
    n, v = logits.shape
    acc = acc_of(logits.dtype)
    t = target.astype(np.int64)
    ignored, valid = t == ignore_index, (t >= 0) & (t < v)
    coef = _coefficients(np.asarray(grad, acc), ignored, reduction)
    l_acc = lse.astype(acc)
    eps = acc.type(label_smoothing)
    out = np.empty((n, v), logits.dtype)

    zero = np.zeros(n, acc)  # x - lse, written (x - lse) - 0: the same bits

    def body(rows):
        _write_grad(out, logits, rows, t, (l_acc, zero), coef, ignored, valid, eps)

    parallel_rows(n, min(v, VOCAB_CHUNK), body)
    return (out,)


@impl(spec.value_and_grad_op, "cpu")
def cross_entropy_value_and_grad(logits: np.ndarray, target: np.ndarray, ignore_index: int, reduction: str,
                                 label_smoothing: float):
    """(loss, dlogits for a unit upstream gradient): each block of rows is reduced, then its gradient written.

    Dimensions: logits [N, V], target [N]. Per block of rows (`parallel_rows`, blocks of rows x one vocabulary
    chunk) the forward's online logsumexp runs over the block's chunks, then the backward's chunk loop writes
    dlogits for the same rows while they are still in cache: the logits are read from memory about once.
    Notes: the loss is the forward kernel's, bit for bit; dlogits is the backward kernel's at grad = 1, except
    that x - lse is formed as (x - m) - log(s) from the row max m and log(s) the logsumexp pass has at hand:
    x - m is exact where p matters, so p keeps float32's relative accuracy even where an lse rounded to
    float32 would carry an ulp of |m| (0.002 at 3e4: the lse path's p is then 0.2% off).
    """
    n, v = logits.shape
    acc = acc_of(logits.dtype)
    t = target.astype(np.int64)
    ignored, valid = t == ignore_index, (t >= 0) & (t < v)
    coef = _coefficients(np.ones((), acc), ignored, reduction)
    eps = acc.type(label_smoothing)
    tc = np.clip(t, 0, v - 1)
    loss, m, log_s = np.empty(n, acc), np.empty(n, acc), np.empty(n, acc)
    out = np.empty((n, v), logits.dtype)

    def body(rows):
        loss[rows], m[rows], log_s[rows] = _row_losses(logits[rows], tc[rows], eps)
        _write_grad(out, logits, rows, t, (m, log_s), coef, ignored, valid, eps)

    parallel_rows(n, min(v, VOCAB_CHUNK), body)
    loss = np.where(ignored, acc.type(0), np.where(valid, loss, acc.type(np.nan)))
    with np.errstate(over="ignore"):
        return reduce_losses(loss, ignored, reduction).astype(np.float32), out


def _write_grad(out, logits, rows, t, shift, coef, ignored, valid, eps) -> None:
    """out[rows] = coef (exp(x - lse) - eps/V - (1 - eps) onehot(t)), chunk by chunk (see cross_entropy_backward);
    x - lse is computed as (x - a) - b from shift = (a, b), lse = a + b per row."""
    v = logits.shape[1]
    acc = shift[0].dtype
    c, tr, keep = coef[rows, None], t[rows], valid[rows] & ~ignored[rows]
    a, b = shift[0][rows], shift[1][rows]
    if _fused.enabled(logits.dtype):  # whole rows in one loop; the target column and the rows it leaves as below
        xf, dst = upcast(logits[rows]), out[rows]
        y = result_block(dst, xf)
        bad = _fused.ce_grad(xf, a, b, eps / acc.type(v) if eps else 0, c[:, 0], y, _cfuncs.row_tasks)
        on = keep.copy()
        if bad is not None:
            on[bad] = False
            y[bad] = _grad_rows(xf[bad], a[bad], b[bad], c[bad], tr[bad], keep[bad], eps, v)
        hit = np.flatnonzero(on)
        if hit.size:  # the target column as the chunk loop forms it (NumPy's exp), then its share c
            col = tr[hit]
            d = (xf[hit, col] - a[hit]) - b[hit]
            y_t = np.exp(d)
            if eps:
                y_t -= eps / acc.type(v)
            y[hit, col] = _at_target(y_t, d, eps, v) * c[hit, 0]
        _fix_rows(y, ignored[rows], valid[rows])
        store(dst, y)
        return
    for c0 in range(0, v, VOCAB_CHUNK):
        c1 = min(c0 + VOCAB_CHUNK, v)
        xc, dst = upcast(logits[rows, c0:c1]), out[rows, c0:c1]
        y = result_block(dst, xc)
        np.subtract(xc, a[:, None], out=y)
        y -= b[:, None]
        np.exp(y, out=y)
        if eps:
            y -= eps / acc.type(v)
        hit = np.flatnonzero(keep & (tr >= c0) & (tr < c1))
        if hit.size:
            col = tr[hit] - c0
            y[hit, col] = _at_target(y[hit, col], (xc[hit, col] - a[hit]) - b[hit], eps, v)
        y *= c
        _fix_rows(y, ignored[rows], valid[rows])
        store(dst, y)


def _grad_rows(xf, a, b, c, tr, keep, eps, v: int) -> np.ndarray:
    """The chunk loop's formula on whole rows (the rows the fused loop leaves), before _fix_rows."""
    y = np.subtract(xf, a[:, None])
    y -= b[:, None]
    np.exp(y, out=y)
    if eps:
        y -= eps / a.dtype.type(v)
    hit = np.flatnonzero(keep)
    if hit.size:
        y[hit, tr[hit]] = _at_target(y[hit, tr[hit]], (xf[hit, tr[hit]] - a[hit]) - b[hit], eps, v)
    y *= c
    return y


def _at_target(y_t: np.ndarray, d: np.ndarray, eps, v: int) -> np.ndarray:
    """p_t - eps/V - (1 - eps) from y_t = p_t - eps/V and d = x_t - lse: where p_t > 1/2, as
    expm1(d) + (eps - eps/V), whose error is an ulp of 1 - p_t instead of an ulp of 1 (peaked rows)."""
    t = d.dtype.type
    return np.where(d > t(-0.6931471805599453), np.expm1(d) + (eps - eps / t(v)), y_t - (1 - eps))


def _coefficients(grad: np.ndarray, ignored: np.ndarray, reduction: str) -> np.ndarray:
    """Each row's share of the upstream gradient [N]: grad[i], grad, or grad / kept rows; 0 where ignored."""
    n = ignored.size
    if reduction == "mean":
        grad = grad / grad.dtype.type(max(n - int(np.count_nonzero(ignored)), 1))  # none kept: all rows are 0
    return np.where(ignored, grad.dtype.type(0), np.broadcast_to(grad, (n,)))


def _fix_rows(y: np.ndarray, ignored: np.ndarray, valid: np.ndarray) -> None:
    """Ignored rows exactly 0 (their logits may hold NaN), rows with an out-of-range target NaN."""
    if ignored.any():
        y[ignored] = 0
    bad = ~valid & ~ignored
    if bad.any():
        y[bad] = np.nan
