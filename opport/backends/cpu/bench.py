"""How `opport bench` measures the cpu backend (the protocol is in opport/bench/profile.py).

Host timing on warm caches; ceilings from one large memory copy and NumPy's BLAS; the device record
names the CPU and the kernels' thread pool. Any backend whose kernels run synchronously on this CPU may
name this module as its `Capabilities.bench`.
"""

from __future__ import annotations

import math
import os
import platform
import sys
import time

import numpy as np

TIER = "small"
DTYPES = ("float32",)
COMPILE_BASELINE = False  # torch.compile's Inductor needs a C++ compiler on CPUs
# problem sizes of the ceilings per tier: (copy bytes, square GEMM side)
_SIZES = {"smoke": (32 << 20, 256), "small": (256 << 20, 1024), "llm": (256 << 20, 1024)}


class HostTimer:
    """perf_counter around repeated calls on warm caches; a sample averages enough calls to last >= 0.2 ms."""

    min_sample_s = 2e-4

    def __init__(self, budget_ms: float = 200.0, warmup_ms: float = 20.0, min_samples: int = 5):
        self.budget_ms, self.warmup_ms, self.min_samples = budget_ms, warmup_ms, min_samples

    @property
    def method(self) -> dict:
        return {"timer": "time.perf_counter (host)", "cache": "warm (repeated calls on the same inputs)",
                "statistic": "median with p20/p80 of samples pooled over interleaved rounds",
                "warmup_ms": self.warmup_ms, "budget_ms_per_provider": self.budget_ms}

    def samples(self, fn, budget_ms: float | None = None) -> list:
        budget_s = (budget_ms or self.budget_ms) / 1e3
        t0 = time.perf_counter()
        fn()
        calls, one = 1, time.perf_counter() - t0
        while time.perf_counter() - t0 < self.warmup_ms / 1e3 and calls < 50:
            fn()
            calls += 1
        one = max((time.perf_counter() - t0) / calls, 1e-9) if calls > 1 else one
        batch = max(1, math.ceil(self.min_sample_s / one))
        out, start = [], time.perf_counter()
        while len(out) < self.min_samples or (time.perf_counter() - start < budget_s and len(out) < 5000):
            s = time.perf_counter()
            for _ in range(batch):
                fn()
            out.append((time.perf_counter() - s) * 1e3 / batch)
        return out

    def sync(self):
        """Nothing to wait for: host kernels have finished when they return."""

    @staticmethod
    def peak_mb(fn) -> float:
        """Memory the call allocates at its peak beyond what was allocated before it: NumPy's and Python's
        allocations (tracemalloc) plus, with torch loaded, its CPU allocator's (torch.profiler's memory events, which
        tracemalloc cannot see) in a second call: the sum of the two peaks bounds the call's."""
        import tracemalloc

        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            fn()
            peak = tracemalloc.get_traced_memory()[1] - before
        finally:
            tracemalloc.stop()
        torch = sys.modules.get("torch")  # a second call, apart: the profiler's own Python objects are not the call's
        return round((peak + (_torch_cpu_peak(torch, fn) if torch is not None else 0)) / 2**20, 2)


def _torch_cpu_peak(torch, fn) -> int:
    """Peak bytes torch's CPU allocator holds during fn() beyond its start, from the profiler's events in time order:
    an op's net allocation at its start, its net free at its end (autograd's evaluate_function frees its inputs
    after its inner ops allocated: at its start the peak would be missed), "[memory]" frees where they happen."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    deltas = []
    for e in prof.events():
        d = e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        deltas.append((e.time_range.start if d > 0 or e.name == "[memory]" else e.time_range.end, d))
    deltas.sort()
    held = peak = 0
    for _, d in deltas:
        held += d
        peak = max(peak, held)
    return peak


def timer(budget_ms: float | None, smoke: bool) -> HostTimer:
    return HostTimer(budget_ms=budget_ms or (30.0 if smoke else 200.0), warmup_ms=5.0 if smoke else 20.0)


def ceilings(timer: HostTimer, tier: str, dtypes) -> dict:
    """Copy bandwidth (read + write) and BLAS GEMM rate per dtype, each the fastest sample."""
    nbytes, n = _SIZES[tier]
    copy = _copy_ms(timer, np.ones(nbytes // 4, np.float32))  # ones: every page really mapped
    rng = np.random.default_rng(0)
    blas = {}
    for dt in sorted({"float64" if d == "float64" else "float32" for d in dtypes}):
        a, b = rng.standard_normal((n, n)).astype(dt), rng.standard_normal((n, n)).astype(dt)
        blas[dt] = 2 * n**3 / (min(timer.samples(lambda a=a, b=b: a @ b)) * 1e9)
    return {"copy_GBps": 2 * nbytes / (copy * 1e6), "matmul_TFLOPs": blas, "default_dtype": "float32",
            "detail": {"copy": f"np.copyto of {nbytes >> 20} MiB (read + write counted), fastest sample",
                       "matmul": f"NumPy BLAS {n}^3, fastest sample; 16-bit rows use the float32 rate (NumPy has no "
                                 "16-bit BLAS)"}}


def _copy_ms(timer: HostTimer, src: np.ndarray) -> float:
    """The fastest copy of `src` into a second buffer (both freed on return)."""
    dst = src * 0 + 1
    return min(timer.samples(lambda: np.copyto(dst, src)))


def device() -> dict:
    """The CPU, its clock, and the threads of opport's kernels, of BLAS and of torch's CPU eager baseline."""
    from opport.backends.cpu._common import blas_limit, num_threads

    info = {"kind": "cpu", "name": platform.processor() or platform.machine(), "logical_cpus": os.cpu_count(),
            "threads": {"opport": num_threads()}}  # the cpu kernels' budget, pool and BLAS (OPPORT_NUM_THREADS)
    blas = blas_limit()
    if blas is not None:  # BLAS's own limit outside opport's calls (the NumPy baseline's); opport's get min(it, opport)
        info["threads"]["blas"] = blas
    torch = sys.modules.get("torch")
    if torch is not None:
        info["threads"]["torch"] = torch.get_num_threads()
    info.update(_cpuinfo())
    return info


def _cpuinfo() -> dict:
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    names = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")]
    mhz = [float(ln.split(":", 1)[1]) for ln in lines if ln.startswith("cpu MHz")]
    out = {"name": names[0]} if names else {}
    if mhz:
        out["clocks"] = {"cpu_MHz_mean": round(sum(mhz) / len(mhz), 1)}
    return out
