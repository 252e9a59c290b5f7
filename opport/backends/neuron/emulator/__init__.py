"""opport's NumPy emulator of the NKI >= 0.3 API subset in docs/nki.md section 3 (`nki`, `nki.language`, `nki.isa`).

It runs kernels written against the real API unchanged on CPUs, enforces the hardware constraints of
docs/nki.md section 2 (raising NkiValidationError, an AssertionError), fills new allocations with NaN,
computes in float32 with casts to the destination dtype, and counts DMA bytes and instructions per
engine for every kernel call. See docs/neuron.md.

    from opport.backends.neuron import emulator as nki
    nl, nisa = nki.language, nki.isa
"""

import contextlib
import sys

from opport.backends.neuron.emulator import constants, dtype, isa, language, typing
from opport.backends.neuron.emulator.errors import NkiCapacityWarning, NkiValidationError, NkiWarning
from opport.backends.neuron.emulator.jit import Kernel, jit, simulate
from opport.backends.neuron.emulator.runtime import KernelStats, collect_stats, last_stats, strict
from opport.backends.neuron.emulator.target import TARGETS, set_target, use_target
from opport.backends.neuron.emulator.target import current as current_target

isa.NkiValidationError = NkiValidationError

# import-time module names AWS kernel modules use, as `nki.<name>`
_AS_NKI = {"nki.language": language, "nki.isa": isa, "nki.isa.constants": constants, "nki.dtype": dtype,
           "nki.typing": typing}


@contextlib.contextmanager
def as_nki():
    """Make `import nki`, `import nki.language as nl`, `from nki.isa.constants import oob_mode`, `from nki.dtype
    import ...` and `import nki.typing as nt` resolve to this emulator inside the block (to import AWS kernel
    modules unchanged, as nki-library's tests alias their simulator); sys.modules is restored afterwards."""
    saved = {n: sys.modules.get(n) for n in ("nki", *_AS_NKI)}  # whatever was there (even an SDK) comes back
    sys.modules.update({"nki": sys.modules[__name__], **_AS_NKI})
    try:
        yield sys.modules[__name__]
    finally:
        for n, module in saved.items():
            if module is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = module


__all__ = [
    "isa", "language", "constants", "dtype", "typing", "as_nki", "jit", "simulate", "Kernel", "NkiValidationError",
    "NkiWarning", "NkiCapacityWarning", "KernelStats", "last_stats", "collect_stats", "strict", "TARGETS", "set_target",
    "use_target", "current_target",
]
