"""silu in jnp: x sigmoid(x) in float32 (float64 for float64), rounded once; its backward grad * silu'(x)."""

from opport.backends.jax import _activations as act
from opport.backends.jax._common import kernel, upcast
from opport.ops.silu import silu as spec


@kernel(spec)
def silu(x):
    return act.silu(upcast(x)).astype(x.dtype)


@kernel(spec.backward_op)
def silu_backward(grad, x):
    return (act.times_silu_grad(upcast(grad), upcast(x)).astype(x.dtype),)
