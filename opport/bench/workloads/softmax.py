"""softmax over the last axis: attention-score rows (1K-32K) and vocabulary rows (128256)."""

import numpy as np

from opport.bench.workloads import VOCAB, Shape, Workload, acc

SHAPES = [
    Shape("smoke", "8x256", dict(rows=8, n=256), ("smoke",)),
    Shape("scores-1k", "256x1024", dict(rows=256, n=1024), ("small",)),
    Shape("vocab-decode", f"1x{VOCAB}", dict(rows=1, n=VOCAB), ("small", "llm")),
    Shape("scores-1k-large", "65536x1024", dict(rows=65536, n=1024), ("llm",)),
    Shape("anchor-8k", "32768x8192", dict(rows=32768, n=8192), ("llm",)),  # docs/performance.md 2e row
    Shape("scores-32k", "8192x32768", dict(rows=8192, n=32768), ("llm",)),
    Shape("vocab-prefill", f"4096x{VOCAB}", dict(rows=4096, n=VOCAB), ("llm",)),
]


def make(d, dtype, mk):
    return dict(x=mk.normal((d["rows"], d["n"]), dtype, 2.0), axis=-1)


def torch_eager(x, axis):
    import torch

    return torch.softmax(x, dim=axis)


def torch_vjp_reference(grad, out, x, axis):
    """dx = y (g - sum(g y)) on the saved output y (float64 tensors)."""
    return (out * grad - out * (grad * out).sum(dim=axis, keepdim=True),)


def numpy_composition(x, axis):
    xf = acc(x)
    e = np.exp(xf - xf.max(axis=axis, keepdims=True))
    return (e / e.sum(axis=axis, keepdims=True)).astype(x.dtype)


WORKLOAD = Workload(
    "softmax", SHAPES, make,
    torch_eager=torch_eager, torch_call="torch.softmax(x, dim=axis)", torch_vjp_reference=torch_vjp_reference,
    numpy=numpy_composition, numpy_call="e = np.exp(x - x.max(axis)); e / e.sum(axis) (float32 math)",
)
