"""moe_unpermute: the combine of Mixtral (top 2, H 4096) and Qwen3-MoE (top 8, H 2048), decode and 4K-token prefill,
on rows in moe_permute's expert order. The roofline is the routed rows read once and the tokens written once; the
baseline is transformers' torch: the rows put back in token order, times the routing weights, summed over k."""

import numpy as np

from opport.bench.workloads import Shape, Workload
from opport.bench.workloads.moe_permute import MODELS, routing


def _s(model, t, tiers):
    e, k, h = MODELS[model]
    return Shape(f"{model}-{t}", f"T{t} N{h} E{e} k{k}", dict(t=t, e=e, k=k, h=h), tiers)


SHAPES = [
    Shape("smoke", "T32 N64 E8 k2", dict(t=32, e=8, k=2, h=64), ("smoke",)),
    _s("mixtral", 64, ("small", "llm")),
    _s("qwen3-moe", 64, ("small", "llm")),
    _s("mixtral", 4096, ("llm",)),
    _s("qwen3-moe", 4096, ("llm",)),
]


def make(d, dtype, mk):
    t, k = d["t"], d["k"]
    source = np.argsort(routing(t, d["e"], k).reshape(-1), kind="stable").astype(np.int32)
    if mk.kind != "numpy":
        import torch

        source = torch.from_numpy(source).to(mk.device)
    return dict(y=mk.normal((t * k, d["h"]), dtype), source=source, weights=mk.uniform((t, k), dtype, 0.0, 1.0 / k))


def torch_eager(y, source, weights):
    import torch

    row = torch.empty_like(source)
    row[source.long()] = torch.arange(source.numel(), dtype=source.dtype, device=source.device)
    t, k = weights.shape
    return (y[row.long()].view(t, k, -1) * weights.unsqueeze(-1)).sum(dim=1)


def numpy_composition(y, source, weights):
    row = np.empty_like(source)
    row[source] = np.arange(source.size, dtype=source.dtype)
    t, k = weights.shape
    acc = np.float64 if y.dtype == np.float64 else np.float32
    return (y[row].reshape(t, k, -1).astype(acc) * weights.astype(acc)[..., None]).sum(axis=1).astype(y.dtype)


WORKLOAD = Workload(
    "moe_unpermute", SHAPES, make, torch_eager=torch_eager,
    torch_call="(y[inverse(source)].view(T, k, N) * weights[..., None]).sum(1): transformers' combine",
    numpy=numpy_composition, numpy_call="(y[inverse].reshape(T, k, N) * weights[..., None]).sum(1) (float32 math)",
)
