"""Timers (docs/performance.md section 5): CUDA events with a cold L2, CUDA-graph replay, host timing on CPUs.

Every timer returns raw samples in milliseconds; `summarize` turns pooled samples (from interleaved
rounds over the providers) into median and p20/p80. Warm-up, compilation and autotuning happen in
the provider's first call, before any timer runs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Timing:
    ms: float  # median
    p20_ms: float
    p80_ms: float
    n: int

    @property
    def spread(self) -> float:
        """(p80 - p20) / median: the noise a difference must exceed to mean something."""
        return (self.p80_ms - self.p20_ms) / self.ms if self.ms > 0 else math.inf


def summarize(samples_ms) -> Timing:
    a = np.asarray(samples_ms, dtype=np.float64)
    p20, p50, p80 = np.quantile(a, [0.2, 0.5, 0.8])
    return Timing(float(p50), float(p20), float(p80), int(a.size))


class CpuTimer:
    """perf_counter around repeated calls on warm caches; a sample averages enough calls to last >= 0.2 ms."""

    device = "cpu"
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


class CudaTimer:
    """`triton.testing.do_bench` (CUDA events, L2 flushed before every call) and `do_bench_cudagraph`."""

    device = "cuda"

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

    def graph(self, fn, rep_ms: float = 20.0) -> Timing:
        from triton.testing import do_bench_cudagraph

        return summarize(do_bench_cudagraph(fn, rep=rep_ms, return_mode="all"))

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

    @staticmethod
    def sync():
        import torch

        torch.cuda.synchronize()
