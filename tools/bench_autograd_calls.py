"""Decode-sized calls through torch autograd on the cpu backend: `torch.autograd.grad` of one opport call against the
same call of torch's own op, interleaved rounds in one process, best round of each (the fixed costs these rows measure
are what a noisy machine inflates). Prints microseconds and the ratio torch / opport (> 1: opport faster).

    OMP_NUM_THREADS=1 OPPORT_NUM_THREADS=1 .venv/bin/python tools/bench_autograd_calls.py [--rounds 9]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import opport


def _us(fn, reps: int = 1000) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) * 1e6 / reps


def _leaf(*shape):
    return torch.randn(*shape, requires_grad=True)


def cases() -> list:
    """(name, opport call, torch call, leaves, upstream gradient)."""
    x, u, g = _leaf(1, 14336), _leaf(1, 14336), torch.randn(1, 14336)
    x4, w, b, g4 = _leaf(1, 4096), _leaf(4096), _leaf(4096), torch.randn(1, 4096)
    return [
        ("silu 1x14336", lambda: opport.silu(x), lambda: F.silu(x), (x,), g),
        ("swiglu 1x14336", lambda: opport.swiglu(x, u), lambda: F.silu(x) * u, (x, u), g),
        ("layernorm 1x4096", lambda: opport.layernorm(x4, w, b), lambda: F.layer_norm(x4, (4096,), w, b), (x4, w, b), g4),
        ("rmsnorm 1x4096", lambda: opport.rmsnorm(x4, w), lambda: F.rms_norm(x4, (4096,), w, 1e-6), (x4, w), g4),
    ]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args(argv)
    print(f"torch threads {torch.get_num_threads()}; forward + torch.autograd.grad, best of {args.rounds} rounds")
    for name, mine, theirs, leaves, g in cases():
        steps = [lambda f=f, leaves=leaves, g=g: torch.autograd.grad(f(), leaves, g) for f in (mine, theirs)]
        for s in steps:
            _us(s, 200)  # warm: numba's cache, the dispatcher's plans, torch's allocator
        times = [[], []]
        for _ in range(args.rounds):  # interleaved: both see the same machine
            for t, s in zip(times, steps):
                t.append(_us(s))
        best = [min(t) for t in times]
        print(f"{name:18s} opport {best[0]:7.1f} us   torch {best[1]:7.1f} us   {best[1] / best[0]:.2f}x torch")


if __name__ == "__main__":
    main()
