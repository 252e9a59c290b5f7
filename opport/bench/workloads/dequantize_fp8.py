"""dequantize_fp8: float8_e4m3fn activations back to 16/32-bit, per token and in 1 x 128 blocks."""

import numpy as np

from opport.bench.workloads import LLAMA3_8B, Shape, Workload
from opport.bench.workloads.quantize_fp8 import DSV3, _grouped
from opport.dtypes import np_dtype

H8 = LLAMA3_8B["hidden"]
FP8 = "float8_e4m3fn"

SHAPES = [
    Shape("smoke", "8x256", dict(rows=8, n=256, g="token"), ("smoke",)),
    Shape("token-prefill-256", f"256x{H8}", dict(rows=256, n=H8, g="token"), ("small",)),
    Shape("block-prefill-256", f"256x{DSV3}", dict(rows=256, n=DSV3, g="block"), ("small",)),
    Shape("token-prefill", f"8192x{H8}", dict(rows=8192, n=H8, g="token"), ("llm",)),
    Shape("block-prefill", f"8192x{DSV3}", dict(rows=8192, n=DSV3, g="block"), ("llm",)),
]


def make(d, dtype, mk):
    rows, n = d["rows"], d["n"]
    groups = 1 if d["g"] == "token" else n // 128
    x = mk.normal((rows, n), "float32", 100.0)
    if mk.kind == "numpy":
        q = np.clip(x, -448, 448).astype(np_dtype(FP8))
    else:
        import torch

        q = x.clamp(-448, 448).to(torch.float8_e4m3fn)
    return dict(q=q, scales=mk.uniform((rows, groups), "float32", 1e-3, 1e-2), granularity=d["g"], block=128,
                out_dtype=dtype)


def torch_eager(q, scales, granularity, block, out_dtype):
    import torch

    out = _grouped(q.float(), granularity, block) * scales.unsqueeze(-1)
    return out.reshape(q.shape).to(getattr(torch, out_dtype))


def torch_reference(q, scales, granularity, block, out_dtype):
    """float64 q * scales (the fp8 codes are exact in float64)."""
    return (_grouped(q.double(), granularity, block) * scales.double().unsqueeze(-1)).reshape(q.shape)


WORKLOAD = Workload(
    "dequantize_fp8", SHAPES, make,
    torch_eager=torch_eager, torch_reference=torch_reference,
    torch_call="(q.float() * scales per group).to(out_dtype)",
)
