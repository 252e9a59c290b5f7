"""gelu (erf and tanh forms): Llama-sized FFN activations, decode and prefill."""

import math

import numpy as np

from opport.bench.workloads import LLAMA3_8B, Shape, Workload, acc

F8 = LLAMA3_8B["ffn"]

SHAPES = [
    Shape("smoke", "8x256", dict(rows=8, n=256, approximate="none"), ("smoke",)),
    Shape("ffn-decode", f"1x{F8}", dict(rows=1, n=F8, approximate="none"), ("small", "llm")),
    Shape("ffn-prefill-256", f"256x{F8}", dict(rows=256, n=F8, approximate="none"), ("small",)),
    Shape("ffn-prefill-256-tanh", f"256x{F8} tanh", dict(rows=256, n=F8, approximate="tanh"), ("small",)),
    Shape("ffn-prefill", f"4096x{F8}", dict(rows=4096, n=F8, approximate="none"), ("llm",)),
    Shape("anchor-tanh", "32768x8192 tanh", dict(rows=32768, n=8192, approximate="tanh"), ("llm",)),  # 2e row
    Shape("anchor-erf", "32768x8192", dict(rows=32768, n=8192, approximate="none"), ("llm",)),
]


def make(d, dtype, mk):
    return dict(x=mk.normal((d["rows"], d["n"]), dtype, 2.0), approximate=d["approximate"])


def torch_eager(x, approximate):
    import torch.nn.functional as F

    return F.gelu(x, approximate=approximate)


def numpy_composition(x, approximate):
    xf = acc(x)
    if approximate == "tanh":
        y = 0.5 * xf * (1 + np.tanh(math.sqrt(2 / math.pi) * (xf + 0.044715 * xf**3)))
    else:
        from scipy.special import erf  # NumPy has no erf

        y = 0.5 * xf * (1 + erf(xf / math.sqrt(2)))
    return y.astype(x.dtype)


WORKLOAD = Workload(
    "gelu", SHAPES, make,
    torch_eager=torch_eager, torch_call="torch.nn.functional.gelu(x, approximate=approximate)",
    numpy=numpy_composition, numpy_call="0.5*x*(1+tanh(...)) / 0.5*x*(1+scipy.special.erf(x/sqrt 2)) (float32 math)",
)
