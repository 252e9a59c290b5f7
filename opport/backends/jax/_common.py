"""What the jax backend's kernels share: registration (jitted, the scalar arguments static) and the working dtype."""

import jax
import jax.numpy as jnp

from opport.dispatch import impl

_SIXTEEN = (jnp.float16, jnp.bfloat16)


def kernel(spec, traced: tuple = ()):
    """Register the decorated jnp function as the jax backend's kernel for `spec`, jitted with the op's scalar
    arguments static (offset: a constant of the compiled computation, which Python code may branch on), except those
    named in `traced` (eps: only ever arithmetic, so one compilation per shape serves every value; XLA compiles
    take ~0.2 s each). Under a trace it is inlined."""

    def register(fn):
        static = tuple(i for i in spec.scalar_pos if spec.params[i] not in traced)
        impl(spec, "jax", supports=_x64, name=f"jax.{fn.__name__}")(jax.jit(fn, static_argnums=static))
        return fn

    return register


def _x64(*metas) -> str | None:
    """float64 only where JAX keeps it (jax_enable_x64); otherwise JAX would compute in float32."""
    if any(getattr(m, "dtype", None) == "float64" for m in metas) and not jax.config.jax_enable_x64:
        return "float64 needs jax_enable_x64 (JAX computes in float32 without it)"
    return None


def upcast(a):
    """The accumulation dtype: float32 for 16-bit arrays, the array's own otherwise."""
    return a.astype(jnp.float32) if a.dtype in _SIXTEEN else a


def row_mean(a):
    return jnp.mean(a, axis=-1, keepdims=True)


def overflow_scale(xf):
    """Per row, 1, or the power of two that brings max|x| into [2, 4) for finite rows whose sum of squares
    overflows: x / sqrt(mean(x^2) + eps) == (x s) / sqrt(mean((x s)^2) + eps s^2) exactly (the op's declaration).
    [2, 4), not [0.5, 1): for max|x| near the dtype's maximum 2^-e would be subnormal, which XLA flushes to 0."""
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True, initial=0.0)
    big = jnp.isfinite(amax) & jnp.isinf(jnp.sum(jnp.square(xf), axis=-1, keepdims=True))
    one = jnp.ones((), xf.dtype)
    return jnp.where(big, jnp.ldexp(one, 2 - jnp.frexp(amax)[1]), one)
