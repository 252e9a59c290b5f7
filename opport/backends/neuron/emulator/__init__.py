"""opport's NumPy emulator of the NKI >= 0.3 API subset in docs/nki.md section 3 (`nki`, `nki.language`, `nki.isa`).

It runs kernels written against the real API unchanged on CPUs, enforces the hardware constraints of
docs/nki.md section 2 (raising NkiValidationError, an AssertionError), fills new allocations with NaN,
computes in float32 with casts to the destination dtype, and counts DMA bytes and instructions per
engine for every kernel call. See docs/neuron.md.

    from opport.backends.neuron import emulator as nki
    nl, nisa = nki.language, nki.isa
"""

from opport.backends.neuron.emulator import isa, language
from opport.backends.neuron.emulator.errors import NkiCapacityWarning, NkiValidationError, NkiWarning
from opport.backends.neuron.emulator.jit import Kernel, jit, simulate
from opport.backends.neuron.emulator.runtime import KernelStats, collect_stats, last_stats, strict
from opport.backends.neuron.emulator.target import TARGETS, set_target, use_target
from opport.backends.neuron.emulator.target import current as current_target

isa.NkiValidationError = NkiValidationError

__all__ = [
    "isa", "language", "jit", "simulate", "Kernel", "NkiValidationError", "NkiWarning", "NkiCapacityWarning",
    "KernelStats", "last_stats", "collect_stats", "strict", "TARGETS", "set_target", "use_target", "current_target",
]
