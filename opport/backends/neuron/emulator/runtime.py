"""Per-kernel-call state: statistics, engine accumulator registers, SBUF/PSUM occupancy, LNC program id.

State is thread-local. Each kernel call opens a `Run`; nisa/nl calls made outside a kernel use an
implicit per-thread run, so single instructions can be tried out interactively.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np

from opport.backends.neuron.emulator import target as _target
from opport.backends.neuron.emulator.errors import NkiCapacityWarning, NkiValidationError, warn
from opport.backends.neuron.emulator.target import PMAX, PSUM_BANK_BYTES

ENGINES = ("tensor", "vector", "scalar", "gpsimd", "dma")


@dataclass
class KernelStats:
    """What one kernel call (or several, when aggregated) did: DMA traffic and instructions per engine."""

    kernel: str = ""
    target: str = ""
    calls: int = 0
    dma_transfers: int = 0
    dma_bytes: int = 0  # bytes written by all DMA transfers (HBM and SBUF destinations)
    hbm_read_bytes: int = 0
    hbm_write_bytes: int = 0
    instructions: dict = field(default_factory=lambda: dict.fromkeys(ENGINES, 0))
    peak_sbuf_bytes: int = 0  # per partition, live tiles
    peak_psum_bytes: int = 0  # per partition, live tiles rounded up to 2 KiB banks

    @property
    def hbm_bytes(self) -> int:
        return self.hbm_read_bytes + self.hbm_write_bytes

    def merge(self, other: KernelStats) -> None:
        self.kernel = self.kernel or other.kernel
        self.target = self.target or other.target
        self.calls += other.calls
        for name in ("dma_transfers", "dma_bytes", "hbm_read_bytes", "hbm_write_bytes"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for e, n in other.instructions.items():
            self.instructions[e] = self.instructions.get(e, 0) + n
        self.peak_sbuf_bytes = max(self.peak_sbuf_bytes, other.peak_sbuf_bytes)
        self.peak_psum_bytes = max(self.peak_psum_bytes, other.peak_psum_bytes)

    def as_dict(self) -> dict:
        return {
            "kernel": self.kernel, "target": self.target, "calls": self.calls, "dma_transfers": self.dma_transfers,
            "dma_bytes": self.dma_bytes, "hbm_read_bytes": self.hbm_read_bytes, "hbm_write_bytes": self.hbm_write_bytes,
            "hbm_bytes": self.hbm_bytes, "instructions": dict(self.instructions),
            "peak_sbuf_bytes": self.peak_sbuf_bytes, "peak_psum_bytes": self.peak_psum_bytes,
        }


class Run:
    """One kernel invocation (one LNC program)."""

    def __init__(self, name: str = "", program_id: int = 0, num_programs: int = 1, grid_ndim: int = 0):
        # the environment's generation read once per kernel (not per instruction: os.environ is slow); eager code
        # outside a kernel (one run per thread for good) reads it each time; use_target/set_target win in both
        self._env_target = None if name == EAGER else _target.from_env()
        self.stats = KernelStats(kernel=name, target=self.target.name, calls=1)
        self.program_id, self.num_programs, self.grid_ndim = program_id, num_programs, grid_ndim
        # ScalarE / VectorE accumulation registers, one fp32 per lane; NaN until reset so stale reads show
        self.act_regs = np.full(PMAX, np.nan, np.float32)
        self.vec_regs = np.full(PMAX, np.nan, np.float32)
        self.sbuf_live = 0
        self.psum_live = 0
        # explicit placement (nl.ndarray(address=...)): physical bytes per buffer, and the rectangles
        # (p0, p1, f0, f1) claimed, counted by address range for the rest of the run (not by object lifetime)
        self._physical: dict = {}
        self._placed: dict = {"sbuf": set(), "psum": set()}
        self._claimed = {"sbuf": 0, "psum": 0}
        self.shared_allocs: list = []  # shared_hbm tensors in allocation order (LNC programs share them)
        self.shared_from: list | None = None

    @property
    def target(self):
        return _target.current(self._env_target)

    # -- accounting ------------------------------------------------------------------------------
    def count(self, engine: str, n: int = 1):
        self.stats.instructions[engine] += n

    def dma(self, nbytes_dst: int, hbm_read: int, hbm_write: int):
        s = self.stats
        s.dma_transfers += 1
        s.dma_bytes += nbytes_dst
        s.hbm_read_bytes += hbm_read
        s.hbm_write_bytes += hbm_write
        s.instructions["dma"] += 1

    def allocate(self, owner, buffer_name: str, bytes_per_partition: int):
        """Book a new on-chip tile; freed when its storage is garbage collected."""
        if buffer_name == "psum":
            booked = -(-bytes_per_partition // PSUM_BANK_BYTES) * PSUM_BANK_BYTES  # bank-granular
            self.psum_live += booked
        else:
            booked = bytes_per_partition
            self.sbuf_live += booked
        weakref.finalize(owner, self._free, buffer_name, booked)
        self._check_capacity(buffer_name)

    def physical(self, buffer_name: str, partition_bytes: int) -> np.ndarray:
        """The run's physical SBUF/PSUM bytes (partition-major), created on first explicit placement as 0xFF."""
        if buffer_name not in self._physical:
            self._physical[buffer_name] = np.full(PMAX * partition_bytes, 0xFF, np.uint8)
        return self._physical[buffer_name]

    def place(self, buffer_name: str, p0: int, parts: int, f0: int, nbytes: int):
        """Claim an explicitly placed rectangle; tiles at the same or overlapping addresses share the bytes."""
        lo, hi = f0, f0 + nbytes
        if buffer_name == "psum":  # PSUM is booked bank-granular, like emulator-allocated tiles
            lo, hi = lo // PSUM_BANK_BYTES * PSUM_BANK_BYTES, -(-hi // PSUM_BANK_BYTES) * PSUM_BANK_BYTES
        rect = (p0, p0 + parts, lo, hi)
        if rect not in self._placed[buffer_name]:
            self._placed[buffer_name].add(rect)
            self._claimed[buffer_name] = _claimed_bytes(self._placed[buffer_name])
        self._check_capacity(buffer_name)

    def _check_capacity(self, buffer_name: str):
        auto = self.psum_live if buffer_name == "psum" else self.sbuf_live
        placed = self._claimed[buffer_name]
        live = auto + placed
        peak = "peak_psum_bytes" if buffer_name == "psum" else "peak_sbuf_bytes"
        setattr(self.stats, peak, max(getattr(self.stats, peak), live))
        cap = self.target.psum_partition_bytes if buffer_name == "psum" else self.target.sbuf_partition_bytes
        if live > cap:
            msg = (f"live {buffer_name.upper()} tiles need {live} bytes per partition ({auto} allocated, {placed} "
                   f"placed by address), more than the {cap} bytes {self.target.name} has")
            if strict_enabled():
                raise NkiValidationError(f"nl.ndarray: {msg}")
            warn("nl.ndarray", msg + " (an error under emulator.strict())", NkiCapacityWarning)

    def _free(self, buffer_name: str, booked: int):
        if buffer_name == "psum":
            self.psum_live -= booked
        else:
            self.sbuf_live -= booked


