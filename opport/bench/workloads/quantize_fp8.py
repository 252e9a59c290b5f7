"""quantize_fp8: LLM activations to float8_e4m3fn, per token and in DeepSeek-V3's 1 x 128 blocks."""

import numpy as np

from opport.arraymath import FP8_MAX, SCALE_FLOOR
from opport.bench.workloads import LLAMA3_8B, LLAMA3_70B, Shape, Workload

H8, H70 = LLAMA3_8B["hidden"], LLAMA3_70B["hidden"]
DSV3 = 7168  # DeepSeek-V3's hidden size, whose activations are quantised in 1 x 128 blocks

SHAPES = [
    Shape("smoke", "8x256", dict(rows=8, n=256, g="token"), ("smoke",)),
    Shape("token-prefill-256", f"256x{H8}", dict(rows=256, n=H8, g="token"), ("small",)),
    Shape("block-prefill-256", f"256x{DSV3}", dict(rows=256, n=DSV3, g="block"), ("small",)),
    Shape("token-prefill", f"8192x{H8}", dict(rows=8192, n=H8, g="token"), ("llm",)),
    Shape("block-prefill", f"8192x{DSV3}", dict(rows=8192, n=DSV3, g="block"), ("llm",)),
    Shape("tensor-prefill", f"32768x{H70}", dict(rows=32768, n=H70, g="tensor"), ("llm",)),
]


def make(d, dtype, mk):
    return dict(x=mk.normal((d["rows"], d["n"]), dtype), granularity=d["g"], block=128, dtype="float8_e4m3fn",
                scale=None)


def _grouped(t, granularity, block):
    if granularity == "tensor":
        return t.reshape((1,) * t.dim() + (-1,))
    if granularity == "token":
        return t.unsqueeze(-2)
    return t.reshape(*t.shape[:-1], t.shape[-1] // block, block)


def torch_eager(x, granularity, block, dtype, scale):
    """What a torch user writes (amax over all values: no NaN/inf handling)."""
    import torch

    fmax = FP8_MAX[dtype]
    g = _grouped(x.float(), granularity, block)
    s = (g.abs().amax(-1) / fmax).clamp_min(SCALE_FLOOR)
    q = (g / s.unsqueeze(-1)).clamp(-fmax, fmax).reshape(x.shape).to(getattr(torch, dtype))
    return q, s


def torch_reference(x, granularity, block, dtype, scale):
    """The op's float64 reference (q unrounded, scales float32) on the torch float64 input."""
    import torch

    from opport.ops.quantize_fp8 import quantize_fp8

    q, s = quantize_fp8._reference(x.cpu().numpy(), granularity, block, dtype, scale)
    return torch.from_numpy(q).to(x.device), torch.from_numpy(np.ascontiguousarray(s)).to(x.device)


WORKLOAD = Workload(
    "quantize_fp8", SHAPES, make,
    torch_eager=torch_eager, torch_reference=torch_reference,
    torch_call="s = (x.float().abs().amax(-1) / 448).clamp_min(tiny); (x / s).clamp(-448, 448).to(torch.float8_e4m3fn) per group",
)
