"""cross_entropy in Triton: one pass over each row's vocabulary with an online logsumexp.

Memory: per row only running scalars (max, sum of exponentials, sum of logits) and the target
logit; the kernel writes one float32 loss per row, so the extra memory is O(N), never N x V.
The "sum"/"mean" reductions of those N losses run in torch (a deterministic O(N) epilogue).
The training forward also stores each row's logsumexp (4 bytes a row); the backward reads the logits
once more and writes dlogits from it, p = exp(x - lse), without any reduction over the vocabulary.
`cross_entropy_value_and_grad` (what autograd runs when it can) writes dlogits for a unit upstream gradient
from the forward's own program, re-reading each row from L2: one read of the logits in all.
"""

import torch

from opport.backends.cuda._launch import (
    Layout,
    cdiv,
    elementwise_config,
    exp_f32,
    f32,
    log_f32,
    narrow,
    row_config,
    tl,
    triton,
)
from opport.dispatch import impl
from opport.ops.cross_entropy import cross_entropy as spec


@triton.jit
def _cross_entropy_kernel(
    # pointers
    logits_ptr, target_ptr, loss_ptr, lse_ptr,
    # shapes, strides
    n_rows, n_cols, l_s0, l_s1, t_s,
    ignore_index, smoothing,
    # meta-parameters
    SMOOTH: tl.constexpr, STORE_LSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """loss[r] = (m - x[t]) + log(sum(exp(x - m))), smoothed: (1-e)*that + e*((m - mean(x)) + log(sum)).

    Dimensions: logits [n_rows, n_cols] strided, target [n_rows] any integer dtype, loss [n_rows] float32.
    Notes: masked columns load -inf (max-neutral, exp gives 0) and 0 for the logit sum. The running
    sum is rescaled by exp(m_old - m_new) when the max grows; a running max of -inf is replaced by 0
    in the exponentials so an all -inf prefix adds 0, not NaN. The loss is formed as (m - x[t]) + log(sum)
    rather than logsumexp - x[t], which would round logsumexp to the ulp of |m| first (0.004 at 4e4).
    An all -inf row gives m - x[t] = NaN, as the reference. Ignored rows are 0; other targets outside
    [0, V) are NaN. STORE_LSE (the training forward) also writes lse[r] = m + log(sum): -inf for an all
    -inf row, NaN for a row holding NaN or +inf, whatever the target. One read of the logits. exp is the
    fast hardware path (its ~2e-6 relative error moves log(sum) by ~2e-6, far inside the loss tolerance);
    the one log per row is libdevice's.
    Pseudocode: for chunk in row: m, s = online(max, sum exp); loss = (m - x[t]) + log(s)
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    loss, m, log_total, _x_t = _row_loss(logits_ptr, target_ptr, rows, row_ok, n_cols, l_s0, l_s1, t_s, ignore_index,
                                         smoothing, SMOOTH, BLOCK_M, BLOCK_N)
    tl.store(loss_ptr + rows, loss, mask=row_ok)
    if STORE_LSE:
        tl.store(lse_ptr + rows, m + log_total, mask=row_ok)


@triton.jit
def _row_loss(logits_ptr, target_ptr, rows, row_ok, n_cols, l_s0, l_s1, t_s, ignore_index, smoothing,
              SMOOTH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(loss, m, log(s), x_t) of a block of rows: the online logsumexp m + log(s) over BLOCK_N-column chunks (see
    `_cross_entropy_kernel`), m the row max; x_t is the target logit (0 where ignored or out of range)."""
    base = logits_ptr + rows.to(tl.int64)[:, None] * l_s0
    cols = tl.arange(0, BLOCK_N)[None, :]
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_M,), tl.float32)
    xsum = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        mask = row_ok[:, None] & (c < n_cols)
        x = f32(tl.load(base + c.to(tl.int64) * l_s1, mask=mask, other=float("-inf")))
        m_new = tl.maximum(m, tl.max(x, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        total = total * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), 1)
        m = m_new
        if SMOOTH:
            xsum += tl.where(mask, x, 0.0)
    t = tl.load(target_ptr + rows.to(tl.int64) * t_s, mask=row_ok, other=0).to(tl.int64)
    ignored = t == ignore_index
    valid = (t >= 0) & (t < n_cols)
    x_t = f32(tl.load(logits_ptr + rows.to(tl.int64) * l_s0 + t * l_s1, mask=row_ok & valid & ~ignored, other=0.0))
    log_total = log_f32(total)
    loss = (m - x_t) + log_total
    if SMOOTH:
        loss = (1.0 - smoothing) * loss + smoothing * ((m - tl.sum(xsum, 1) / n_cols) + log_total)
    loss = tl.where(ignored, 0.0, tl.where(valid, loss, float("nan")))
    return loss, m, log_total, x_t


