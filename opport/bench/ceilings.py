"""The roofs every row is measured against, measured in the same run (docs/performance.md sections 1 and 5).

Copy bandwidth: one large copy, bytes read + bytes written. Compute: a large matrix product through
the vendor library (cuBLAS via torch.matmul; NumPy's BLAS on CPUs), per dtype on random data (zeros
run faster than real data on some GPUs). A row's floor is max(bytes / copy rate, flops / matmul rate);
roofline_pct = floor / measured time. A ceiling takes the fastest sample, not the median: it is
what the machine can reach, and on a shared machine the median of a ceiling run understates it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# problem sizes: (copy bytes, square GEMM side)
_CPU_SIZES = {"smoke": (32 << 20, 256), "small": (256 << 20, 1024), "llm": (256 << 20, 1024)}
_CUDA_SIZES = {"smoke": (256 << 20, 4096), "small": (1 << 30, 8192), "llm": (1 << 30, 8192)}


@dataclass
class Ceilings:
    copy_GBps: float
    matmul_TFLOPs: dict  # dtype -> TFLOP/s
    default_dtype: str
    detail: dict = field(default_factory=dict)

    def peak(self, dtype: str) -> float:
        return self.matmul_TFLOPs.get(dtype, self.matmul_TFLOPs[self.default_dtype])

    def floor_ms(self, nbytes: int, flops: int, dtype: str) -> tuple[float, str]:
        """The fastest a row can run at these roofs, and which roof bounds it."""
        mem = nbytes / (self.copy_GBps * 1e6)
        comp = flops / (self.peak(dtype) * 1e9)
        return (mem, "memory") if mem >= comp else (comp, "compute")

    def as_json(self) -> dict:
        return {"copy_GBps": _sig(self.copy_GBps), "matmul_TFLOPs": _sig(self.peak(self.default_dtype)),
                "matmul_TFLOPs_by_dtype": {k: _sig(v) for k, v in self.matmul_TFLOPs.items()}, **self.detail}


def _sig(x: float) -> float:
    return float(f"{x:.5g}")


def _time_copy(timer, src, copy):
    """The copy's timing; the two buffers are freed on return."""
    dst = src * 0 + 1
    return min(timer.samples(lambda: copy(dst, src)))


def measure_cpu(timer, tier: str, dtypes) -> Ceilings:
    nbytes, n = _CPU_SIZES[tier]
    copy = _time_copy(timer, np.ones(nbytes // 4, np.float32), np.copyto)  # ones: every page really mapped
    rng = np.random.default_rng(0)
    blas = {}
    for dt in sorted({"float64" if d == "float64" else "float32" for d in dtypes}):
        a, b = rng.standard_normal((n, n)).astype(dt), rng.standard_normal((n, n)).astype(dt)
        blas[dt] = 2 * n**3 / (min(timer.samples(lambda a=a, b=b: a @ b)) * 1e9)
    return Ceilings(2 * nbytes / (copy * 1e6), blas, "float32",
                    {"copy": f"np.copyto of {nbytes >> 20} MiB (read + write counted), fastest sample",
                     "matmul": f"NumPy BLAS {n}^3, fastest sample; 16-bit rows use the float32 rate (NumPy has no 16-bit BLAS)"})


def measure_cuda(timer, tier: str, dtypes) -> Ceilings:
    import torch

    nbytes, n = _CUDA_SIZES[tier]
    copy = _time_copy(timer, torch.randn(nbytes // 4, device="cuda"), lambda dst, src: dst.copy_(src))
    peak = {}
    for dt in sorted(set(dtypes) | {"bfloat16"}):
        tdt = getattr(torch, dt)
        a, b = torch.randn(n, n, device="cuda", dtype=tdt), torch.randn(n, n, device="cuda", dtype=tdt)
        peak[dt] = 2 * n**3 / (min(timer.samples(lambda a=a, b=b: torch.matmul(a, b))) * 1e9)
        del a, b
    tf32 = torch.backends.cuda.matmul.allow_tf32
    return Ceilings(2 * nbytes / (copy * 1e6), peak, "bfloat16",
                    {"copy": f"torch copy_ of {nbytes >> 20} MiB on the device (read + write counted), fastest sample",
                     "matmul": f"torch.matmul (cuBLAS) {n}^3 on random data, fastest sample; float32 with allow_tf32={tf32}"})
