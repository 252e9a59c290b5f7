"""linear_logprobs: per-token log-probs and entropy of an RL / preference trainer's head, Qwen's vocabulary
(H 4096, V 151936) on 8192 tokens at temperature 0.8, and small shapes.

The torch baseline is what trainers do: logits = hidden @ weight.T, / T, log_softmax (float32), gather, entropy
from the same [N, V] log-probs. `opport linear_cross_entropy` (reduction "none", the same logits) is timed beside
it in the same run: the peak-memory column (peak_MB, mem_vs) shows the log-probs with entropy take no more than the
chunked loss, and neither holds N x V (at N 8192, V 151936 the float32 log-probs alone are 4.6 GiB).
"""

from opport.bench.workloads import Shape, Workload

QWEN_H, QWEN_V = 4096, 151936


def _s(name, n, h, v, tiers, t=0.8, bias=False, softcap=None):
    label = f"{n}x{h}x{v} T{t:g}" + (" +bias" if bias else "") + (f" cap{softcap:g}" if softcap else "")
    return Shape(name, label, dict(n=n, h=h, v=v, t=t, bias=bias, softcap=softcap), tiers)


SHAPES = [
    _s("smoke", 16, 64, 500, ("smoke",)),
    _s("vocab32k-256", 256, 512, 32000, ("small",)),
    _s("gemma-softcap-128", 128, 256, 16384, ("small",), t=1.0, softcap=30.0),
    _s("qwen-1k", 1024, QWEN_H, QWEN_V, ("llm",)),
    _s("qwen-8k", 8192, QWEN_H, QWEN_V, ("llm",)),  # the shape
]


def make(d, dtype, mk):
    h, v = d["h"], d["v"]
    return dict(hidden=mk.normal((d["n"], h), dtype), weight=mk.normal((v, h), dtype, 2.0 * h**-0.5),
                target=mk.integers((d["n"],), 0, v), bias=mk.normal((v,), dtype) if d["bias"] else None,
                temperature=d["t"], softcap=d["softcap"], ignore_index=-100)


def torch_eager(hidden, weight, target, bias, temperature, softcap, ignore_index):
    import torch

    logits = hidden @ weight.T if bias is None else torch.addmm(bias, hidden, weight.T)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits if logits.dtype == torch.float64 else logits.float()  # float64: the float64 reference
    logp = torch.log_softmax(logits / temperature, dim=-1)
    kept = target != ignore_index
    picked = logp.gather(1, torch.where(kept, target, 0)[:, None])[:, 0]
    entropy = -(logp.exp() * logp).sum(-1)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    return torch.where(kept, picked, zero), torch.where(kept, entropy, zero)


def chunked_loss(hidden, weight, target, bias, temperature, softcap, ignore_index):
    """opport.linear_cross_entropy on the same tempered logits (reduction "none"): the memory to match."""
    import opport

    t = temperature
    return opport.linear_cross_entropy(hidden / t, weight, target, None if bias is None else bias / t,
                                       ignore_index=ignore_index, reduction="none",
                                       softcap=None if softcap is None else softcap / t)


chunked_loss.unchecked = "another op (the per-token loss, no entropy): timed and sized beside, not judged"

WORKLOAD = Workload(
    "linear_logprobs", SHAPES, make,
    torch_eager=torch_eager,
    torch_call="log_softmax((hidden @ weight.T).float() / T) gathered, entropy from it (the N x V log-probs held)",
    torch_others=(("opport_lce", "opport.linear_cross_entropy(hidden / T, weight, target, reduction='none')",
                   chunked_loss),),
)
