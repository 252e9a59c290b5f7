"""Tiling shared by the neuron kernels: tiles with remainders (nki-library's TiledRange, as plain tuples), and a
row of HBM replicated across the partitions.

A dimension of n elements is walked in tiles of `size`, the last one holding the remainder:
`for r0, p in spans(N, PMAX):` in place of `for r0 in range(0, N, PMAX): p = min(PMAX, N - r0)`. Plain
Python on compile-time integers, which the NKI tracer runs while it unrolls the kernel's loops;
load_row_broadcast is a plain function of NKI instructions, which the NKI compiler inlines.
"""

from __future__ import annotations

from opport.backends.neuron.nki_compat import nisa, nl

PSUM_FMAX = 512  # float32 columns per PSUM bank: the partition broadcast goes 512 columns per matmul


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


def load_row_broadcast(dst_sb, vec_hbm, c0, f, p):
    """dst_sb[0:p, 0:f] = vec[c0:c0+f] on every partition: one DMA of the row, then a K = 1 TensorE matmul
    (ones[1, p]^T @ row, 512 columns at a time through PSUM) replicates it, exactly (x * 1.0, one term),
    so HBM is read once instead of once per partition."""
    row_sb = nl.ndarray((1, f), dtype=vec_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=row_sb, src=vec_hbm[c0:c0 + f])
    ones_sb = nl.ndarray((1, p), dtype=vec_hbm.dtype, buffer=nl.sbuf)
    nisa.memset(dst=ones_sb, value=1.0)
    for j0, fj in spans(f, PSUM_FMAX):
        rep_psum = nl.ndarray((p, fj), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=rep_psum, stationary=ones_sb, moving=row_sb[0:1, j0:j0 + fj])
        nisa.tensor_copy(dst=dst_sb[0:p, j0:j0 + fj], src=rep_psum)
