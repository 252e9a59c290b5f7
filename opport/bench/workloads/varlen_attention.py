"""varlen_attention: packed prefill batches of mixed lengths (Llama-3 8B heads; Gemma-2 with soft cap and window),
each paired with an `attention` row of the same total tokens (equal lengths) to read varlen's cost against dense."""

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
    """What a user without a varlen kernel writes: the attention baseline once per sequence."""
    import torch

    from opport.bench.workloads.attention import torch_eager as dense

    out = torch.empty(q.shape[:2] + v.shape[2:], dtype=q.dtype, device=q.device)
    bounds = list(zip(cu_seqlens_q.tolist(), cu_seqlens_q.tolist()[1:], cu_seqlens_k.tolist(), cu_seqlens_k.tolist()[1:]))
    for q0, q1, k0, k1 in bounds:
        if q1 > q0:
            o = dense(q[None, q0:q1].transpose(1, 2), k[None, k0:k1].transpose(1, 2), v[None, k0:k1].transpose(1, 2),
                      causal, scale, softcap, sliding_window)
            out[q0:q1] = o[0].transpose(0, 1)
    return out


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
    torch_call="per sequence: torch.nn.functional.scaled_dot_product_attention (attention's baseline)",
    numpy=numpy_composition, numpy_call="per sequence: attention's NumPy composition",
    notes={"dense": "uniform-* rows have the same tokens and pairs as an `attention` row (named beside them)"},
)
