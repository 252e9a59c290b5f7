"""varlen_attention: packed batches of mixed lengths (Llama-3 8B heads; Gemma-2 with soft cap and window), forward and
(as every differentiable op) fwd+bwd training rows.

Baselines: on CUDA, torch's FlashAttention varlen (`torch.nn.attention.varlen.varlen_attn`, FlashAttention-2's
flash_attn_varlen_func on the same packing) where it takes the call (16-bit, no soft cap); elsewhere what a user
without a varlen kernel writes, SDPA once per sequence. Dense attention over the padded batch is `attention`'s
`padded-*` rows (B = sequences, S = the longest, named beside these); uniform-* rows have the same tokens and pairs
as an `attention` row."""

import numpy as np

from opport.arraymath import cu
from opport.bench.workloads import Shape, Workload, acc


def _s(name, lengths, hq, hkv, d, tiers, softcap=None, window=None):
    n, total = len(lengths), sum(lengths)
    kind = f"{n}x{lengths[0]}" if len(set(lengths)) == 1 else f"{n} mixed"
    label = f"{kind} seqs {total} tok H{hq}/{hkv} D{d} causal" + (f" cap{softcap:g}" if softcap else "")
    label += f" W{window}" if window else ""
    dims = dict(lengths=tuple(lengths), hq=hq, hkv=hkv, d=d, softcap=softcap, window=window)
    return Shape(name, label, dims, tiers)


_MIXED_16K = (4096, 512, 2048, 1000, 3000, 24, 5120, 600)  # 16,400 tokens of serving prefill
SHAPES = [
    _s("smoke", (16, 5, 30), 2, 1, 32, ("smoke",)),
    _s("mixed-1k", (300, 17, 512, 195), 8, 2, 64, ("small",)),
    _s("uniform-4x256", (256,) * 4, 8, 2, 64, ("small",)),  # = attention gqa-256-hd64-causal x 4 sequences
    _s("llama8b-uniform-4x4k", (4096,) * 4, 32, 8, 128, ("llm",)),  # = attention llama8b-4k-causal
    _s("llama8b-mixed-16k", _MIXED_16K, 32, 8, 128, ("llm",)),
    _s("gemma2-uniform-2x8k-local", (8192,) * 2, 16, 8, 256, ("llm",), 50.0, 4096),  # = attention gemma2-8k-local
    _s("gemma2-mixed-16k-local", _MIXED_16K, 16, 8, 256, ("llm",), 50.0, 4096),
]


def make(d, dtype, mk):
    lengths, total = d["lengths"], sum(d["lengths"])
    c = cu(lengths)
    if mk.kind != "numpy":
        import torch

        c = torch.from_numpy(c).to(mk.device)
    return dict(q=mk.normal((total, d["hq"], d["d"]), dtype), k=mk.normal((total, d["hkv"], d["d"]), dtype),
                v=mk.normal((total, d["hkv"], d["d"]), dtype), cu_seqlens_q=c, cu_seqlens_k=c, causal=True,
                scale=None, softcap=d["softcap"], sliding_window=d["window"])


def torch_eager(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, softcap=None, sliding_window=None):
    """FlashAttention varlen where torch has it for these inputs, else the attention baseline once per sequence."""
    if _flash_varlen_takes(q, softcap):
        return _flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, sliding_window)
    return _per_sequence(_dense_eager, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, softcap, sliding_window)


def _dense_eager(*args):
    from opport.bench.workloads.attention import torch_eager as dense

    return dense(*args)


def _flash_varlen_takes(q, softcap) -> bool:
    """torch.nn.attention.varlen.varlen_attn (torch >= 2.10, CUDA): FlashAttention's kernels, 16-bit, no soft cap."""
    import torch

    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return q.is_cuda and softcap is None and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256


def _flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, sliding_window):
    """flash_attn_varlen_func's semantics: causal bottom-right per sequence, window (W - 1, 0) keys to the left."""
    from torch.nn.attention.varlen import varlen_attn

    left = -1 if sliding_window is None else sliding_window - 1
    max_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if cu_seqlens_q.numel() > 1 else 0
    max_k = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max()) if cu_seqlens_k.numel() > 1 else 0
    return varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale=scale,
                       window_size=(left, 0 if causal else -1), enable_gqa=q.shape[1] != k.shape[1])


