"""Host-side helpers shared by the neuron kernels: layouts in, kernel launch, results out.

The NKI kernels in this package take HBM tensors whose leading dimension is the row (or element)
axis that the kernel lays onto the 128 SBUF partitions, and the feature axis last. These helpers
bring the bound NumPy arguments into that form (flatten leading dims, move an axis last, make a
contiguous copy where the layout demands one), launch a jitted kernel through `nki_compat`
(the real `nki` on hardware or in its simulator, opport's emulator otherwise), and hand back a
NumPy array of the op's declared dtype.
"""

from __future__ import annotations

import numpy as np

from opport.backends.neuron import nki_compat
from opport.dtypes import np_dtype

P = 128  # SBUF/PSUM partitions (nl.tile_size.pmax on every NeuronCore generation)


def run(kernel, *args):
    """Launch a jitted kernel on NumPy arrays (plus compile-time scalars) in the active mode.

    `nki_compat.run` calls the jitted function directly on hardware and in the emulator, and
    through `nki.simulate` in the SDK's simulator.
    """
    return nki_compat.run(kernel, *args)


def contiguous(a: np.ndarray) -> np.ndarray:
    """A C-contiguous array for DMA-friendly HBM access (a copy only when `a` is a strided view)."""
    return np.ascontiguousarray(a)


def rows(x: np.ndarray) -> np.ndarray:
    """`x` as [rows, features]: leading dims flattened, contiguous (copied only if it is a view)."""
    n = x.shape[-1] if x.ndim else 1
    return contiguous(x).reshape(-1, n)


def as_dtype(out, dtype: str, shape: tuple) -> np.ndarray:
    """The kernel result as a NumPy array of the op's declared dtype and shape."""
    out = np.asarray(out)
    want = np_dtype(dtype)
    if out.dtype != want:
        raise TypeError(f"neuron kernel returned {out.dtype}, expected {want}")
    return out.reshape(shape)


def elementwise_parts(n: int) -> list[tuple[int, int, int]]:
    """How a flat length-`n` buffer is laid onto the partitions: (start, partitions, per_partition).

    The bulk fills all 128 partitions ([128, n // 128]); a tail of n % 128 elements goes one
    element per partition ([tail, 1]), so no padding copy is needed.
    """
    parts = []
    bulk = n // P * P
    if bulk:
        parts.append((0, P, bulk // P))
    if n - bulk:
        parts.append((bulk, n - bulk, 1))
    return parts


def run_elementwise(kernel, arrays: tuple, out_dtype: str, *consts) -> np.ndarray:
    """Run a 2-D elementwise kernel over same-shaped arrays laid as [128, F] plus a [tail, 1] tail."""
    shape = arrays[0].shape
    flats = [contiguous(a).reshape(-1) for a in arrays]
    out = np.empty(flats[0].size, np_dtype(out_dtype))
    for start, parts, per in elementwise_parts(out.size):
        views = [f[start:start + parts * per].reshape(parts, per) for f in flats]
        out[start:start + parts * per] = as_dtype(run(kernel, *views, *consts), out_dtype, (parts, per)).reshape(-1)
    return out.reshape(shape)


def float32_table(a: np.ndarray) -> np.ndarray:
    """A side table (rope's cos/sin) in a dtype NKI has: float64 tables are rounded to float32."""
    return contiguous(a.astype(np.float32) if a.dtype == np.float64 else a)
