"""moe_permute: the dispatch of Mixtral (8 experts, top 2, H 4096) and Qwen3-MoE (128 experts, top 8, H 2048), decode
and 4K-token prefill. The roofline is every routed row read and written once; the baseline is the torch a
transformers-style grouped MoE writes: a stable argsort of the flat expert ids, an index_select of the rows, a
bincount and cumsum for the group offsets."""

import numpy as np

from opport.bench.workloads import Shape, Workload

MODELS = {"mixtral": (8, 2, 4096), "qwen3-moe": (128, 8, 2048)}


def _s(model, t, tiers):
    e, k, h = MODELS[model]
    return Shape(f"{model}-{t}", f"T{t} H{h} E{e} k{k}", dict(t=t, e=e, k=k, h=h), tiers)


SHAPES = [
    Shape("smoke", "T32 H64 E8 k2", dict(t=32, e=8, k=2, h=64), ("smoke",)),
    _s("mixtral", 64, ("small", "llm")),
    _s("qwen3-moe", 64, ("small", "llm")),
    _s("mixtral", 4096, ("llm",)),
    _s("qwen3-moe", 4096, ("llm",)),
]


def routing(t: int, e: int, k: int, device=None):
    """k distinct random experts per token (int32), seeded by the shape; on the device for torch."""
    idx = np.argsort(np.random.default_rng(t * 1000 + e).random((t, e)), axis=1)[:, :k].astype(np.int32)
    if device is None:
        return idx
    import torch

    return torch.from_numpy(idx).to(device)


def make(d, dtype, mk):
    idx = routing(d["t"], d["e"], d["k"], None if mk.kind == "numpy" else mk.device)
    return dict(x=mk.normal((d["t"], d["h"]), dtype), top_k_index=idx, num_experts=d["e"])


def torch_eager(x, top_k_index, num_experts):
    import torch

    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=x.device)
    torch.cumsum(torch.bincount(flat, minlength=num_experts), 0, out=offsets[1:])
    return x.index_select(0, order // top_k_index.shape[1]), order.to(torch.int32), offsets.to(torch.int32)


def numpy_composition(x, top_k_index, num_experts):
    flat = top_k_index.reshape(-1)
    order = np.argsort(flat, kind="stable")
    offsets = np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=num_experts))]).astype(np.int32)
    return x[order // top_k_index.shape[1]], order.astype(np.int32), offsets


WORKLOAD = Workload(
    "moe_permute", SHAPES, make, torch_eager=torch_eager,
    torch_call="argsort(top_k_index.flatten(), stable=True); x.index_select(0, order // k); cumsum(bincount)",
    numpy=numpy_composition, numpy_call="np.argsort(flat, kind='stable'); x[order // k]; cumsum(bincount)",
)
