"""silu: Llama-sized FFN activations, decode and prefill."""

import numpy as np

from opport.bench.workloads import LLAMA3_8B, LLAMA3_70B, Shape, Workload, acc

F8, F70 = LLAMA3_8B["ffn"], LLAMA3_70B["ffn"]

SHAPES = [
    Shape("smoke", "8x256", dict(rows=8, n=256), ("smoke",)),
    Shape("ffn-decode", f"1x{F8}", dict(rows=1, n=F8), ("small", "llm")),
    Shape("ffn-prefill-256", f"256x{F8}", dict(rows=256, n=F8), ("small",)),
    Shape("ffn-prefill", f"4096x{F8}", dict(rows=4096, n=F8), ("llm",)),
    Shape("llama70b-ffn-prefill", f"8192x{F70}", dict(rows=8192, n=F70), ("llm",)),
]


def make(d, dtype, mk):
    return dict(x=mk.normal((d["rows"], d["n"]), dtype, 2.0))


def torch_eager(x):
    import torch.nn.functional as F

    return F.silu(x)


def numpy_composition(x):
    xf = acc(x)
    return (xf / (1 + np.exp(-xf))).astype(x.dtype)


WORKLOAD = Workload(
    "silu", SHAPES, make,
    torch_eager=torch_eager, torch_call="torch.nn.functional.silu(x)",
    numpy=numpy_composition, numpy_call="x / (1 + np.exp(-x)) (float32 math)",
)
