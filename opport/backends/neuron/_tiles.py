"""Tiling with remainders, shared by the neuron kernels (nki-library's TiledRange, as plain tuples).

A dimension of n elements is walked in tiles of `size`, the last one holding the remainder:
`for r0, p in spans(N, PMAX):` in place of `for r0 in range(0, N, PMAX): p = min(PMAX, N - r0)`. Plain
Python on compile-time integers, which the NKI tracer runs while it unrolls the kernel's loops.
"""

from __future__ import annotations


def spans(n, size, start=0):
    """(offset, extent) of each tile of range(start, n) in steps of `size`: every extent is `size` but the last,
    which is what remains (none when start >= n)."""
    tiles = []
    for offset in range(start, n, size):
        tiles.append((offset, min(size, n - offset)))
    return tuple(tiles)


def cdiv(n, size):
    """How many tiles of `size` cover n elements (the last one partial)."""
    return (n + size - 1) // size