def _per_sequence(dense, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, softcap, sliding_window):
    """`dense` ([1, H, S, D] attention) on each sequence, packed back ([T, H, Dv]); differentiable (autograd)."""
    import torch

    bounds = list(zip(cu_seqlens_q.tolist(), cu_seqlens_q.tolist()[1:], cu_seqlens_k.tolist(), cu_seqlens_k.tolist()[1:]))
    outs = [dense(q[None, q0:q1].transpose(1, 2), k[None, k0:k1].transpose(1, 2), v[None, k0:k1].transpose(1, 2),
                  causal, scale, softcap, sliding_window)[0].transpose(0, 1) for q0, q1, k0, k1 in bounds]
    return torch.cat(outs) if outs else q.new_zeros(q.shape[:2] + v.shape[2:])


def torch_detail(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, softcap=None, sliding_window=None) -> str:
    """Which baseline ran (docs/performance.md 5.9): FlashAttention varlen and torch's flash implementation, or per
    sequence SDPA and the backend it picks for the first sequence."""
    if _flash_varlen_takes(q, softcap):
        from torch.nn.attention import current_flash_attention_impl

        return f"torch.nn.attention.varlen.varlen_attn, flash implementation {current_flash_attention_impl() or 'FA2'}"
    from opport.bench.workloads.attention import torch_detail as dense

    q1, k1 = int(cu_seqlens_q[1]) if len(cu_seqlens_q) > 1 else 0, int(cu_seqlens_k[1]) if len(cu_seqlens_k) > 1 else 0
    first = dense(q[None, :q1].transpose(1, 2), k[None, :k1].transpose(1, 2), v[None, :k1].transpose(1, 2), causal,
                  scale, softcap, sliding_window)
    return f"per sequence: {first}"


def torch_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, softcap=None, sliding_window=None):
    """float64 per sequence through attention's reference (one KV group at a time: its scores fit in memory)."""
    from opport.bench.workloads.attention import torch_reference as dense

    return _per_sequence(dense, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, softcap, sliding_window)


def torch_vjp_reference(grad, out, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, softcap=None,
                        sliding_window=None):
    """float64 dq, dk, dv from the saved output, per sequence through attention's `torch_vjp_reference`."""
    import torch

    from opport.bench.workloads.attention import torch_vjp_reference as dense

    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    heads = lambda x: x.transpose(0, 1)[None]  # noqa: E731
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for q0, q1, k0, k1 in zip(cq, cq[1:], ck, ck[1:]):
        if q1 > q0 and k1 > k0:
            grads = dense(heads(grad[q0:q1]), heads(out[q0:q1]), heads(q[q0:q1]), heads(k[k0:k1]), heads(v[k0:k1]),
                          causal, scale, softcap, sliding_window)
            for into, a, b, g in zip((dq, dk, dv), (q0, k0, k0), (q1, k1, k1), grads):
                into[a:b] = g[0].transpose(0, 1)
    return dq, dk, dv


def numpy_composition(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, softcap=None, sliding_window=None):
    from opport.bench.workloads.attention import numpy_composition as dense

    out = np.empty(q.shape[:2] + v.shape[2:], q.dtype)
    for b in range(len(cu_seqlens_q) - 1):
        qs, ks = slice(cu_seqlens_q[b], cu_seqlens_q[b + 1]), slice(cu_seqlens_k[b], cu_seqlens_k[b + 1])
        if qs.stop > qs.start:
            o = dense(acc(q[qs]).transpose(1, 0, 2)[None], k[ks].transpose(1, 0, 2)[None],
                      v[ks].transpose(1, 0, 2)[None], causal, scale, softcap, sliding_window)
            out[qs] = o[0].transpose(1, 0, 2)
    return out


WORKLOAD = Workload(
    "varlen_attention", SHAPES, make,
    torch_eager=torch_eager,
    torch_call="CUDA, 16-bit, no soft cap: torch.nn.attention.varlen.varlen_attn (FlashAttention varlen); else per "
               "sequence: torch.nn.functional.scaled_dot_product_attention (attention's baseline)",
    torch_reference=torch_reference, torch_detail=torch_detail, torch_vjp_reference=torch_vjp_reference,
    numpy=numpy_composition, numpy_call="per sequence: attention's NumPy composition",
    notes={"dense": "uniform-* rows have the same tokens and pairs as an `attention` row; mixed-* rows' padded batch is "
                    "attention's padded-* row (named beside them)"},
)
