"""linear_logprobs on NumPy: the tiles of linear_cross_entropy's cpu kernel (BLAS logits, online logsumexp), plus the
running entropy sum; the backward recomputes each tile and weights it by both outputs' upstream gradients.

Memory as linear_cross_entropy's: a few ROW_BLOCK x VOCAB_CHUNK tiles, per-row statistics, a VOCAB_CHUNK x H dweight
accumulator and the dhidden accumulator [N, H]; never N x V.
"""

import numpy as np

from opport.backends.cpu import _invariant
from opport.backends.cpu._common import upcast, uses_blas
from opport.backends.cpu.linear_cross_entropy import ROW_BLOCK, VOCAB_CHUNK, head_gradients
from opport.dispatch import impl
from opport.dtypes import acc_of
from opport.ops.linear_logprobs import linear_logprobs as spec


def _tile(x, weight, bias, c0, c1, inv_t, softcap) -> tuple:
    """(z, dz/da) of rows x (upcast) and vocabulary [c0, c1): z = cap(x @ w^T + b) / T, dz/da = (1 - tanh²) / T
    (row-invariant logits under opport.batch_invariant())."""
    z = _invariant.dot(x, upcast(weight[c0:c1]).T)
    if bias is not None:
        z += upcast(bias[c0:c1])
    f = z.dtype.type
    if softcap is None:
        z *= f(inv_t)
        return z, f(inv_t)
    th = np.tanh(z / f(softcap))
    np.multiply(th, f(softcap * inv_t), out=z)
    return z, (1 - th * th) * f(inv_t)


@impl(spec, "cpu")
@uses_blas()
def linear_logprobs(hidden, weight, target, bias, temperature, softcap, ignore_index):
    """(logps, entropy) float32 [N] (the op's docstring), in row blocks over vocabulary tiles."""
    return _forward(hidden, weight, target, bias, temperature, softcap, ignore_index)[:2]


@impl(spec.train_forward, "cpu")
@uses_blas()
def linear_logprobs_forward(hidden, weight, target, bias, temperature, softcap, ignore_index):
    """The forward plus each row's logsumexp [N] (accumulation dtype), for the backward."""
    return _forward(hidden, weight, target, bias, temperature, softcap, ignore_index)


def _forward(hidden, weight, target, bias, temperature, softcap, ignore_index) -> tuple:
    n, v = hidden.shape[0], weight.shape[0]
    acc = acc_of(hidden.dtype)
    t = target.astype(np.int64)
    ignored, valid = t == ignore_index, (t >= 0) & (t < v)
    logps, entropy, lse = np.empty(n, acc), np.empty(n, acc), np.empty(n, acc)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for r0 in range(0, n, ROW_BLOCK):
            rows = slice(r0, min(r0 + ROW_BLOCK, n))
            logps[rows], entropy[rows], lse[rows] = _block(upcast(hidden[rows]), weight, bias, t[rows],
                                                           1.0 / temperature, softcap)
        logps = np.where(ignored, acc.type(0), np.where(valid, logps, acc.type(np.nan)))
        entropy = np.where(ignored, acc.type(0), entropy)
    return logps.astype(np.float32), entropy.astype(np.float32), lse


def _block(x, weight, bias, t, inv_t, softcap) -> tuple:
    """(logp, entropy, lse) of one block of rows. Online over the tiles: max m, s = sum exp(z - m) and
    u = sum exp(z - m) (z - m); a new max m' rescales them: s' = s e^(m - m'), u' = (u + (m - m') s) e^(m - m')."""
    rows, v = x.shape[0], weight.shape[0]
    acc = x.dtype
    m = np.full(rows, -np.inf, acc)
    s, u, zt = np.zeros(rows, acc), np.zeros(rows, acc), np.zeros(rows, acc)
    for c0 in range(0, v, VOCAB_CHUNK):
        c1 = min(c0 + VOCAB_CHUNK, v)
        z, _ = _tile(x, weight, bias, c0, c1, inv_t, softcap)
        m_new = np.maximum(m, z.max(axis=1))
        m_ref = np.where(m_new == -np.inf, acc.type(0), m_new)
        scale = np.exp(m - m_ref)
        shift = np.where(s == 0, acc.type(0), (m - m_ref) * s)  # s = 0 at the start, where m - m_ref is -inf
        z -= m_ref[:, None]
        e = np.exp(z)
        u = (u + shift) * scale + (e * z).sum(axis=1)
        s = s * scale + e.sum(axis=1)
        m = m_new
        hit = np.flatnonzero((t >= c0) & (t < c1))
        zt[hit] = z[hit, t[hit] - c0] + m_ref[hit]
    log_s = np.log(s)
    lse = m + log_s
    return (zt - m) - log_s, log_s - u / s, lse


@impl(spec.backward_op, "cpu")
@uses_blas()
def linear_logprobs_backward(grad_logps, grad_entropy, hidden, weight, target, entropy, lse, bias, temperature, softcap,
                             ignore_index):
    """dhidden, dweight, dbias from the logits recomputed tile by tile (linear_cross_entropy's `head_gradients`).

    dz = -p (g_logp + g_entropy (z - lse + H)), plus g_logp at the target (through expm1 where p_t > 1/2: an ulp of
    1 - p_t, not of 1), times dz/da; ignored rows 0, targets outside [0, V) NaN. The target entries are added after
    the GEMMs (linear_cross_entropy's `_take_targets`: the verdict must not depend on BLAS's summation order).
    """
    v = weight.shape[0]
    acc = acc_of(hidden.dtype)
    t = target.astype(np.int64)
    ignored, valid = t == ignore_index, (t >= 0) & (t < v)
    keep = ~ignored
    g_lp = np.where(keep, grad_logps.astype(acc), acc.type(0))
    g_h = np.where(keep, grad_entropy.astype(acc), acc.type(0))
    ent, lse = entropy.astype(acc), lse.astype(acc, copy=False)

    def dlogits(x, rows, c0, c1):
        return _da(x, weight, bias, c0, c1, 1.0 / temperature, softcap, t[rows], lse[rows], ent[rows], g_lp[rows],
                   g_h[rows], ignored[rows], valid[rows])

    return head_gradients(hidden, weight, bias, t, dlogits)


def _da(x, weight, bias, c0, c1, inv_t, softcap, t, lse, ent, g_lp, g_h, ignored, valid) -> np.ndarray:
    """The gradient w.r.t. the raw logits of one tile (rows x [c0, c1)), before the tile's GEMMs."""
    z, dz_da = _tile(x, weight, bias, c0, c1, inv_t, softcap)
    z -= lse[:, None]  # log p
    p = np.exp(z)
    d = -p * (g_lp[:, None] + g_h[:, None] * (z + ent[:, None]))
    hit = np.flatnonzero(valid & ~ignored & (t >= c0) & (t < c1))
    if hit.size:
        col = t[hit] - c0
        zl = z[hit, col]
        one_minus_p = np.where(zl > zl.dtype.type(-0.6931471805599453), -np.expm1(zl), 1 - p[hit, col])
        d[hit, col] = g_lp[hit] * one_minus_p - g_h[hit] * p[hit, col] * (zl + ent[hit])
    if ignored.any():
        d[ignored] = 0
    bad = ~valid & ~ignored
    if bad.any():
        d[bad] = np.nan
    d *= dz_da
    return d
