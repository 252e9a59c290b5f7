"""What `opport bench` runs for each op: shape sets, input makers and the baselines it compares with.

One module per op, named like the op (`workloads/rmsnorm.py` for `opport.rmsnorm`), defining
`WORKLOAD = Workload(...)`. Found by name, no central list: an op without a module is benchmarked
on its conformance cases tagged "llm", with no baselines.

Baselines take the op's bound arguments in signature order, like kernels do: `torch_eager` on torch
tensors (the exact call a user would make instead, named in `torch_call`), `numpy` on NumPy arrays
(a plain composition a user would write, named in `numpy_call`).

Tiers: "smoke" (CI, seconds on a CPU), "small" (the CPU default), "llm" (the CUDA default: Llama-3
8B/70B dimensions, prefill and decode).
"""

from __future__ import annotations

import importlib
import importlib.util
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from opport.dtypes import np_dtype

TIERS = ("smoke", "small", "llm")

# Llama-3 dimensions (hidden, FFN intermediate, query heads, kv heads, head dim) and vocabulary.
LLAMA3_8B = dict(hidden=4096, ffn=14336, heads=32, kv_heads=8, head_dim=128)
LLAMA3_70B = dict(hidden=8192, ffn=28672, heads=64, kv_heads=8, head_dim=128)
VOCAB = 128256


@dataclass(frozen=True)
class Shape:
    """One benchmark problem: a name, a printable label, the sizes `make` reads, and its tiers."""

    name: str
    label: str
    dims: dict
    tiers: tuple


@dataclass
class Workload:
    op: str
    shapes: list
    make: Callable  # make(dims, dtype, maker) -> kwargs naming every op argument
    torch_eager: Callable | None = None
    torch_call: str = ""
    numpy: Callable | None = None
    numpy_call: str = ""
    torch_reference: Callable | None = None  # float64 reference on torch tensors; default torch_eager
    torch_detail: Callable | None = None  # torch_detail(*bound) -> what torch_eager dispatched to (SDPA backend)
    # torch_vjp_reference(grad, out, *bound) -> float64 gradients (one per differentiable input, the backward's
    # order) from the forward's output as the kernels save it: for ops whose backward reads it (training.py)
    torch_vjp_reference: Callable | None = None
    # more torch baselines timed in the same run, (name, call, fn) each, fn like torch_eager (the model's own loop
    # beside a grouped implementation, for MoE); forward and training passes alike
    torch_others: tuple = ()
    notes: dict = field(default_factory=dict)

    def shapes_for(self, tier: str) -> list:
        return [s for s in self.shapes if tier in s.tiers]


class ArrayMaker:
    """Seeded random arrays of one kind: NumPy (cpu, neuron) or torch on a device (cuda).

    Large CUDA inputs are drawn on the device: drawing gigabytes in NumPy would take longer than
    the benchmark itself.
    """

    def __init__(self, kind: str, device: str = "cpu", seed: int = 0):
        self.kind, self.device = kind, device
        if kind == "numpy":
            self.rng = np.random.default_rng(seed)
        else:
            import torch

            self.gen = torch.Generator(device=device).manual_seed(seed)

    def normal(self, shape, dtype: str, scale: float = 1.0):
        if self.kind == "numpy":
            return (self.rng.standard_normal(tuple(shape), dtype=np.float32) * np.float32(scale)).astype(np_dtype(dtype))
        import torch

        a = torch.randn(tuple(shape), generator=self.gen, device=self.device, dtype=torch.float32) * scale
        return a.to(getattr(torch, dtype))

    def uniform(self, shape, dtype: str, lo: float, hi: float):
        if self.kind == "numpy":
            return self.rng.uniform(lo, hi, tuple(shape)).astype(np.float32).astype(np_dtype(dtype))
        import torch

        a = torch.rand(tuple(shape), generator=self.gen, device=self.device, dtype=torch.float32)
        return (a * (hi - lo) + lo).to(getattr(torch, dtype))

    def integers(self, shape, lo: int, hi: int):
        """int64 values in [lo, hi)."""
        if self.kind == "numpy":
            return self.rng.integers(lo, hi, tuple(shape), dtype=np.int64)
        import torch

        return torch.randint(lo, hi, tuple(shape), generator=self.gen, device=self.device, dtype=torch.int64)


def seed_for(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def acc(a: np.ndarray) -> np.ndarray:
    """`a` in the dtype a NumPy user computes in: float64 stays, everything else goes to float32."""
    return a if a.dtype == np.float64 else a.astype(np.float32)


def get_workload(spec) -> Workload:
    """The op's workload module, or one built from its conformance cases tagged "llm"."""
    mod = f"{__name__}.{spec.name}"
    if importlib.util.find_spec(mod) is not None:
        return importlib.import_module(mod).WORKLOAD
    return _from_cases(spec)


def _from_cases(spec) -> Workload:
    """Benchmark an op nobody wrote a workload for on its own llm-tagged cases (no baselines)."""
    shapes = []
    for case in spec.get_cases("float32"):
        if "llm" in case.tags:
            first = case.args[0] if case.args else next(iter(case.kwargs.values()))
            label = "x".join(map(str, getattr(first, "shape", ())))
            shapes.append(Shape(case.name, label, {"case": case.name}, ("smoke", "small", "llm")))

    def make(dims, dtype, maker):
        case = next(c for c in spec.get_cases(dtype) if c.name == dims["case"])
        bound = spec.bind(*case.args, **case.kwargs)
        kw = dict(zip(spec.params, bound))
        if maker.kind != "numpy":
            from opport.dispatch.adapters import NumpyAdapter

            kw = {k: NumpyAdapter.to_torch(v, maker.device) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
        return kw

    return Workload(spec.name, shapes, make, notes={"source": "conformance cases tagged llm"})
