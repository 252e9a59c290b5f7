"""attention: Llama-3 GQA (32/8, 64/8 heads), head dim 64/128, S from 1 (decode) to 16K, causal and not; Gemma-2
(16/8 heads, head dim 256, soft cap 50, sliding window 4096 on alternate layers)."""

import numpy as np

from opport.bench.workloads import Shape, Workload, acc


def _s(name, b, hq, hkv, sq, sk, d, causal, tiers, softcap=None, window=None):
    label = f"B{b} H{hq}/{hkv} S{sq}x{sk} D{d}" + (" causal" if causal else "")
    label += (f" cap{softcap:g}" if softcap else "") + (f" W{window}" if window else "")
    dims = dict(b=b, hq=hq, hkv=hkv, sq=sq, sk=sk, d=d, causal=causal, softcap=softcap, window=window)
    return Shape(name, label, dims, tiers)


SHAPES = [
    _s("smoke", 1, 2, 1, 16, 16, 32, True, ("smoke",)),
    _s("gqa-256-hd64-causal", 1, 8, 2, 256, 256, 64, True, ("small",)),
    _s("mha-128", 1, 8, 8, 128, 128, 128, False, ("small",)),
    _s("gqa-decode-512", 4, 8, 2, 1, 512, 128, False, ("small",)),
    _s("mha-4k", 4, 32, 32, 4096, 4096, 128, False, ("llm",)),  # docs/performance.md 2e rows
    _s("mha-4k-causal", 4, 32, 32, 4096, 4096, 128, True, ("llm",)),
    _s("llama8b-4k-causal", 4, 32, 8, 4096, 4096, 128, True, ("llm",)),
    _s("llama8b-16k-causal", 1, 32, 8, 16384, 16384, 128, True, ("llm",)),
    _s("llama70b-1k-causal", 8, 64, 8, 1024, 1024, 128, True, ("llm",)),
    _s("mha-2k-hd64", 8, 32, 32, 2048, 2048, 64, False, ("llm",)),
    _s("llama8b-decode-8k", 32, 32, 8, 1, 8192, 128, False, ("llm",)),
    _s("llama70b-decode-16k", 8, 64, 8, 1, 16384, 128, False, ("llm",)),
    # Gemma-2 9B: soft-capped scores on every layer, a 4096-key window on every other one
    _s("softcap-window-smoke", 1, 2, 1, 48, 48, 32, True, ("smoke",), softcap=50.0, window=16),
    _s("gemma-like-512-window", 1, 8, 4, 512, 512, 128, True, ("small",), softcap=50.0, window=128),
    _s("gemma2-8k-local", 2, 16, 8, 8192, 8192, 256, True, ("llm",), softcap=50.0, window=4096),
    _s("gemma2-8k-global", 2, 16, 8, 8192, 8192, 256, True, ("llm",), softcap=50.0),
    _s("gemma2-8k-dense", 2, 16, 8, 8192, 8192, 256, True, ("llm",)),  # the same shape without either: the cost
    # varlen_attention's mixed-length batches padded to their longest sequence (B = sequences): dense attention over
    # the padded batch, what varlen saves (its mixed-* rows, same names)
    _s("padded-mixed-1k", 4, 8, 2, 512, 512, 64, True, ("small",)),
    _s("padded-llama8b-mixed-16k", 8, 32, 8, 5120, 5120, 128, True, ("llm",)),
    _s("padded-gemma2-mixed-16k-local", 8, 16, 8, 5120, 5120, 256, True, ("llm",), softcap=50.0, window=4096),
]


def make(d, dtype, mk):
    b, sq, sk, dh = d["b"], d["sq"], d["sk"], d["d"]
    return dict(q=mk.normal((b, d["hq"], sq, dh), dtype), k=mk.normal((b, d["hkv"], sk, dh), dtype),
                v=mk.normal((b, d["hkv"], sk, dh), dtype), causal=d["causal"], scale=None,
                softcap=d.get("softcap"), sliding_window=d.get("window"))


def _visible(sq, sk, window, device=None):
    """[Sq, Sk] bool: the bottom-right causal mask, narrowed to the window."""
    import torch

    i, j = torch.arange(sq, device=device)[:, None], torch.arange(sk, device=device)[None, :]
    seen = j <= i + sk - sq
    return seen & (j > i + sk - sq - window) if window else seen


