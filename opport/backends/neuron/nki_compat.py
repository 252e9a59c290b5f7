"""The one place kernels get `nki`, `nl` (nki.language) and `nisa` (nki.isa) from.

Resolution: the real NKI SDK (>= 0.3) when a genuine one is installed, else opport's NumPy emulator.
A genuine SDK is recognised by its features (nki.jit, nki.simulate, nki.language.tile_size,
nki.isa.nc_matmul), never by its version, so the PyPI placeholder `nki` 0.0.1 is rejected.
`OPPORT_NKI=real|emu` overrides the choice. Kernel modules bind the module objects:

    from opport.backends.neuron.nki_compat import nki, nl, nisa

MODE is "hardware" (SDK + a Neuron device), "simulator" (SDK on a CPU host: `nki.simulate`) or
"emulator"; `run(kernel, *arrays)` runs a jitted kernel on NumPy arrays in that mode.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os

from opport.backends.neuron import emulator as _emulator


def probe_real_sdk():
    """(nki module, None) for a genuine NKI >= 0.3 SDK, else (None, why not)."""
    if importlib.util.find_spec("nki") is None:
        return None, "the NKI SDK (`nki` package) is not installed"
    try:
        mod = importlib.import_module("nki")
        lang = importlib.import_module("nki.language")
        isa = importlib.import_module("nki.isa")
    except Exception as e:  # a broken or placeholder install
        return None, f"`import nki` failed: {type(e).__name__}: {e}"
    missing = [n for n, ok in (("nki.jit", callable(getattr(mod, "jit", None))),
                               ("nki.simulate", callable(getattr(mod, "simulate", None))),
                               ("nki.language.tile_size", hasattr(lang, "tile_size")),
                               ("nki.isa.nc_matmul", callable(getattr(isa, "nc_matmul", None)))) if not ok]
    if missing:
        return None, f"the installed `nki` package is not the NKI SDK >= 0.3 (lacks {', '.join(missing)})"
    return mod, None


def neuron_device_present() -> bool:
    return bool(glob.glob("/dev/neuron[0-9]*"))


def _resolve():
    choice = os.environ.get("OPPORT_NKI", "").strip().lower()
    if choice not in ("", "real", "emu"):
        return _emulator, "emulator", f"OPPORT_NKI must be 'real' or 'emu', got {choice!r}"
    if choice == "emu":
        return _emulator, "emulator", None
    real, why = probe_real_sdk()
    if real is None:
        # OPPORT_NKI=real without an SDK: the backend reports itself unavailable with the reason
        return _emulator, "emulator", (f"OPPORT_NKI=real but {why}" if choice == "real" else None)
    return real, ("hardware" if neuron_device_present() else "simulator"), None


nki, MODE, UNAVAILABLE = _resolve()
nl = nki.language
nisa = nki.isa
BACKEND = "emulator" if nki is _emulator else "nki"
EMULATED = nki is _emulator


def run(kernel, *args, **kwargs):
    """Run a jitted kernel on NumPy arrays in the active mode; returns NumPy arrays."""
    if MODE == "simulator":
        return nki.simulate(kernel)(*args, **kwargs)
    return kernel(*args, **kwargs)  # hardware: standalone compile + run; emulator: NumPy


def last_stats():
    """DMA bytes / instruction counts of the last kernel call (emulator only; None otherwise)."""
    return _emulator.last_stats() if EMULATED else None


def collect_stats():
    """Context manager aggregating every kernel call's statistics (emulator only)."""
    if not EMULATED:
        raise RuntimeError(f"kernel statistics are collected by the opport emulator only (MODE={MODE!r})")
    return _emulator.collect_stats()


def versions() -> dict:
    out = {"nki": "opport-emulator" if EMULATED else getattr(nki, "__version__", "unknown")}
    if EMULATED:
        out["target"] = _emulator.current_target().name
    return out
