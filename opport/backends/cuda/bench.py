"""How `opport bench` measures the cuda backend (the protocol is in opport/bench/profile.py).

CUDA events with a cold L2 (`triton.testing.do_bench`), CUDA-graph replays and host wall time for
launch-bound shapes, ceilings from a device copy and cuBLAS, and the GPU's clocks at start and end
(docs/performance.md sections 1 and 5). Needs a CUDA device: Triton's interpreter mode refuses.
"""

from __future__ import annotations

import shutil
import subprocess
import time

import numpy as np

TIER = "llm"
DTYPES = ("bfloat16",)
MAX_MINUTES = 7.0
COMPILE_BASELINE = True
GRAPHS = True
# problem sizes of the ceilings per tier: (copy bytes, square GEMM side)
_SIZES = {"smoke": (256 << 20, 4096), "small": (1 << 30, 8192), "llm": (1 << 30, 8192)}
_SMI_FIELDS = ("driver_version", "clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem", "power.draw",
               "power.limit", "temperature.gpu", "pstate")


def unsupported(mode: str) -> str | None:
    if mode == "compiled":
        return None
    return (f"mode {mode!r}: no CUDA GPU is visible to torch (torch.cuda.is_available() is False); Triton's "
            "interpreter checks correctness (opport conformance) but its timings mean nothing")


class CudaTimer:
    """`triton.testing.do_bench` (CUDA events, L2 flushed before every call) and `do_bench_cudagraph`."""

    def __init__(self, warmup_ms: float = 25.0, budget_ms: float = 100.0, min_samples: int = 5):
        import torch
        from triton import runtime

        self.warmup_ms, self.budget_ms, self.min_samples = warmup_ms, budget_ms, min_samples
        cache = runtime.driver.active.get_empty_cache_for_benchmark()
        self.flush_bytes = cache.numel() * cache.element_size()
        self.l2_bytes = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0)
        del cache

    @property
    def method(self) -> dict:
        ok = self.flush_bytes >= 4 * self.l2_bytes
        return {"timer": "triton.testing.do_bench (CUDA events on the launching stream)",
                "cache": f"cold L2: {self.flush_bytes >> 20} MiB buffer zeroed before every timed call "
                         f"({'>=' if ok else 'BELOW'} 4x the {self.l2_bytes >> 20} MiB L2)",
                "statistic": "median with p20/p80 of samples pooled over interleaved rounds",
                "warmup_ms": self.warmup_ms, "rep_ms_per_provider": self.budget_ms,
                "graph": "triton.testing.do_bench_cudagraph for launch-bound shapes (warm L2, back-to-back replays)",
                "host": "host wall time per call, back-to-back calls then one synchronize (launch-bound shapes)"}

    def samples(self, fn, budget_ms: float | None = None) -> list:
        from triton.testing import do_bench

        out = list(do_bench(fn, warmup=self.warmup_ms, rep=budget_ms or self.budget_ms, return_mode="all"))
        if len(out) < self.min_samples:  # a slow kernel: ask for enough repetitions for quantiles to mean something
            rep = (self.min_samples - len(out) + 1) * float(np.median(out))
            out += do_bench(fn, warmup=0, rep=rep, return_mode="all")
        return out

    def graph(self, fn, rep_ms: float = 20.0) -> list:
        """Samples (ms) of the call captured in a CUDA graph and replayed."""
        from triton.testing import do_bench_cudagraph

        return list(do_bench_cudagraph(fn, rep=rep_ms, return_mode="all"))

    def host_us(self, fn, calls: int = 100, repeats: int = 5) -> float:
        import torch

        per_call = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            per_call.append((time.perf_counter() - t0) * 1e6 / calls)
        return float(np.median(per_call))

    def peak_mb(self, fn) -> float:
        """Device memory the call allocates at its peak, beyond what was allocated before it."""
        import torch

        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return round((torch.cuda.max_memory_allocated() - before) / 2**20, 2)

    @staticmethod
    def sync():
        import torch

        torch.cuda.synchronize()


def timer(budget_ms: float | None, smoke: bool) -> CudaTimer:
    return CudaTimer(budget_ms=budget_ms or (30.0 if smoke else 100.0))


def ceilings(timer: CudaTimer, tier: str, dtypes) -> dict:
    """Device copy bandwidth (read + write) and cuBLAS GEMM rate per dtype on random data, fastest samples."""
    import torch

    nbytes, n = _SIZES[tier]
    copy = _copy_ms(timer, torch.randn(nbytes // 4, device="cuda"))
    peak = {}
    for dt in sorted(set(dtypes) | {"bfloat16"}):  # random data: zeros run faster than real data on some GPUs
        tdt = getattr(torch, dt)
        a, b = torch.randn(n, n, device="cuda", dtype=tdt), torch.randn(n, n, device="cuda", dtype=tdt)
        peak[dt] = 2 * n**3 / (min(timer.samples(lambda a=a, b=b: torch.matmul(a, b))) * 1e9)
        del a, b
    tf32 = torch.backends.cuda.matmul.allow_tf32
    return {"copy_GBps": 2 * nbytes / (copy * 1e6), "matmul_TFLOPs": peak, "default_dtype": "bfloat16",
            "detail": {"copy": f"torch copy_ of {nbytes >> 20} MiB on the device (read + write counted), fastest sample",
                       "matmul": f"torch.matmul (cuBLAS) {n}^3 on random data, fastest sample; float32 with "
                                 f"allow_tf32={tf32}"}}


def _copy_ms(timer: CudaTimer, src) -> float:
    """The fastest device copy of `src` into a second buffer (both freed on return)."""
    dst = src * 0 + 1
    return min(timer.samples(lambda: dst.copy_(src)))


def device() -> dict:
    import torch

    idx = torch.cuda.current_device()
    p = torch.cuda.get_device_properties(idx)
    return {"kind": "cuda", "name": p.name, "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
            "l2_MiB": round(getattr(p, "L2_cache_size", 0) / 2**20, 1), "memory_GiB": round(p.total_memory / 2**30, 1),
            "cudnn": torch.backends.cudnn.version(), "clocks_start": gpu_clocks()}


def device_end() -> dict:
    """What the device record gains after the run: the clocks, to show throttling."""
    return {"clocks_end": gpu_clocks()}


def gpu_clocks() -> dict:
    """nvidia-smi's current clocks, power and temperature (a query only: nothing is set)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"note": "nvidia-smi not found; clocks not readable"}
    try:
        out = subprocess.run([smi, f"--query-gpu={','.join(_SMI_FIELDS)}", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return {"note": f"nvidia-smi failed: {e}"}
    vals = [x.strip() for x in out.split(",")]
    return dict(zip(_SMI_FIELDS, vals)) if len(vals) == len(_SMI_FIELDS) else {"note": f"unparsed: {out[:200]}"}
