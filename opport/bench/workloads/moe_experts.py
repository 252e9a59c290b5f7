"""moe_experts: the expert MLPs of a mixture-of-experts layer (Qwen3-30B-A3B, Mixtral 8x7B) beside transformers'
own two implementations, timed in the same run: its eager loop over experts (`torch_eager`, its code in plain
torch) and its grouped_mm path (`transformers_grouped_mm`: tokens sorted by expert, torch.nn.functional.grouped_mm
where torch has it, else transformers' fallback, on the module transformers builds with the same weights; an
error row where transformers is not installed)."""

from __future__ import annotations

from opport.bench.workloads import Shape, Workload
from opport.bench.workloads._moe import MIXTRAL_8X7B, QWEN3_30B_A3B, picks, weights

SHAPES = [
    Shape("smoke", "T64 H64 I32 E8 k2", dict(tokens=64, hidden=64, inter=32, experts=8, k=2), ("smoke",)),
    # the CPU rows keep E and k of each model at a quarter of its widths (float32 weights of the full layers:
    # 2.4 GB and 5.6 GB)
    Shape("qwen3-30b-a3b-quarter", "T512 H512 I192 E128 k8", dict(tokens=512, hidden=512, inter=192, experts=128, k=8),
          ("small",)),
    Shape("mixtral-8x7b-quarter", "T512 H1024 I3584 E8 k2", dict(tokens=512, hidden=1024, inter=3584, experts=8, k=2),
          ("small",)),
    Shape("qwen3-30b-a3b", "T4096 H2048 I768 E128 k8", QWEN3_30B_A3B, ("llm",)),
    Shape("mixtral-8x7b", "T4096 H4096 I14336 E8 k2", MIXTRAL_8X7B, ("llm",)),
]


def make(d, dtype, mk):
    t, h, i, e, k = d["tokens"], d["hidden"], d["inter"], d["experts"], d["k"]
    return dict(x=mk.normal((t, h), dtype), gate_up_proj=mk.normal((e, 2 * i, h), dtype, h ** -0.5),
                down_proj=mk.normal((e, h, i), dtype, i ** -0.5), top_k_index=picks(mk, t, e, k),
                top_k_weights=weights(mk, t, k, dtype))


_MODULES: dict = {}  # (implementation, id of the weights) -> transformers' experts module holding them


def _experts(gate_up_proj, down_proj, implementation: str):
    """transformers' Qwen3MoeExperts with these weights (shared, not copied) and this experts implementation."""
    key = (implementation, id(gate_up_proj), id(down_proj))
    if key not in _MODULES:
        import torch
        import transformers

        e, two_i, h = gate_up_proj.shape
        config = transformers.Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=two_i // 2, num_experts=e,
                                             experts_implementation=implementation)
        with torch.device("meta"):
            module = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(config)
        del module.gate_up_proj, module.down_proj  # plain attributes: the caller's tensors, so gradients reach them
        module.gate_up_proj, module.down_proj = gate_up_proj, down_proj
        _MODULES.clear()  # one problem's modules at a time: the weights are large
        _MODULES[key] = module
    return _MODULES[key]


def transformers_loop(x, gate_up_proj, down_proj, top_k_index, top_k_weights):
    """transformers 5's Qwen3MoeExperts.forward (experts_implementation='eager'), line for line, in plain torch (the
    H200 has no transformers): a loop over the experts hit, each a gather, two GEMMs and an index_add_."""
    import torch
    import torch.nn.functional as F

    num_experts = gate_up_proj.shape[0]
    final = torch.zeros_like(x)
    with torch.no_grad():
        expert_mask = F.one_hot(top_k_index, num_classes=num_experts + 1).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        gate, up = F.linear(x[token_idx], gate_up_proj[expert_idx]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, down_proj[expert_idx]) * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, h.to(final.dtype))
    return final


def transformers_grouped_mm(x, gate_up_proj, down_proj, top_k_index, top_k_weights):
    return _experts(gate_up_proj, down_proj, "grouped_mm")(x, top_k_index, top_k_weights)


WORKLOAD = Workload(
    "moe_experts", SHAPES, make,
    torch_eager=transformers_loop,
    torch_call="transformers Qwen3MoeExperts (experts_implementation='eager': a loop over the hit experts)",
    torch_others=(("transformers_grouped_mm", "transformers Qwen3MoeExperts (experts_implementation='grouped_mm')",
                   transformers_grouped_mm),),
)
