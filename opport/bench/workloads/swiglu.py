"""swiglu: silu(gate) * up on Llama-3 FFN widths, decode and prefill."""

import numpy as np

from opport.bench.workloads import LLAMA3_8B, LLAMA3_70B, Shape, Workload, acc

F8, F70 = LLAMA3_8B["ffn"], LLAMA3_70B["ffn"]

SHAPES = [
    Shape("smoke", "8x256", dict(rows=8, n=256), ("smoke",)),
    Shape("llama8b-decode", f"1x{F8}", dict(rows=1, n=F8), ("small", "llm")),
    Shape("llama8b-prefill-256", f"256x{F8}", dict(rows=256, n=F8), ("small",)),
    Shape("llama70b-decode-128", f"128x{F70}", dict(rows=128, n=F70), ("llm",)),
    Shape("llama8b-prefill", f"4096x{F8}", dict(rows=4096, n=F8), ("llm",)),
    Shape("llama70b-prefill", f"8192x{F70}", dict(rows=8192, n=F70), ("llm",)),
    Shape("anchor-32k", "32768x8192", dict(rows=32768, n=8192), ("llm",)),  # docs/performance.md 2e row
]


def make(d, dtype, mk):
    shape = (d["rows"], d["n"])
    return dict(gate=mk.normal(shape, dtype, 2.0), up=mk.normal(shape, dtype))


def torch_eager(gate, up):
    import torch.nn.functional as F

    return F.silu(gate) * up


def numpy_composition(gate, up):
    g = acc(gate)
    return (g / (1 + np.exp(-g)) * acc(up)).astype(gate.dtype)


WORKLOAD = Workload(
    "swiglu", SHAPES, make,
    torch_eager=torch_eager, torch_call="torch.nn.functional.silu(gate) * up",
    numpy=numpy_composition, numpy_call="gate / (1 + np.exp(-gate)) * up (float32 math)",
)
