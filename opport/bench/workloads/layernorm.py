"""layernorm: Llama-3 hidden sizes, decode and prefill (same problems as rmsnorm)."""

import numpy as np

from opport.bench.workloads import LLAMA3_8B, LLAMA3_70B, Shape, Workload, acc

H8, H70 = LLAMA3_8B["hidden"], LLAMA3_70B["hidden"]

SHAPES = [
    Shape("smoke", "8x256", dict(rows=8, n=256), ("smoke",)),
    Shape("llama8b-decode", f"1x{H8}", dict(rows=1, n=H8), ("small", "llm")),
    Shape("llama8b-prefill-512", f"512x{H8}", dict(rows=512, n=H8), ("small",)),
    Shape("llama70b-decode-128", f"128x{H70}", dict(rows=128, n=H70), ("llm",)),
    Shape("llama8b-prefill", f"4096x{H8}", dict(rows=4096, n=H8), ("llm",)),
    Shape("llama70b-prefill", f"16384x{H70}", dict(rows=16384, n=H70), ("llm",)),
    Shape("anchor-32k", f"32768x{H70}", dict(rows=32768, n=H70), ("llm",)),
]


def make(d, dtype, mk):
    n = d["n"]
    return dict(x=mk.normal((d["rows"], n), dtype), weight=mk.uniform((n,), dtype, 0.5, 1.5),
                bias=mk.normal((n,), dtype, 0.1), eps=1e-5)


def torch_eager(x, weight, bias, eps):
    import torch.nn.functional as F

    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def numpy_composition(x, weight, bias, eps):
    xf = acc(x)
    mu = xf.mean(axis=-1, keepdims=True)
    y = (xf - mu) / np.sqrt(xf.var(axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * acc(weight)
    if bias is not None:
        y = y + acc(bias)
    return y.astype(x.dtype)


WORKLOAD = Workload(
    "layernorm", SHAPES, make,
    torch_eager=torch_eager, torch_call="torch.nn.functional.layer_norm(x, (N,), weight, bias, eps)",
    numpy=numpy_composition, numpy_call="(x - x.mean(-1)) / np.sqrt(x.var(-1) + eps) * weight + bias (float32 math)",
)
