"""matmul a [M, K] @ b [K, N]: square ceilings and Llama-3 projection shapes (decode and prefill)."""


from opport.bench.workloads import LLAMA3_8B, LLAMA3_70B, VOCAB, Shape, Workload, acc

H8, F8, H70, F70 = LLAMA3_8B["hidden"], LLAMA3_8B["ffn"], LLAMA3_70B["hidden"], LLAMA3_70B["ffn"]


def _s(name, m, k, n, tiers, bias=False):
    return Shape(name, f"{m}x{k}x{n}" + (" +bias" if bias else ""), dict(m=m, k=k, n=n, bias=bias), tiers)


SHAPES = [
    _s("smoke", 16, 64, 32, ("smoke",)),
    _s("square-512", 512, 512, 512, ("small",)),
    _s("llama8b-decode-qkv", 1, H8, H8 + 2 * 1024, ("small",)),
    _s("llama8b-prefill-128-up", 128, H8, F8, ("small",), bias=True),
    _s("square-4096", 4096, 4096, 4096, ("llm",)),
    _s("square-8192", 8192, 8192, 8192, ("llm",)),  # docs/performance.md 2e rows
    _s("llama70b-decode-16", 16, H70, H70, ("llm",)),
    _s("llama70b-decode-128-up", 128, H70, F70, ("llm",)),
    _s("llama8b-prefill-up", 4096, H8, F8, ("llm",)),
    _s("llama8b-lm-head-decode", 1, H8, VOCAB, ("llm",)),
]


def make(d, dtype, mk):
    k = d["k"]
    return dict(a=mk.normal((d["m"], k), dtype), b=mk.normal((k, d["n"]), dtype, k**-0.5),
                bias=mk.normal((d["n"],), dtype) if d["bias"] else None)


def torch_eager(a, b, bias):
    import torch

    return torch.matmul(a, b) if bias is None else torch.addmm(bias, a, b)


def numpy_composition(a, b, bias):
    y = acc(a) @ acc(b)
    return (y if bias is None else y + acc(bias)).astype(a.dtype)


WORKLOAD = Workload(
    "matmul", SHAPES, make,
    torch_eager=torch_eager, torch_call="torch.matmul(a, b) / torch.addmm(bias, a, b)",
    numpy=numpy_composition, numpy_call="a @ b + bias (float32 BLAS for 16-bit inputs)",
)