@triton.jit
def _cross_entropy_value_and_grad_kernel(
    # pointers
    logits_ptr, target_ptr, kept_ptr, loss_ptr, out_ptr,
    # shapes, strides
    n_rows, n_cols, l_s0, l_s1, t_s, o_s0, o_s1,
    ignore_index, smoothing,
    # meta-parameters
    SMOOTH: tl.constexpr, MEAN: tl.constexpr, PRECISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """loss[r] as `_cross_entropy_kernel`, and dlogits[r, :] for a unit upstream gradient, by one program per rows.

    Dimensions: logits [n_rows, n_cols] strided, target [n_rows], loss [n_rows] float32, out [n_rows, n_cols];
    kept: the count of non-ignored rows (device int64, "mean" only: no host sync).
    Notes: pass 1 is the forward's online logsumexp over BLOCK_N-column chunks (its loss, bit for bit); pass 2
    walks the same row's chunks again and writes coef (exp(x - lse) - eps/V - (1 - eps) [c == t]) exactly as
    `_cross_entropy_backward_kernel` does at grad = 1 (coef = 1, or 1 / max(kept, 1) for "mean"; 0 for ignored
    rows, NaN for targets outside [0, V)). x - lse is formed as (x - m) - log(s): x - m is exact where p matters,
    so p keeps float32's relative accuracy where an lse rounded to float32 (what the lse path saves) carries
    an ulp of |m| (0.002 at 3e4).
    Memory traffic: a row (a few hundred KB of bf16 at V = 128256) is read back while it is still in L2, so
    HBM sees about one read of the logits and one write of dlogits, against two reads and one write for
    `cross_entropy_forward` + `cross_entropy_backward`.
    Pseudocode: m, s = online(max, sum exp) over chunks; lse = m + log(s); for chunk: out = coef (exp(x - lse) ...)
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    loss, m, log_total, x_t = _row_loss(logits_ptr, target_ptr, rows, row_ok, n_cols, l_s0, l_s1, t_s, ignore_index,
                                        smoothing, SMOOTH, BLOCK_M, BLOCK_N)
    tl.store(loss_ptr + rows, loss, mask=row_ok)
    t = tl.load(target_ptr + rows.to(tl.int64) * t_s, mask=row_ok, other=0).to(tl.int64)
    ignored = t == ignore_index
    valid = (t >= 0) & (t < n_cols)
    coef = tl.full((BLOCK_M,), 1.0, tl.float32)
    if MEAN:
        coef = coef / tl.maximum(tl.load(kept_ptr), 1).to(tl.float32)
    coef = tl.where(ignored, 0.0, tl.where(valid, coef, float("nan")))
    y_t = _target_term((x_t - m) - log_total, smoothing, n_cols, PRECISE)
    base = logits_ptr + rows.to(tl.int64)[:, None] * l_s0
    obase = out_ptr + rows.to(tl.int64)[:, None] * o_s0
    for start in range(0, n_cols, BLOCK_N):
        c = start + tl.arange(0, BLOCK_N)[None, :]
        mask = row_ok[:, None] & (c < n_cols)
        x = f32(tl.load(base + c.to(tl.int64) * l_s1, mask=mask, other=0.0))
        y = exp_f32((x - m[:, None]) - log_total[:, None], PRECISE) - smoothing / n_cols
        y = tl.where(c == t[:, None], y_t[:, None], y)
        y = tl.where(ignored[:, None], 0.0, coef[:, None] * y)  # ignored: exactly 0 even where x is NaN
        tl.store(obase + c.to(tl.int64) * o_s1, narrow(y, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _cross_entropy_backward_kernel(
    # pointers
    grad_ptr, logits_ptr, target_ptr, lse_ptr, kept_ptr, out_ptr,
    # shapes, strides
    n_rows, n_cols, g_s, l_s0, l_s1, t_s, lse_s, o_s0, o_s1,
    ignore_index, smoothing,
    # meta-parameters
    MEAN: tl.constexpr, PRECISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dlogits[r, c] = coef[r] * (exp(x - lse[r]) - eps/V - (1 - eps) [c == t[r]]) for one [BLOCK_M, BLOCK_N] tile.

    Dimensions: grad [N] (g_s its stride) or 0-d (g_s = 0); logits, out [N, V] strided; target, lse [N] strided
    (a saved lse may be a view too); kept: the count of non-ignored rows (device int64, "mean" only: no host sync).
    Notes: coef is the row's share of grad (grad[r]; grad; grad / max(kept, 1)), 0 for ignored rows (whose
    logits may hold NaN), NaN for targets outside [0, V). x - lse is exact wherever p is not negligible
    (Sterbenz), so p carries only exp's error: libdevice's expf for float32 outputs (PRECISE; the fast exp's
    15 ULP exceed float32's 1.3e-6), the fast exp under a 16-bit output. The target column is formed once
    per row (`_target_term`). One read of the logits, one write of dlogits; nothing reduced over V.
    Pseudocode: y = exp(x - lse) - eps/V; y[t] = target term; out = coef * y
    """
    pid = tl.program_id(0).to(tl.int64)
    tiles_n = tl.cdiv(n_cols, BLOCK_N)
    rows = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < n_cols)[None, :]
    t = tl.load(target_ptr + rows * t_s, mask=row_ok, other=0).to(tl.int64)
    lse = tl.load(lse_ptr + rows * lse_s, mask=row_ok, other=0.0)
    ignored = t == ignore_index
    valid = (t >= 0) & (t < n_cols)
    coef = tl.load(grad_ptr + rows * g_s, mask=row_ok, other=0.0)
    if MEAN:
        coef = coef / tl.maximum(tl.load(kept_ptr), 1).to(tl.float32)
    coef = tl.where(ignored, 0.0, tl.where(valid, coef, float("nan")))
    x_t = f32(tl.load(logits_ptr + rows * l_s0 + t * l_s1, mask=row_ok & valid & ~ignored, other=0.0))
    y_t = _target_term(x_t - lse, smoothing, n_cols, PRECISE)
    x = f32(tl.load(logits_ptr + rows[:, None] * l_s0 + cols[None, :].to(tl.int64) * l_s1, mask=mask, other=0.0))
    y = exp_f32(x - lse[:, None], PRECISE) - smoothing / n_cols
    y = tl.where(cols[None, :] == t[:, None], y_t[:, None], y)
    y = tl.where(ignored[:, None], 0.0, coef[:, None] * y)  # ignored: exactly 0 even where x is NaN
    tl.store(out_ptr + rows[:, None] * o_s0 + cols[None, :].to(tl.int64) * o_s1, narrow(y, out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _target_term(d, smoothing, n_cols, PRECISE: tl.constexpr):
    """p_t - eps/V - (1 - eps) from d = x_t - lse. Where p_t is in (1/2, 2) it is formed as expm1(d) + (eps - eps/V):
    1 - p_t then keeps its own relative precision (peaked rows: p_t - 1 ~ -1e-4 would carry exp's error of an
    ulp of 1, 1e-3 relative), as the cpu kernel does. p_t > 1 comes only from a rounded lse (d ~ 0) or an lse that
    is not the row's (a backward handed an inconsistent one: d may be +inf near the dtype's maximum, where
    Kahan's formula would give inf * 0): beyond 2 the plain formula, inf as the reference."""
    e = exp_f32(d, PRECISE)
    near_one = (d > -0.6931471805599453) & (d < 0.6931471805599453)
    return tl.where(near_one, _expm1(e, d) + (smoothing - smoothing / n_cols), (e - smoothing / n_cols) - (1.0 - smoothing))


@triton.jit
def _expm1(u, d):
    """exp(d) - 1 for d in (-ln 2, 0], from u = exp(d) (Kahan's formula (u - 1) d / log(u)).

    u - 1 is exact there (u in [1/2, 1]); log(u) (~1 ULP) recovers the argument u actually rounds, so the
    ratio's errors cancel and the result keeps a few ULP of relative accuracy even where u - 1 is tiny
    (libdevice's expm1 is not available to the interpreter). u == 1: expm1(d) = d to float32 precision.
    """
    um1 = u - 1.0
    return tl.where(um1 == 0.0, d, um1 * (d / log_f32(tl.where(um1 == 0.0, 0.5, u))))


@impl(spec, "cuda")
def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
                  label_smoothing: float) -> torch.Tensor:
    return _forward(logits, target, ignore_index, reduction, label_smoothing, None)


@impl(spec.train_forward, "cuda")
def cross_entropy_forward(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
                          label_smoothing: float):
    """The forward plus each row's logsumexp [N] (float32), written by the same single pass."""
    lse = torch.empty((logits.shape[0],), dtype=torch.float32, device=logits.device)
    return _forward(logits, target, ignore_index, reduction, label_smoothing, lse), lse


def _forward(logits, target, ignore_index: int, reduction: str, label_smoothing: float, lse):
    n, v = logits.shape
    loss = torch.empty((n,), dtype=torch.float32, device=logits.device)
    if n:
        cfg = row_config(n, v)
        _cross_entropy_kernel[(cdiv(n, cfg.block_m),)](
            logits, target, loss, loss if lse is None else lse, n, v, *logits.stride(), target.stride(0),
            int(ignore_index), float(label_smoothing), SMOOTH=label_smoothing != 0, STORE_LSE=lse is not None,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
        )
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return total
    return total / (target != ignore_index).sum().to(torch.float32)


@impl(spec.value_and_grad_op, "cuda")
def cross_entropy_value_and_grad(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
                                 label_smoothing: float):
    """(loss, dlogits [N, V] in logits' dtype for a unit upstream gradient) from one program per block of rows:
    about one read of the logits and one write of dlogits (see the kernel)."""
    n, v = logits.shape
    loss = torch.empty((n,), dtype=torch.float32, device=logits.device)
    out = torch.empty((n, v), dtype=logits.dtype, device=logits.device)
    kept = (target != ignore_index).sum() if reduction == "mean" else loss  # a device count: no host sync
    if n:
        cfg = row_config(n, v)
        _cross_entropy_value_and_grad_kernel[(cdiv(n, cfg.block_m),)](
            logits, target, kept, loss, out, n, v, *logits.stride(), target.stride(0), *out.stride(),
            int(ignore_index), float(label_smoothing), SMOOTH=label_smoothing != 0, MEAN=reduction == "mean",
            PRECISE=logits.dtype == torch.float32, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
        )
    if reduction == "none":
        return loss, out
    total = loss.sum()
    return (total if reduction == "sum" else total / kept.to(torch.float32)), out


@impl(spec.backward_op, "cuda")
def cross_entropy_backward(grad: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                           ignore_index: int, reduction: str, label_smoothing: float):
    """dlogits [N, V] in logits' dtype from the saved lse: one read of the logits, one write (see the kernel)."""
    n, v = logits.shape
    out = torch.empty((n, v), dtype=logits.dtype, device=logits.device)
    if out.numel() == 0:
        return (out,)
    kept = (target != ignore_index).sum() if reduction == "mean" else grad  # a device count: no host sync
    cfg = elementwise_config(Layout(n, v, (1, 1, n), ((0, 0, v, 1),)))  # out's (contiguous) layout
    _cross_entropy_backward_kernel[(cdiv(n, cfg.block_m) * cdiv(v, cfg.block_n),)](
        grad, logits, target, lse, kept, out, n, v, grad.stride(0) if grad.dim() else 0, *logits.stride(),
        target.stride(0), lse.stride(0), *out.stride(), int(ignore_index), float(label_smoothing),
        MEAN=reduction == "mean", PRECISE=logits.dtype == torch.float32, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps,
    )
    return (out,)
