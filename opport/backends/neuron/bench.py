"""How `opport bench` reports the neuron backend (the protocol is in opport/bench/profile.py).

opport's NKI emulator has no clock: per call it counts the DMA bytes the kernel moved (compared with the
op's minimum bytes from its cost model) and the instructions it issued per engine. These are counts, not
speed. On hardware, device-side timing belongs to the Neuron SDK's profiler (docs/performance.md 5.10),
which opport bench does not drive yet; the SDK's simulator exposes no counters.
"""

from __future__ import annotations

TIER = "smoke"
DTYPES = ("float32",)
BYTES_COUNTER = "hbm_bytes"  # the counter compared with the op's minimum bytes
COUNTER_COLUMNS = ("hbm_bytes", "dma_transfers", "instructions")  # what the terminal table shows per row
COUNTS_MEANING = "emulator counts (DMA bytes, instructions per engine), not speed"


def _compat():
    from opport.backends.neuron import nki_compat

    return nki_compat


def unsupported(mode: str) -> str | None:
    if mode == "emulator":
        return None if _compat().EMULATED else "the neuron emulator exposes no DMA/instruction counters"
    return (f"neuron mode {mode!r}: device-side timing through the Neuron SDK profiler (nki.benchmark / neuron-profile) "
            "is not wired into opport bench yet; the emulator mode reports DMA and instruction counts")


def counters():
    """A context manager whose value's `as_dict()` holds the counts of every kernel call made inside it."""
    return _compat().collect_stats()


def device() -> dict:
    return {"kind": "neuron", "name": f"NKI emulator ({_compat().MODE})"}
