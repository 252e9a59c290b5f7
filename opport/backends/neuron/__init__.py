"""neuron backend: NKI kernels (NKI >= 0.3 API) run on hardware, the SDK simulator, or opport's emulator.

Importing this package stays cheap: the SDK probe and the emulator load only when the backend is asked.
"""

import contextlib
import os

from opport.dispatch.registry import Backend, Capabilities


def _compat():
    from opport.backends.neuron import nki_compat

    return nki_compat


def _probe():
    return _compat().UNAVAILABLE  # None: the emulator always works unless OPPORT_NKI=real finds no SDK


def _mode() -> str:
    return _compat().MODE


def _capacity_checked():
    """Over-subscribed SBUF/PSUM as an error in the emulator (it warns by default); nothing on the real SDK,
    whose compiler refuses such a kernel by itself."""
    compat = _compat()
    return compat.nki.strict() if compat.EMULATED else contextlib.nullcontext()


def _versions() -> dict:
    import ml_dtypes
    import numpy as np

    return {**_compat().versions(), "numpy": np.__version__, "ml_dtypes": ml_dtypes.__version__,
            "OPPORT_NKI": os.environ.get("OPPORT_NKI", "auto")}


BACKEND = Backend(
    name="neuron",
    package=__name__,
    array_kind="numpy",
    device_types=("xla", "neuron"),
    dtypes=("float32", "float16", "bfloat16"),
    probe=_probe,
    mode=_mode,
    versions=_versions,
    hint="Install the Neuron SDK (`nki`, `neuronx-cc` from AWS's Neuron pip index) for hardware or simulator mode, "
         "or unset OPPORT_NKI to use opport's emulator.",
    capabilities=Capabilities(
        emulated=lambda: _mode() in ("emulator", "simulator"),
        max_workers=lambda: 4 if _mode() in ("hardware", "simulator") else None,  # one device (or SDK simulator) shared
        bench=f"{__name__}.bench",
        device_resource="neuron_cores",  # the custom resource Trainium/Inferentia nodes declare in Ray
        checked=_capacity_checked,
    ),
)
