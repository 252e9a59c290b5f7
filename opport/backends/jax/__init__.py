"""jax backend: each op's JAX formulation (jax.numpy), compiled by XLA, for JAX arrays on the CPU.

Selected automatically for JAX arrays (its `array_kind` is theirs) for the ops it has a module for, and by name
(`backend="jax"`, `opport.use_backend("jax")`, OPPORT_BACKEND=jax) for any array, like any backend; under
`jax.jit` and `jax.grad` its kernels are traced into the caller's computation (no host callback:
opport/integrations/jax.py, docs/integration.md). float64 needs `jax_enable_x64` (a kernel declines it without).
"""

from opport.dispatch.registry import Backend, Capabilities
from opport.dtypes import FLOATS


def _probe() -> str | None:
    try:
        import jax  # noqa: F401
    except ImportError as e:
        return f"jax is not installed ({e})"
    return None


def _versions() -> dict:
    import jax
    import jaxlib

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__}


BACKEND = Backend(
    name="jax",
    package=__name__,
    array_kind="jax",
    device_types=("cpu",),
    dtypes=FLOATS,
    probe=_probe,
    mode=lambda: "xla-cpu",
    versions=_versions,
    hint="pip install 'opport[jax]'",
    capabilities=Capabilities(compiles_per_shape=True),
)
