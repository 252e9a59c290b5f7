"""`jax.grad` through an opport op under `jax.jit` on the CPU, against the same math in plain jnp (issue 32 item 4).

    python tools/bench_jax_grad.py [--op rmsnorm] [--op silu] [--rows 256] [--cols 1024] [--repeats 7] [--number 20]
                                   [--json F]

Three ways per op, in one process, each compiled once and then timed: `jnp` (the op written in jax.numpy, JAX's own
autodiff), `opport` (the op as JAX arrays select it: the jax backend's kernels traced in, no callback) and
`callback` (the same op forced onto the cpu backend with `opport.use_backend("cpu")`: host callbacks). Each
repeat times `number` calls (blocking on the result); the median repeat per call is reported, and the ratio
to jnp. Done-when: opport / jnp <= 2 for rmsnorm at 256 x 1024 float32.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def _rmsnorm_jnp(x, w, eps=1e-6):
    import jax.numpy as jnp

    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _silu_jnp(x):
    import jax

    return jax.nn.silu(x)


PLAIN = {"rmsnorm": _rmsnorm_jnp, "silu": _silu_jnp}  # the same math in jax.numpy, JAX's autodiff


def time_grad(fn, args, repeats: int, number: int) -> float:
    """Median seconds per call of fn(*args) (compiled and run once first)."""
    import jax

    jax.block_until_ready(fn(*args))
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            out = fn(*args)
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - t0) / number)
    return statistics.median(runs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--op", action="append", choices=sorted(PLAIN), help="default: rmsnorm")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--cols", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--number", type=int, default=20)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    import opport

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((a.rows, a.cols)), jnp.float32)
    w = jnp.asarray(rng.uniform(0.5, 1.5, a.cols), jnp.float32)
    found = {}
    for name in a.op or ["rmsnorm"]:
        args = (x, w) if name == "rmsnorm" else (x,)
        ways = {"jnp": PLAIN[name], "opport": getattr(opport, name), "callback": getattr(opport, name)}
        rows = found[name] = {}
        for way, op in ways.items():
            grad = jax.jit(jax.grad(lambda *a, op=op: jnp.sum(op(*a) ** 2), argnums=tuple(range(len(args)))))
            if way == "callback":
                with opport.use_backend("cpu"):  # fixed into the trace, which happens on the first call
                    jax.block_until_ready(grad(*args))
            rows[way] = time_grad(grad, args, a.repeats, a.number)
        print(f"jax.grad(sum({name}(...)^2)) under jax.jit, x {a.rows}x{a.cols} float32, {jax.devices()[0].platform}, "
              f"median of {a.repeats} x {a.number} calls")
        for way, t in rows.items():
            print(f"  {way:9s} {t * 1e6:9.1f} us   {t / rows['jnp']:5.2f}x jnp")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"shape": [a.rows, a.cols], "seconds": found}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
