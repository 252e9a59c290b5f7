"""linear_cross_entropy: the Llama-3 LM head (H 4096, V 128256) on 8192 tokens, and small shapes; mean reduction.

The baselines hold the logits: torch `F.cross_entropy(hidden @ weight.T (+ bias), target)`, NumPy the same
composition. The bench's peak-memory column (peak_MB, and mem_vs: the baseline's peak over opport's) shows what
that costs: at N 8192, V 128256 the bfloat16 logits alone are 2 GiB, and autograd keeps them for the backward.
"""

import numpy as np

from opport.bench.workloads import LLAMA3_8B, VOCAB, Shape, Workload, acc
from opport.bench.workloads.cross_entropy import numpy_composition as _ce_numpy

H8 = LLAMA3_8B["hidden"]


def _s(name, n, h, v, tiers, bias=False, softcap=None):
    label = f"{n}x{h}x{v}" + (" +bias" if bias else "") + (f" cap{softcap:g}" if softcap else "")
    return Shape(name, label, dict(n=n, h=h, v=v, bias=bias, softcap=softcap), tiers)


SHAPES = [
    _s("smoke", 16, 64, 500, ("smoke",)),
    _s("vocab32k-256", 256, 512, 32000, ("small",)),
    _s("gemma-softcap-128", 128, 256, 16384, ("small",), bias=True, softcap=30.0),
    _s("llama3-1k", 1024, H8, VOCAB, ("llm",)),
    _s("llama3-8k", 8192, H8, VOCAB, ("llm",)),  # the shape
]


def make(d, dtype, mk):
    h, v = d["h"], d["v"]
    return dict(hidden=mk.normal((d["n"], h), dtype), weight=mk.normal((v, h), dtype, 2.0 * h**-0.5),
                target=mk.integers((d["n"],), 0, v), bias=mk.normal((v,), dtype) if d["bias"] else None,
                ignore_index=-100, reduction="mean", label_smoothing=0.0, softcap=d["softcap"])


def torch_eager(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap):
    import torch
    import torch.nn.functional as F

    logits = hidden @ weight.T if bias is None else torch.addmm(bias, hidden, weight.T)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    return loss if loss.dtype == torch.float64 else loss.float()


def numpy_composition(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap):
    logits = acc(hidden) @ acc(weight).T
    if bias is not None:
        logits += acc(bias)
    if softcap is not None:
        logits = softcap * np.tanh(logits / softcap)
    return _ce_numpy(logits, target, ignore_index, reduction, label_smoothing)


WORKLOAD = Workload(
    "linear_cross_entropy", SHAPES, make,
    torch_eager=torch_eager,
    torch_call="F.cross_entropy(hidden @ weight.T (+ bias), target).float() (the N x V logits held)",
    numpy=numpy_composition, numpy_call="logits = hidden @ weight.T (float32 BLAS), then logsumexp - x[target]",
)
