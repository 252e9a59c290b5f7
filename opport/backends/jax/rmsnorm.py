"""rmsnorm in jnp: float32 statistics for 16-bit inputs, the scale offset + weight formed in that dtype; the
backward is the declared one (r = 1/rms recomputed from x)."""

import jax.numpy as jnp

from opport.backends.jax._common import kernel, overflow_scale, row_mean, upcast
from opport.ops.rmsnorm import rmsnorm as spec


@kernel(spec, traced=("eps",))
def rmsnorm(x, weight, eps, offset=0.0):
    xf = upcast(x)
    s = overflow_scale(xf)
    xs = xf * s
    y = xs / jnp.sqrt(row_mean(xs * xs) + eps * s * s)
    return (y if weight is None else y * scale(weight, offset)).astype(x.dtype)


def scale(weight, offset: float):
    """offset + weight in the accumulation dtype, never rounded to the weight's."""
    w = upcast(weight)
    return w + offset if offset else w


@kernel(spec.backward_op, traced=("eps",))
def rmsnorm_backward(grad, x, weight, eps, offset=0.0):
    """dx = s r (g - xhat mean(g xhat)) with g = grad (offset + weight); dweight = sum over rows of grad xhat.
    A one-element row's dx is g eps r^2 exactly (the general form cancels to noise)."""
    xf, gf = upcast(x), upcast(grad)
    s = overflow_scale(xf)
    xs = xf * s
    e = eps * s * s
    r = 1 / jnp.sqrt(row_mean(xs * xs) + e)
    xhat = xs * r
    g = gf if weight is None else gf * scale(weight, offset)
    if x.shape[-1] == 1:
        dx = (g * e * r * r + xf * 0) * r * s  # (+ x * 0: NaN where x is not finite)
    else:
        dx = (g - xhat * row_mean(g * xhat)) * r * s
    dw = None if weight is None else jnp.sum(gf * xhat, axis=tuple(range(x.ndim - 1))).astype(weight.dtype)
    return dx.astype(x.dtype), dw
