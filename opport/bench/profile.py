"""What `opport bench` needs to know about a backend, declared by the backend.

A backend names a module in `Backend.capabilities.bench` (found by name, as kernel modules are); that
module says how to measure it. Every attribute is optional, with the default in brackets:

    TIER [small], DTYPES [("float32",)]  the default shape tier and dtypes of a run
    MAX_MINUTES [None]                   stop starting new shapes after this long
    COMPILE_BASELINE [False]             time torch.compile of the torch baseline too
    GRAPHS [False]                       add CUDA-graph replay and host time for launch-bound shapes
    unsupported(mode) -> str | None      why this mode cannot be benchmarked
    device() -> dict                     what the report records about the device; device_end(): added after the run

and one way to measure:

    timer(budget_ms, smoke) -> a timer   real execution: `samples(fn, budget_ms)` -> ms, `method` (dict),
                                         `budget_ms`, `sync()`; optionally `graph(fn)` -> ms samples,
                                         `host_us(fn)`, `peak_mb(fn)`
    ceilings(timer, tier, dtypes) -> dict   copy_GBps, matmul_TFLOPs {dtype: rate}, default_dtype, detail
    counters() -> context manager        an emulated device: its value's `as_dict()` holds the counts of the
                                         calls made inside; BYTES_COUNTER names the one compared with the
                                         op's minimum bytes, COUNTER_COLUMNS the ones printed, COUNTS_MEANING
                                         what they are

A backend that runs emulated here (`capabilities.emulated()`) is never timed (that would time this CPU,
not the device): it reports counts, or nothing. A backend without a bench module gets a message saying so.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


class Unsupported(Exception):
    """The backend cannot be benchmarked here; the message says why."""


@dataclass(frozen=True)
class Profile:
    backend: object  # the registry's Backend
    mode: str
    module: ModuleType
    measures: str  # "time" or "counts"

    def get(self, name: str, default=None):
        return getattr(self.module, name, default)

    @property
    def tier(self) -> str:
        return self.get("TIER", "small")

    @property
    def dtypes(self) -> tuple:
        return tuple(self.get("DTYPES", ("float32",)))

    @property
    def max_minutes(self) -> float | None:
        return self.get("MAX_MINUTES")

    @property
    def compile_baseline(self) -> bool:
        return bool(self.get("COMPILE_BASELINE", False))

    @property
    def graphs(self) -> bool:
        return bool(self.get("GRAPHS", False))

    @property
    def input_device(self) -> str:
        """Where the run's inputs live: the backend's torch device for torch kernels, else host memory."""
        return self.backend.torch_device() if self.backend.array_kind == "torch" else "cpu"

    def device(self) -> dict:
        found = self.get("device")
        return found() if found else {"kind": self.backend.name, "name": f"{self.backend.name} ({self.mode})"}

    def device_end(self) -> dict:
        found = self.get("device_end")
        return found() if found else {}


def profile(backend) -> Profile:
    """The backend's bench profile, or `Unsupported` with the reason it cannot be benchmarked here."""
    reason = backend.unavailable()
    if reason:
        raise Unsupported(reason)
    mode = backend.mode()
    name = backend.capabilities.bench
    if name is None:
        raise Unsupported(f"backend {backend.name!r} declares no bench module (Capabilities(bench=...) in its package's "
                          "__init__.py), so opport bench does not know how to time it (docs/adding-a-backend.md)")
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        raise Unsupported(f"its bench module {name!r} cannot be imported: {e}") from e
    why = module.unsupported(mode) if hasattr(module, "unsupported") else None
    if why:
        raise Unsupported(why)
    return Profile(backend, mode, module, _measures(backend, mode, module))


def declared(backend) -> Profile:
    """The backend's bench module, without judging this machine: what the driver of a cluster run plans with
    (default tier and dtypes); each host of the run then checks itself with `profile` (opport/fleet/bench.py)."""
    name = backend.capabilities.bench
    if name is None:
        raise Unsupported(f"backend {backend.name!r} declares no bench module (Capabilities(bench=...))")
    try:
        return Profile(backend, "declared", importlib.import_module(name), "declared")
    except ImportError as e:
        raise Unsupported(f"its bench module {name!r} cannot be imported: {e}") from e


def _measures(backend, mode: str, module: ModuleType) -> str:
    if backend.capabilities.emulated():
        if hasattr(module, "counters"):
            return "counts"
        raise Unsupported(f"mode {mode!r} emulates the device on this CPU, so its timings would mean nothing, and "
                          f"{module.__name__} declares no counters to report instead")
    if hasattr(module, "timer") and hasattr(module, "ceilings"):
        return "time"
    raise Unsupported(f"{module.__name__} declares no timer and ceilings for mode {mode!r}")
