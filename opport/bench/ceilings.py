"""The roofs every row is measured against, measured in the same run (docs/performance.md sections 1 and 5).

Each backend's bench module measures them (opport/bench/profile.py): copy bandwidth from one large copy,
bytes read + bytes written; compute from a large matrix product through the vendor library, per dtype
on random data (zeros run faster than real data on some GPUs). A row's floor is
max(bytes / copy rate, flops / matmul rate); roofline_pct = floor / measured time. A ceiling takes the
fastest sample, not the median: it is what the machine can reach, and on a shared machine the median of
a ceiling run understates it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
