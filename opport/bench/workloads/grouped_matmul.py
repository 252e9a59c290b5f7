"""grouped_matmul: per-expert GEMMs over rows grouped by expert (an MoE layer's gate_up projection) beside torch:
one F.linear per expert with rows (the loop transformers' eager experts run) and torch's grouped_mm where this
torch has it for the device and dtype."""

from __future__ import annotations

from opport.bench.workloads import Shape, Workload, seed_for
from opport.bench.workloads._moe import MIXTRAL_8X7B, QWEN3_30B_A3B

SHAPES = [
    Shape("smoke", "M128 K64 N32 E8", dict(tokens=64, k=2, hidden=64, inter=16, experts=8), ("smoke",)),
    # the gate_up projection of a quarter-width Qwen3-30B-A3B layer (M = T*k rows, K = H, N = 2I)
    Shape("qwen3-30b-a3b-quarter", "M4096 K512 N384 E128", dict(tokens=512, k=8, hidden=512, inter=192, experts=128),
          ("small",)),
    Shape("qwen3-30b-a3b", "M32768 K2048 N1536 E128", {**QWEN3_30B_A3B}, ("llm",)),
    Shape("mixtral-8x7b", "M8192 K4096 N28672 E8", {**MIXTRAL_8X7B}, ("llm",)),
]


def make(d, dtype, mk):
    import numpy as np

    t, k, e, h, n = d["tokens"], d["k"], d["experts"], d["hidden"], 2 * d["inter"]
    # the group sizes of a balanced random router, drawn on the host (the sm_90 check builds these on meta tensors)
    rng = np.random.default_rng(seed_for("grouped_matmul", t, k, e))
    picks = np.argsort(rng.random((t, e)), axis=1, kind="stable")[:, :k].reshape(-1)
    offsets = np.concatenate([[0], np.cumsum(np.bincount(picks, minlength=e))]).astype(np.int32)
    if mk.kind != "numpy":
        import torch

        offsets = torch.from_numpy(offsets).to(mk.device)
    return dict(x=mk.normal((t * k, h), dtype), w=mk.normal((e, n, h), dtype, h ** -0.5), offsets=offsets,
                trans_w=True)


def per_expert_linear(x, w, offsets, trans_w):
    """One F.linear (x_e @ w[e]^T) per expert with rows, into one output."""
    import torch.nn.functional as F

    out = x.new_empty((x.shape[0], w.shape[1] if trans_w else w.shape[2]))
    bounds = offsets.tolist()
    for e in range(w.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[lo:hi] = F.linear(x[lo:hi], w[e]) if trans_w else x[lo:hi] @ w[e]
    return out


WORKLOAD = Workload(
    "grouped_matmul", SHAPES, make,
    torch_eager=per_expert_linear,
    torch_call="for e: out[offsets[e]:offsets[e+1]] = F.linear(x[offsets[e]:offsets[e+1]], w[e])",
)