def _claimed_bytes(rects) -> int:
    """Most bytes any one partition has claimed: per band of partitions, the union of the free-byte ranges."""
    bounds = sorted({b for p0, p1, _, _ in rects for b in (p0, p1)})
    best = 0
    for lo, hi in zip(bounds, bounds[1:]):
        spans = sorted((f0, f1) for p0, p1, f0, f1 in rects if p0 <= lo and hi <= p1)
        total, end = 0, -1
        for f0, f1 in spans:
            total += max(0, f1 - max(f0, end))
            end = max(end, f1)
        best = max(best, total)
    return best


_local = threading.local()


EAGER = "<eager>"  # the run of instructions called outside any kernel


def current() -> Run:
    run = getattr(_local, "run", None)
    if run is None:
        run = _local.run = Run(EAGER)
    return run


@contextlib.contextmanager
def kernel_run(name: str, program_id: int = 0, num_programs: int = 1, grid_ndim: int = 0, shared_from=None):
    """Open the run of one LNC program; the caller records the statistics (record())."""
    outer = getattr(_local, "run", None)
    run = Run(name, program_id, num_programs, grid_ndim)
    run.shared_from = shared_from
    _local.run = run
    try:
        yield run
    finally:
        _local.run = outer


# -- statistics API ----------------------------------------------------------------------------------
def record(stats: KernelStats):
    """Publish a finished kernel call's statistics to last_stats() and open collect_stats() blocks."""
    _local.last = stats
    for sink in getattr(_local, "sinks", ()):
        sink.merge(stats)


def last_stats() -> KernelStats | None:
    """Statistics of the most recent kernel call on this thread."""
    return getattr(_local, "last", None)


@contextlib.contextmanager
def collect_stats():
    """Aggregate the statistics of every kernel call made inside the block (host wrappers call many)."""
    sink = KernelStats()
    _local.sinks = (*getattr(_local, "sinks", ()), sink)
    try:
        yield sink
    finally:
        _local.sinks = tuple(s for s in _local.sinks if s is not sink)


# -- strict mode ---------------------------------------------------------------------------------------
def strict_enabled() -> bool:
    flag = getattr(_local, "strict", None)
    if flag is None:
        return os.environ.get("OPPORT_NKI_STRICT", "") not in ("", "0")
    return flag


@contextlib.contextmanager
def strict(enabled: bool = True):
    """Make capacity over-subscription (a warning by default) an NkiValidationError."""
    old = getattr(_local, "strict", None)
    _local.strict = enabled
    try:
        yield
    finally:
        _local.strict = old
