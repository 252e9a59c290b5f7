"""cpu backend: NumPy kernels (bfloat16 through ml_dtypes). Always available; the fallback."""

import numpy as np

from opport.dispatch.registry import Backend, Capabilities
from opport.dtypes import FLOATS


def _versions() -> dict:
    import ml_dtypes

    return {"numpy": np.__version__, "ml_dtypes": ml_dtypes.__version__}


BACKEND = Backend(
    name="cpu",
    package=__name__,
    array_kind="numpy",
    device_types=("cpu",),
    dtypes=FLOATS,
    probe=lambda: None,
    mode=lambda: "numpy",
    versions=_versions,
    capabilities=Capabilities(bench=f"{__name__}.bench", batch_invariant=True),
    guest=lambda kind: _guest(kind),
)


def _guest(kind: str):
    from opport.backends.cpu._common import guest

    return guest(kind)
