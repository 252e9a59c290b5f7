"""scaled_matmul: float8_e4m3fn GEMMs, square cubes (the fp8 anchor's shapes) and Llama-3 projections.

b is an nn.Linear weight: stored [N, K] and passed as the column-major [K, N] view weight.t() (what
torch._scaled_mm requires, and the K-major operand Hopper's fp8 wgmma reads directly).
Anchor (docs/performance.md 2e): torch._scaled_mm fp8 on the H200 1280 TFLOP/s at 8192^3, 1202 at 4096^3.
"""

from opport.bench.workloads import LLAMA3_8B, LLAMA3_70B, Shape, Workload

H8, F8, H70 = LLAMA3_8B["hidden"], LLAMA3_8B["ffn"], LLAMA3_70B["hidden"]
FP8 = "float8_e4m3fn"
BLOCK = 128


def _s(name, m, k, n, g, tiers, bias=False):
    label = f"{m}x{k}x{n} {g}" + (" +bias" if bias else "")
    return Shape(name, label, dict(m=m, k=k, n=n, g=g, bias=bias), tiers)


SHAPES = [
    _s("smoke", 16, 256, 32, "block", ("smoke",)),
    _s("square-512-tensor", 512, 512, 512, "tensor", ("small",)),
    _s("llama8b-prefill-128-up-block", 128, H8, F8, "block", ("small",)),
    _s("llama8b-decode-qkv-row", 16, H8, H8 + 2 * 1024, "row", ("small",), bias=True),
    _s("square-4096-tensor", 4096, 4096, 4096, "tensor", ("llm",)),
    _s("square-8192-tensor", 8192, 8192, 8192, "tensor", ("llm",)),  # the anchor: _scaled_mm 1280 TFLOP/s
    _s("square-4096-row", 4096, 4096, 4096, "row", ("llm",)),
    _s("square-8192-block", 8192, 8192, 8192, "block", ("llm",)),
    _s("llama8b-prefill-up-block", 4096, H8, F8, "block", ("llm",)),
    _s("llama70b-decode-16-row", 16, H70, H70, "row", ("llm",)),
]


def _scale_shapes(g: str, m: int, k: int, n: int) -> tuple:
    if g == "tensor":
        return (1, 1), (1, 1)
    if g == "row":
        return (m, 1), (1, n)
    return (m, k // BLOCK), (k // BLOCK, -(-n // BLOCK))


def make(d, dtype, mk):
    m, k, n = d["m"], d["k"], d["n"]
    sa, sb = _scale_shapes(d["g"], m, k, n)
    w = mk.normal((n, k), FP8)  # |values| of a standard normal: far inside e4m3's 448
    b = w.T if mk.kind == "numpy" else w.t()
    return dict(a_q=mk.normal((m, k), FP8), b_q=b, scale_a=mk.uniform(sa, "float32", 2.0**-4, 2.0**-2),
                scale_b=mk.uniform(sb, "float32", k**-0.5 / 2, k**-0.5),
                bias=mk.normal((n,), dtype) if d["bias"] else None, out_dtype=dtype)


def _expanded(t, scale_a, scale_b):
    """The scales broadcast over a [M, K] and b [K, N] (torch), for the composition baselines."""
    k, n = t
    sa = scale_a if scale_a.shape[-1] == 1 else scale_a.repeat_interleave(k // scale_a.shape[-1], -1)
    sb = scale_b if scale_b.shape[0] == 1 else scale_b.repeat_interleave(k // scale_b.shape[0], 0)
    if sb.shape[1] not in (1, n):
        sb = sb.repeat_interleave(BLOCK, 1)[:, :n]
    return sa, sb


def _scaled_mm_ok(a_q, b_q, scale_a, scale_b, out_dtype) -> bool:
    """torch._scaled_mm takes it: CUDA, per-tensor scales, or per-row / per-column scales with a bfloat16 output."""
    import torch

    if not (a_q.is_cuda and hasattr(torch, "_scaled_mm")):
        return False
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        return True
    return scale_a.shape[-1] == 1 and scale_b.shape[0] == 1 and out_dtype == "bfloat16"


def torch_eager(a_q, b_q, scale_a, scale_b, bias, out_dtype):
    """torch._scaled_mm where it takes the call; else (CPU, 128-block scales) dequantise and matmul in float32."""
    import torch

    dt = getattr(torch, out_dtype)
    if _scaled_mm_ok(a_q, b_q, scale_a, scale_b, out_dtype):
        sa = scale_a.reshape(()) if scale_a.numel() == 1 else scale_a
        sb = scale_b.reshape(()) if scale_b.numel() == 1 else scale_b
        return torch._scaled_mm(a_q, b_q, sa, sb, bias=bias, out_dtype=dt)
    sa, sb = _expanded(b_q.shape, scale_a, scale_b)
    y = (a_q.float() * sa) @ (b_q.float() * sb)
    return (y if bias is None else y + bias.float()).to(dt)


def torch_reference(a_q, b_q, scale_a, scale_b, bias, out_dtype):
    """float64 (a_q * scale_a) @ (b_q * scale_b) + bias (the fp8 codes are exact in float64)."""
    sa, sb = _expanded(b_q.shape, scale_a.double(), scale_b.double())
    y = (a_q.double() * sa) @ (b_q.double() * sb)
    return y if bias is None else y + bias.double()


def numpy_composition(a_q, b_q, scale_a, scale_b, bias, out_dtype):
    import numpy as np

    from opport.dtypes import np_dtype
    from opport.ops.scaled_matmul import dequantized

    a, b = dequantized(a_q, b_q, scale_a, scale_b, np.float32)
    y = a @ b
    return (y if bias is None else y + bias.astype(np.float32)).astype(np_dtype(out_dtype))


WORKLOAD = Workload(
    "scaled_matmul", SHAPES, make,
    torch_eager=torch_eager, torch_reference=torch_reference,
    torch_call="torch._scaled_mm(a, b, scale_a, scale_b, bias, out_dtype) (CUDA, tensor / row scales); "
               "else (a.float() * sa) @ (b.float() * sb) + bias",
    numpy=numpy_composition, numpy_call="(a * sa) @ (b * sb) + bias in float32 (scales expanded)",
    notes={"anchor": "torch._scaled_mm fp8 on H200: 1280 TFLOP/s at 8192^3, 1202 at 4096^3 (docs/performance.md 2e; "
                 "docs/anchors/h200-training-decode-2026-11-29.json, op matmul_fp8)"},
)
