"""cross_entropy in Triton: one pass over each row's vocabulary with an online logsumexp.

Memory: per row only running scalars (max, sum of exponentials, sum of logits) and the target
logit; the kernel writes one float32 loss per row, so the extra memory is O(N), never N x V.
The "sum"/"mean" reductions of those N losses run in torch (a deterministic O(N) epilogue).
"""

import torch

from opport.backends.cuda._launch import cdiv, f32, log_f32, row_config, tl, triton
from opport.dispatch import impl
from opport.ops.cross_entropy import cross_entropy as spec


@triton.jit
def _cross_entropy_kernel(
    # pointers
    logits_ptr, target_ptr, loss_ptr,
    # shapes, strides
    n_rows, n_cols, l_s0, l_s1, t_s,
    ignore_index, smoothing,
    # meta-parameters
    SMOOTH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """loss[r] = (m - x[t]) + log(sum(exp(x - m))), smoothed: (1-e)*that + e*((m - mean(x)) + log(sum)).

    Dimensions: logits [n_rows, n_cols] strided, target [n_rows] any integer dtype, loss [n_rows] float32.
    Notes: masked columns load -inf (max-neutral, exp gives 0) and 0 for the logit sum. The running
    sum is rescaled by exp(m_old - m_new) when the max grows; a running max of -inf is replaced by 0
    in the exponentials so an all -inf prefix adds 0, not NaN. The loss is formed as (m - x[t]) + log(sum)
    rather than logsumexp - x[t], which would round logsumexp to the ulp of |m| first (0.004 at 4e4).
    An all -inf row gives m - x[t] = NaN, as the reference. Ignored rows are 0; other targets outside
    [0, V) are NaN. One read of the logits. exp is the fast hardware path (its ~2e-6 relative error
    moves log(sum) by ~2e-6, far inside the loss tolerance); the one log per row is libdevice's.
    Pseudocode: for chunk in row: m, s = online(max, sum exp); loss = (m - x[t]) + log(s)
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
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
    tl.store(loss_ptr + rows, loss, mask=row_ok)


@impl(spec, "cuda", dtypes=("float32", "float16", "bfloat16"))
def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
                  label_smoothing: float) -> torch.Tensor:
    n, v = logits.shape
    loss = torch.empty((n,), dtype=torch.float32, device=logits.device)
    if n:
        cfg = row_config(n, v)
        _cross_entropy_kernel[(cdiv(n, cfg.block_m),)](
            logits, target, loss, n, v, *logits.stride(), target.stride(0), int(ignore_index), float(label_smoothing),
            SMOOTH=label_smoothing != 0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
        )
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return total
    return total / (target != ignore_index).sum().to(torch.float32)
