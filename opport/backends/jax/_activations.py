"""The elementwise activations' jnp arithmetic (silu), in float32 for 16-bit inputs (float64 for float64),
with the limits the declarations define (silu(-inf) = -0.0) and no subnormal in between: XLA on the CPU flushes
subnormals to zero, so a product whose factor would be subnormal is rescaled first (times_silu_grad)."""

import jax.numpy as jnp

# Below -C, sigmoid(x) = exp(x) is subnormal or near it (float32: exp(-87.3) = FLT_MIN); exp(-C) is normal.
DEEP = {jnp.dtype(jnp.float32): 64.0, jnp.dtype(jnp.float64): 512.0}


def sigmoid(x):
    """1 / (1 + exp(-x)) with exp only of -|x| (never overflows); NaN propagates."""
    e = jnp.exp(-jnp.abs(x))
    return jnp.where(x >= 0, 1, e) / (1 + e)


def silu(x):
    """x sigmoid(x); silu(-inf) = -0.0 (the product would be -inf * 0)."""
    return jnp.where(jnp.isneginf(x), -0.0, x * sigmoid(x))


def silu_grad(x):
    """silu'(x) = q (num + x e q), e = exp(-|x|), q = 1 / (1 + e), num = 1 for x >= 0 else e: no 1 - sigmoid(x)
    cancels; the x e term is 0 where e is (the limits silu'(-inf) = 0, silu'(+inf) = 1). NaN propagates."""
    e = jnp.exp(-jnp.abs(x))
    q = 1 / (1 + e)
    xe = jnp.where(e == 0, 0, x * e)
    return q * (jnp.where(x >= 0, 1, e) + xe * q)


def times_silu_grad(g, x):
    """g * silu'(x) without a subnormal silu' in between: for finite x < -C, silu'(x) = e q (1 + x q) with
    e = exp(x), taken as ((exp(x + C) g) q (1 + x q)) exp(-C), so an infinite or huge g meets a normal factor."""
    c = DEEP[x.dtype]
    deep = (x < -c) & jnp.isfinite(x)
    xd = jnp.where(deep, x, -c)  # the deep formula only sees deep values (no overflow where it is not taken)
    q = 1 / (1 + jnp.exp(xd))
    scaled = (jnp.exp(xd + c) * g) * (q * (1 + xd * q)) * jnp.exp(jnp.asarray(-c, x.dtype))
    return jnp.where(deep, scaled, g * silu_grad(x))
