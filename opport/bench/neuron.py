"""neuron: what the bench can say without Trainium hardware.

In opport's NKI emulator there is no time: it reports, per call, the DMA bytes the kernel moved
(against the op's minimum bytes from its cost model) and the instructions it issued per engine.
These are counts, not speed. On hardware (`mode == "hardware"`) device-side timing belongs to the
Neuron SDK's profiler (docs/performance.md 5.10), which this suite does not drive yet.
"""

from __future__ import annotations

import contextlib


def emulator_stats():
    """The emulator's `collect_stats` context manager, or None when the emulator does not expose counters."""
    try:
        from opport.backends.neuron.emulator.runtime import collect_stats
    except ImportError:
        return None
    return collect_stats


@contextlib.contextmanager
def stats_block():
    collect = emulator_stats()
    if collect is None:
        raise RuntimeError("the neuron emulator exposes no counters (opport.backends.neuron.emulator.runtime.collect_stats)")
    with collect() as stats:
        yield stats


def unsupported_reason(mode: str) -> str | None:
    """Why `opport bench --backend neuron` cannot report in this mode, or None."""
    if mode == "emulator":
        return None if emulator_stats() is not None else "the neuron emulator exposes no DMA/instruction counters yet"
    return (f"neuron mode {mode!r}: device-side timing through the Neuron SDK profiler (nki.benchmark / neuron-profile) "
            "is not wired into opport bench yet; the emulator mode reports DMA and instruction counts")
