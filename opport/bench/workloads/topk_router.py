"""topk_router: softmax top-k routing (Qwen3-MoE, Mixtral) beside the router transformers runs: a float32 softmax,
torch.topk, the renormalisation, a cast back to the logits' dtype."""

from __future__ import annotations

from opport.bench.workloads import Shape, Workload
from opport.bench.workloads._moe import MIXTRAL_8X7B, QWEN3_30B_A3B

SHAPES = [
    Shape("smoke", "T64 E8 k2", dict(tokens=64, experts=8, k=2), ("smoke",)),
    Shape("qwen3-30b-a3b", "T4096 E128 k8", {**QWEN3_30B_A3B}, ("small", "llm")),
    Shape("mixtral-8x7b", "T4096 E8 k2", {**MIXTRAL_8X7B}, ("small", "llm")),
    Shape("deepseek-v3-width", "T4096 E256 k8", dict(tokens=4096, experts=256, k=8), ("llm",)),
]


def make(d, dtype, mk):
    return dict(logits=mk.normal((d["tokens"], d["experts"]), dtype), k=d["k"], renormalize=True)


def transformers_router(logits, k, renormalize, scoring, bias):
    """Qwen3MoeTopKRouter.forward after its linear layer (softmax scoring, no bias)."""
    import torch

    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    top, index = torch.topk(probs, k, dim=-1)
    if renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), index.to(torch.int32)


def stable_reference(logits, k, renormalize, scoring, bias):
    """The contract's order in float64 torch: descending logits, ties to the lowest index (a stable sort), NaN first
    (softmax is increasing: the logits rank as the probabilities do, exactly)."""
    import torch

    probs = torch.softmax(logits.double(), dim=-1)
    index = torch.sort(logits.double(), dim=-1, descending=True, stable=True).indices[:, :k]
    top = probs.gather(-1, index)
    if renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top, index.to(torch.int32)


WORKLOAD = Workload(
    "topk_router", SHAPES, make,
    torch_eager=transformers_router,
    torch_call="torch.softmax(logits, dtype=torch.float) -> torch.topk -> / sum -> .to(logits.dtype) "
               "(transformers' Qwen3MoeTopKRouter)",
    torch_reference=stable_reference,
)
