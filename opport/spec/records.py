"""What validation sees of an array (its metadata, never its data), and the records a declaration is made of:
tolerances, costs, conformance cases and bad inputs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class Meta:
    """What validation and `supports(...)` may look at: an array's metadata, never its data."""

    __slots__ = ("kind", "dtype", "shape", "strides", "device")

    def __init__(self, kind: str, dtype: str, shape: tuple, strides: tuple | None, device: str):
        self.kind, self.dtype, self.shape = kind, dtype, tuple(shape)
        self.strides, self.device = strides, device  # strides in elements; None = contiguous

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    @property
    def contiguous(self) -> bool:
        return self.strides is None or self.strides == contiguous_strides(self.shape)

    def __repr__(self):
        return f"Meta({self.kind}, {self.dtype}, shape={self.shape}, strides={self.strides}, {self.device})"


def contiguous_strides(shape: tuple) -> tuple:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class Tolerance:
    """How an output is compared with the float64 reference (docs/numerics.md section 3).

    metric: "elementwise" |a-r| <= atol + rtol*|r|; "normwise" |a-r| <= atol + rtol*max|r|
    (K-accumulating ops); "ulp_or_abs" passes where the error is <= `ulp` units in the last
    place of the dtype or <= atol (composite activations near cancellation).
    NaN positions and signed infinities are always exact; signed zeros too where `signed_zero`.
    """

    rtol: float
    atol: float
    metric: str = "elementwise"
    ulp: float | None = None
    reason: str = ""
    signed_zero: bool = False  # the reference defines the sign of its zeros (elementwise ops): check it exactly


# docs/numerics.md section 3.2
BASE_TOLERANCE = {
    "float64": Tolerance(1e-7, 1e-7),
    "float32": Tolerance(1.3e-6, 1e-5),
    "float16": Tolerance(1e-3, 1e-5),
    "bfloat16": Tolerance(1.6e-2, 1e-5),
}


@dataclass(frozen=True)
class Cost:
    """Minimum bytes a fused kernel must move (read + write once) and the FLOPs it performs."""

    bytes: int
    flops: int


@dataclass
class Case:
    """One conformance input: NumPy arrays already in the dtype under test, plus scalars."""

    name: str
    args: tuple
    kwargs: dict = field(default_factory=dict)
    tags: tuple = ()
    tolerance: Tolerance | None = None  # per-case override; must carry a reason


@dataclass
class ErrorCase:
    """A bad input and the typed error it must raise before any kernel runs."""

    constraint: str
    error: type
    args: tuple
    kwargs: dict = field(default_factory=dict)


