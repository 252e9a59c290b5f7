"""cross_entropy over the Llama-3 vocabulary (128256) and a 32K one, mean reduction."""

import numpy as np

from opport.bench.workloads import VOCAB, Shape, Workload, acc

SHAPES = [
    Shape("smoke", "8x512", dict(n=8, v=512), ("smoke",)),
    Shape("vocab32k-64", "64x32000", dict(n=64, v=32000), ("small",)),
    Shape("llama3-16", f"16x{VOCAB}", dict(n=16, v=VOCAB), ("small",)),
    Shape("llama3-1k", f"1024x{VOCAB}", dict(n=1024, v=VOCAB), ("llm",)),
    Shape("llama3-4k", f"4096x{VOCAB}", dict(n=4096, v=VOCAB), ("llm",)),
    Shape("anchor-8k", f"8192x{VOCAB}", dict(n=8192, v=VOCAB), ("llm",)),  # docs/performance.md 2e row
    Shape("vocab32k-8k", "8192x32000", dict(n=8192, v=32000), ("llm",)),
]


def make(d, dtype, mk):
    return dict(logits=mk.normal((d["n"], d["v"]), dtype, 2.0), target=mk.integers((d["n"],), 0, d["v"]),
                ignore_index=-100, reduction="mean", label_smoothing=0.0)


def torch_eager(logits, target, ignore_index, reduction, label_smoothing):
    import torch
    import torch.nn.functional as F

    loss = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
    return loss if loss.dtype == torch.float64 else loss.float()  # opport returns float32; keep float64 references


def numpy_composition(logits, target, ignore_index, reduction, label_smoothing):
    x = acc(logits)
    m = x.max(axis=-1, keepdims=True)
    lse = (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))[:, 0]
    keep = target != ignore_index
    picked = np.take_along_axis(x, np.where(keep, target, 0)[:, None], axis=-1)[:, 0]
    loss = lse - picked
    if label_smoothing:
        loss = (1 - label_smoothing) * loss + label_smoothing * (lse - x.mean(axis=-1))
    loss = np.where(keep, loss, 0).astype(np.float32)
    if reduction == "none":
        return loss
    total = loss.sum(dtype=np.float32)
    return total if reduction == "sum" else np.float32(total / keep.sum())


WORKLOAD = Workload(
    "cross_entropy", SHAPES, make,
    torch_eager=torch_eager,
    torch_call="torch.nn.functional.cross_entropy(logits, target, ignore_index, reduction, label_smoothing).float()",
    numpy=numpy_composition, numpy_call="logsumexp(x) - x[target], masked mean (float32 math)",
)