def _composed(q, k, v, causal, scale, softcap, window):
    """Soft cap or window, which SDPA does not take: scores, cap, mask, softmax and P V as torch ops."""
    import torch

    r = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    s = (q.float() @ kr.float().transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        s = s.masked_fill(~_visible(q.shape[-2], k.shape[-2], window, q.device), float("-inf"))
    return (torch.softmax(s, -1).nan_to_num(0.0) @ vr.float()).to(q.dtype)


def _sdpa_args(q, k, causal):
    """(attn_mask, is_causal): SDPA's is_causal is top-left aligned, opport's bottom-right (they agree when Sq == Sk)."""
    sq, sk = q.shape[-2], k.shape[-2]
    if causal and sq != sk:
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(sq, sk), False
    return None, causal


def torch_eager(q, k, v, causal, scale, softcap=None, sliding_window=None):
    import torch.nn.functional as F

    if softcap is not None or sliding_window is not None:
        return _composed(q, k, v, causal, scale, softcap, sliding_window)
    mask, is_causal = _sdpa_args(q, k, causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def torch_detail(q, k, v, causal, scale, softcap=None, sliding_window=None) -> str:
    """The SDPA backend torch picks for these inputs (docs/performance.md 5.9: name the baseline exactly)."""
    import torch
    from torch.nn.attention import SDPBackend

    if softcap is not None or sliding_window is not None:
        return "torch composition (SDPA takes no soft cap): matmul, tanh, mask, softmax, matmul in float32"
    mask, is_causal = _sdpa_args(q, k, causal)
    try:
        c = torch._fused_sdp_choice(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=is_causal, scale=scale,
                                    enable_gqa=q.shape[1] != k.shape[1])
    except Exception as e:  # a private API: say that it could not be read rather than guess
        return f"SDPA backend unknown ({type(e).__name__})"
    names = {int(b.value): n for n, b in SDPBackend.__members__.items()}
    return f"SDPA backend {names.get(int(c), c)}"


def torch_reference(q, k, v, causal, scale, softcap=None, sliding_window=None):
    """float64 SDPA one (batch, kv head) group at a time: the math backend's S x S scores fit in memory."""
    import torch

    out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)
    r = q.shape[1] // k.shape[1]
    for b in range(q.shape[0]):
        for g in range(k.shape[1]):
            heads = slice(g * r, (g + 1) * r)
            out[b:b + 1, heads] = torch_eager(q[b:b + 1, heads], k[b:b + 1, g:g + 1], v[b:b + 1, g:g + 1], causal, scale,
                                              softcap, sliding_window)
    return out


def torch_vjp_reference(grad, out, q, k, v, causal, scale, softcap=None, sliding_window=None):
    """float64 gradients of q, k, v on the saved output O (D = rowsum(dO O)), one (batch, kv head) group at a
    time as torch_reference: dS = P (dO V^T - D), dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO, summed over
    each group's query heads. A row that sees no key has P = 0."""
    import torch

    sq, sk, r = q.shape[-2], k.shape[-2], q.shape[1] // k.shape[1]
    sc = scale if scale is not None else q.shape[-1] ** -0.5
    seen = _visible(sq, sk, sliding_window, q.device)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for b in range(q.shape[0]):
        for g in range(k.shape[1]):
            h = slice(g * r, (g + 1) * r)
            raw = q[b, h] @ k[b, g].T * sc
            s = raw if softcap is None else softcap * torch.tanh(raw / softcap)
            s = s.masked_fill(~seen, -torch.inf) if causal else s
            lse = torch.logsumexp(s, dim=-1, keepdim=True)
            p = torch.where(torch.isfinite(lse), torch.exp(s - lse), 0.0)
            ds = p * (grad[b, h] @ v[b, g].T - (grad[b, h] * out[b, h]).sum(-1, keepdim=True))
            ds = ds if softcap is None else ds * (1 - torch.tanh(raw / softcap) ** 2)
            dq[b, h] = ds @ k[b, g] * sc
            dk[b, g] = (ds.transpose(-1, -2) @ q[b, h]).sum(0) * sc
            dv[b, g] = (p.transpose(-1, -2) @ grad[b, h]).sum(0)
    return dq, dk, dv


def numpy_composition(q, k, v, causal, scale, softcap=None, sliding_window=None):
    qf, r = acc(q), q.shape[1] // k.shape[1]
    kf, vf = np.repeat(acc(k), r, axis=1), np.repeat(acc(v), r, axis=1)
    s = qf @ kf.swapaxes(-1, -2) * qf.dtype.type(scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    if causal:
        sq, sk = q.shape[-2], k.shape[-2]
        lim = np.arange(sq)[:, None] + sk - sq
        seen = np.arange(sk)[None, :] <= lim
        if sliding_window is not None:
            seen &= np.arange(sk)[None, :] > lim - sliding_window
        s = np.where(seen, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True) @ vf).astype(q.dtype)


WORKLOAD = Workload(
    "attention", SHAPES, make,
    torch_eager=torch_eager,
    torch_call="torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal, scale, enable_gqa); with a soft "
               "cap or window: matmul, tanh, mask, softmax, matmul (SDPA takes no soft cap)",
    torch_reference=torch_reference, torch_detail=torch_detail, torch_vjp_reference=torch_vjp_reference,
    numpy=numpy_composition, numpy_call="softmax(q @ k.T * scale + mask) @ v, kv heads repeated (float32 math)",
)
