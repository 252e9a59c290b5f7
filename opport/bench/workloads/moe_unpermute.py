"""moe_unpermute: each token's k expert rows weighted and summed (the combine step of an MoE layer) beside torch's
composition: the inverse permutation, a row gather, a broadcast multiply and a sum over k."""

from __future__ import annotations

from opport.bench.workloads import Shape, Workload
from opport.bench.workloads._moe import MIXTRAL_8X7B, QWEN3_30B_A3B, picks, sorted_slots, weights

SHAPES = [
    Shape("smoke", "T64 N64 E8 k2", dict(tokens=64, hidden=64, experts=8, k=2), ("smoke",)),
    Shape("qwen3-30b-a3b", "T4096 N2048 E128 k8", {**QWEN3_30B_A3B}, ("small", "llm")),
    Shape("mixtral-8x7b", "T4096 N4096 E8 k2", {**MIXTRAL_8X7B}, ("llm",)),
]


def make(d, dtype, mk):
    import numpy as np

    t, k = d["tokens"], d["k"]
    index = picks(mk, t, d["experts"], k)
    if mk.kind == "numpy":
        source = np.argsort(index.reshape(-1), kind="stable").astype(np.int32)
    else:
        import torch

        source = sorted_slots(index, d["experts"])[0].to(torch.int32)
    return dict(y=mk.normal((t * k, d["hidden"]), dtype), source=source, weights=weights(mk, t, k, dtype))


def torch_unpermute(y, source, weights):
    import torch

    t, k = weights.shape
    inverse = torch.empty_like(source)
    inverse[source.long()] = torch.arange(source.numel(), device=source.device, dtype=source.dtype)
    rows = y[inverse.long()].view(t, k, -1)
    acc = torch.float64 if y.dtype == torch.float64 else torch.float32
    return (rows.to(acc) * weights.to(acc)[..., None]).sum(dim=1).to(y.dtype)


WORKLOAD = Workload(
    "moe_unpermute", SHAPES, make,
    torch_eager=torch_unpermute,
    torch_call="inverse[source] = arange; (y[inverse].view(T, k, N).float() * weights[..., None]).sum(1)",
)
