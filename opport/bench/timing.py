"""Timing statistics (docs/performance.md section 5).

The timers belong to the backends (their bench modules, opport/bench/profile.py: host perf_counter for
cpu, CUDA events with a cold L2 and CUDA-graph replay for cuda). Every timer returns raw samples in
milliseconds; `summarize` turns pooled samples (from interleaved rounds over the providers) into median
and p20/p80. Warm-up, compilation and autotuning happen in the provider's first call, before any timer runs.
"""

from __future__ import annotations

import math
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
