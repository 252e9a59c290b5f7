"""moe_permute: tokens grouped by expert (the dispatch step of an MoE layer) beside the torch code transformers'
grouped_mm experts path runs: a stable sort of the flat expert ids, a row gather, a histogram's prefix sums."""

from __future__ import annotations

from opport.bench.workloads import Shape, Workload
from opport.bench.workloads._moe import MIXTRAL_8X7B, QWEN3_30B_A3B, picks, sorted_slots

SHAPES = [
    Shape("smoke", "T64 H64 E8 k2", dict(tokens=64, hidden=64, experts=8, k=2), ("smoke",)),
    Shape("qwen3-30b-a3b", "T4096 H2048 E128 k8", {**QWEN3_30B_A3B}, ("small", "llm")),
    Shape("mixtral-8x7b", "T4096 H4096 E8 k2", {**MIXTRAL_8X7B}, ("llm",)),
]


def make(d, dtype, mk):
    t, e = d["tokens"], d["experts"]
    return dict(x=mk.normal((t, d["hidden"]), dtype), top_k_index=picks(mk, t, e, d["k"]), num_experts=e)


def torch_permute(x, top_k_index, num_experts):
    import torch

    order, offsets = sorted_slots(top_k_index, num_experts)
    return x[order // top_k_index.shape[1]], order.to(torch.int32), offsets


WORKLOAD = Workload(
    "moe_permute", SHAPES, make,
    torch_eager=torch_permute,
    torch_call="torch.sort(top_k_index.reshape(-1), stable=True); x[order // k]; torch.bincount(...).cumsum(0)",
)
