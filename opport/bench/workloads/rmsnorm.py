"""rmsnorm: Llama-3 hidden sizes, decode (1-128 rows) and prefill (4K-32K tokens)."""

import numpy as np

from opport.bench.workloads import LLAMA3_8B, LLAMA3_70B, Shape, Workload, acc

H8, H70 = LLAMA3_8B["hidden"], LLAMA3_70B["hidden"]

SHAPES = [
    Shape("smoke", "8x256", dict(rows=8, n=256), ("smoke",)),
    Shape("llama8b-decode", f"1x{H8}", dict(rows=1, n=H8), ("small", "llm")),
    Shape("llama8b-prefill-512", f"512x{H8}", dict(rows=512, n=H8), ("small",)),
    Shape("llama70b-prefill-256", f"256x{H70}", dict(rows=256, n=H70), ("small",)),
    Shape("llama70b-decode-128", f"128x{H70}", dict(rows=128, n=H70), ("llm",)),
    Shape("llama8b-prefill", f"4096x{H8}", dict(rows=4096, n=H8), ("llm",)),
    Shape("llama70b-prefill", f"16384x{H70}", dict(rows=16384, n=H70), ("llm",)),
    Shape("anchor-32k", f"32768x{H70}", dict(rows=32768, n=H70), ("llm",)),  # docs/performance.md 2e row
]


def make(d, dtype, mk):
    return dict(x=mk.normal((d["rows"], d["n"]), dtype), weight=mk.uniform((d["n"],), dtype, 0.5, 1.5), eps=1e-6)


def torch_eager(x, weight, eps, offset=0.0):
    import torch.nn.functional as F

    if offset:  # Gemma's (offset + weight), formed in float32 as transformers' Gemma RMSNorm does
        return (F.rms_norm(x.float(), (x.shape[-1],), None, eps) * (offset + weight.float())).to(x.dtype)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def numpy_composition(x, weight, eps, offset=0.0):
    xf = acc(x)
    y = xf / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * (offset + acc(weight))
    return y.astype(x.dtype)


WORKLOAD = Workload(
    "rmsnorm", SHAPES, make,
    torch_eager=torch_eager, torch_call="torch.nn.functional.rms_norm(x, (N,), weight, eps)",
    numpy=numpy_composition, numpy_call="x / np.sqrt(np.mean(x*x, -1, keepdims=True) + eps) * weight (float32 math)",
)
