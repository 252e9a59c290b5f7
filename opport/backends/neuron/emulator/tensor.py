"""NKI tensors: storage in one of the buffers plus a view (offset, shape, strides in elements).

On-chip buffers (SBUF, PSUM) are 2-D: dim 0 of a tile is the partition dim, the rest is laid out
row-major inside each partition. HBM is linear. Views never copy; `.ap()` addresses storage directly.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import as_strided

from opport.backends.neuron.emulator import dtypes as dt
from opport.backends.neuron.emulator import runtime
from opport.backends.neuron.emulator.errors import NkiValidationError, check, fail
from opport.backends.neuron.emulator.target import PMAX, PSUM_MIN_ALIGN


class Buffer:
    """A memory: nl.sbuf, nl.psum, nl.private_hbm (= nl.hbm), nl.shared_hbm."""

    def __init__(self, name: str, onchip: bool):
        self.name, self.onchip = name, onchip

    def __repr__(self):
        return f"nl.{self.name}"


sbuf = Buffer("sbuf", True)
psum = Buffer("psum", True)
private_hbm = Buffer("private_hbm", False)
hbm = private_hbm
shared_hbm = Buffer("shared_hbm", False)
BUFFERS = (sbuf, psum, private_hbm, shared_hbm)


class Storage:
    """One allocation: a flat NumPy array; `pfree` = elements per partition for on-chip buffers.

    Element (p, f) of an on-chip storage lives at data[p * pstride + f]. A tile allocated by the emulator is
    dense (pstride == pfree); one placed with `nl.ndarray(address=...)` is a window onto the run's physical
    SBUF/PSUM bytes, so pstride is the physical partition size and tiles placed at overlapping addresses
    share bytes, as on hardware. `base_partition` / `base_bytes` locate element (0, 0) physically
    (0 for emulator-allocated tiles, which are assumed to start on a partition-0 bank boundary).
    """

    __slots__ = ("data", "buffer", "pfree", "partitions", "mm_written", "name", "pstride", "base_partition",
                 "base_bytes", "__weakref__")

    def __init__(self, data: np.ndarray, buffer: Buffer, pfree: int | None, partitions: int, name: str = "",
                 pstride: int | None = None, base_partition: int = 0, base_bytes: int = 0):
        self.data, self.buffer, self.pfree, self.partitions, self.name = data, buffer, pfree, partitions, name
        self.pstride = pfree if pstride is None else pstride
        self.base_partition, self.base_bytes = base_partition, base_bytes
        # PSUM only: which elements the last write came from a matmul (accumulate=None auto-detection)
        self.mm_written = np.zeros(data.shape, bool) if buffer is psum else None

    def as_dtype(self, new: np.dtype, op: str) -> Storage:
        """The same bytes seen as `new` (partition sizes rescaled by the itemsize ratio)."""
        num, den = self.data.dtype.itemsize, new.itemsize
        sizes = [n for n in (self.pfree, self.pstride) if n is not None] + [self.data.size]
        check(all(n * num % den == 0 for n in sizes), op,
              f"a partition of {self.pfree} x {dt.name(self.data.dtype)} is not a whole number of {dt.name(new)}")
        scale = (lambda n: None if n is None else n * num // den)
        return Storage(self.data.view(new), self.buffer, scale(self.pfree), self.partitions, self.name,
                       scale(self.pstride), self.base_partition, self.base_bytes)

    def to_physical(self, logical: int) -> int:
        """Element offset in a dense [partition, pfree] layout -> offset in data."""
        if not self.buffer.onchip or self.pstride == self.pfree:
            return logical
        return (logical // self.pfree) * self.pstride + logical % self.pfree

    def to_logical(self, physical: int) -> int:
        if not self.buffer.onchip or self.pstride == self.pfree:
            return physical
        return (physical // self.pstride) * self.pfree + physical % self.pstride


class DynSlice:
    """nl.ds(start, size): `size` elements from `start` (size 0 gives an empty view; see NkiTensor.__getitem__)."""

    __slots__ = ("start", "size")

    def __init__(self, start, size):
        self.start, self.size = int(start), int(size)
        check(self.size >= 0, "nl.ds", f"size must be >= 0, got {self.size}")

    def __repr__(self):
        return f"nl.ds({self.start}, {self.size})"


def ds(start, size) -> DynSlice:
    return DynSlice(start, size)


def _row_major(shape, last=1):
    strides, acc = [], last
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def allocate(shape, dtype, buffer=None, name="", fill=None, op="nl.ndarray", address=None) -> NkiTensor:
    """A new tensor; filled with the NaN/4 sentinel unless `fill` is given or it is placed at an `address`."""
    buffer = sbuf if buffer is None else buffer
    if not isinstance(buffer, Buffer):
        raise NkiValidationError(f"{op}: buffer must be nl.sbuf, nl.psum, nl.hbm, nl.private_hbm or nl.shared_hbm, "
                                 f"got {buffer!r} (strings are rejected since NKI 0.3)")
    dtype = dt.as_dtype(dtype, op)
    shape = tuple(int(n) for n in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    # NkiTensor docs: "shape: tuple of positive integers" (empty views come from slicing, never allocation)
    if not all(n > 0 for n in shape):  # messages built only on failure: this runs for every tile
        fail(op, f"every dimension must be positive, got shape {shape}")
    if not buffer.onchip:
        if address is not None:
            raise NotImplementedError(f"{op}: address={address!r} on {buffer}: explicit HBM placement is not emulated")
        st = Storage(_filled_array(math.prod(shape), dtype, fill), buffer, None, shape[0] if shape else 1, name)
        return NkiTensor(st, 0, shape, _row_major(shape), dtype)
    if len(shape) < 2:
        fail(op, f"on-chip tiles are at least 2-D (partition, free...), got shape {shape}")
    if len(shape) > 5:
        fail(op, f"on-chip tiles have at most 4 free dims, got shape {shape}")
    if shape[0] > PMAX:
        fail(op, f"partition dimension {shape[0]} exceeds maximum {PMAX}")
    pfree = math.prod(shape[1:])
    per_partition = pfree * dtype.itemsize
    cap = _capacity(buffer)
    if per_partition > cap:
        fail(op, f"a {buffer.name.upper()} tile of {per_partition} bytes per partition exceeds the {cap} bytes a "
                 "partition has")
    if address is None:
        st = Storage(_filled_array(math.prod(shape), dtype, fill), buffer, pfree, shape[0], name)
        runtime.current().allocate(st, buffer.name, per_partition)
        strides = _row_major(shape)
    else:
        check(fill is None, op, "a tile placed at an address keeps the bytes there; fill it with an instruction")
        st = _placed(shape, dtype, buffer, name, address, op)
        strides = (st.pstride,) + _row_major(shape[1:])
    return NkiTensor(st, 0, shape, strides, dtype)


def _capacity(buffer: Buffer) -> int:
    t = runtime.current().target
    return t.psum_partition_bytes if buffer is psum else t.sbuf_partition_bytes


def _filled_array(size: int, dtype: np.dtype, fill) -> np.ndarray:
    data = np.empty(size, dtype)
    if fill is not None:
        data[...] = fill
    elif dt.is_packed(dtype):
        data.view(np.uint8)[...] = 0xFF  # NaN in every packed fp8 lane
    else:
        data[...] = dt.sentinel(dtype)
    return data


def _placed(shape, dtype, buffer, name, address, op) -> Storage:
    """A tile at an explicit (partition_offset, free_offset) address: a window onto the run's physical memory.

    The bytes are not reset: tiles placed at overlapping addresses alias, which is how AWS kernels reuse PSUM
    banks. Physical memory starts as 0xFF bytes (NaN in every float dtype) so never-written reads show.
    """
    check(isinstance(address, (tuple, list)) and len(address) == 2 and all(
        isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in address), op,
        f"address must be a (partition_offset, free_offset) pair of ints for {buffer}, got {address!r}")
    p0, f0 = (int(a) for a in address)
    parts, nbytes, cap = shape[0], math.prod(shape[1:]) * dtype.itemsize, _capacity(buffer)
    check(p0 >= 0 and p0 + parts <= PMAX, op, f"address partitions {p0}..{p0 + parts - 1} run past the {PMAX} "
                                               "partitions")
    check(f0 >= 0 and f0 + nbytes <= cap, op, f"address bytes {f0}..{f0 + nbytes - 1} of each partition run past the "
                                              f"{cap} bytes a {buffer.name.upper()} partition has")
    if buffer is psum:  # nl.tile_size.psum_min_align: minimum byte alignment of a PSUM free address
        check(f0 % PSUM_MIN_ALIGN == 0, op, f"PSUM free address {f0} is not {PSUM_MIN_ALIGN}-byte aligned "
                                            "(nl.tile_size.psum_min_align)")
    item = dtype.itemsize
    phys = runtime.current().physical(buffer.name, cap)
    start = p0 * cap + f0
    data = phys[start:start + (parts - 1) * cap + nbytes].view(dtype)
    runtime.current().place(buffer.name, p0, parts, f0, nbytes)
    return Storage(data, buffer, nbytes // item, parts, name, cap // item, p0, f0)


def _strided(a: np.ndarray, shape: tuple, strides: tuple) -> np.ndarray:
    """A view of `a`'s memory from its start: an ndarray over its buffer (a tenth of as_strided's cost; every tile
    access makes one), else as_strided, also for ml_dtypes' float8_e5m2 (a kind-'f' 1-byte dtype whose '<f1' NumPy
    cannot parse): through a uint8 view of the same bytes."""
    try:
        return np.ndarray(shape, a.dtype, a, 0, strides)
    except (TypeError, ValueError):  # a base that is not contiguous (a caller's strided array), a view past its end
        pass
    if a.dtype.itemsize == 1 and a.dtype.kind == "f":
        return as_strided(a.view(np.uint8), shape=shape, strides=strides).view(a.dtype)
    return as_strided(a, shape=shape, strides=strides)


def wrap_hbm(array: np.ndarray, name: str = "") -> NkiTensor:
    """A kernel argument: the caller's array itself, so in-place writes reach the caller (as in the simulator)."""
    dtype = dt.as_dtype(array.dtype, "kernel argument")
    itemsize = array.itemsize
    if array.size and any(s % itemsize or s < 0 for s in array.strides):
        array = np.ascontiguousarray(array)
    base = array
    # address the caller's memory through a flat array spanning the view
    span = 1 + sum((n - 1) * s // itemsize for n, s in zip(array.shape, array.strides)) if array.size else 1
    flat = _strided(base, (span,), (itemsize,))
    st = Storage(flat, shared_hbm, None, array.shape[0] if array.ndim else 1, name)
    return NkiTensor(st, 0, tuple(array.shape), tuple(s // itemsize for s in array.strides), dtype)


class NkiTensor:
    """A view of a storage. Shape, dtype and buffer follow the real API; data moves only through nl/nisa."""

    __slots__ = ("_st", "offset", "shape", "strides", "dtype", "indirection")

    def __init__(self, st: Storage, offset: int, shape, strides, dtype, indirect=None):
        self._st, self.offset, self.shape, self.strides, self.dtype = st, int(offset), tuple(shape), tuple(strides), dtype
        self.indirection = indirect  # ("vector", idx_tensor, dim) / ("scalar", offset, dim) from .ap()
        self._check_bounds()

    # -- metadata -------------------------------------------------------------------------------------
    @property
    def buffer(self) -> Buffer:
        return self._st.buffer

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def name(self) -> str:
        return self._st.name

    @property
    def onchip(self) -> bool:
        return self._st.buffer.onchip

    @property
    def partition_start(self) -> int:
        """The physical partition of dim 0's first element (start-partition rules use it)."""
        st = self._st
        return st.base_partition + self.offset // st.pstride if self.onchip else 0

    @property
    def free_byte_offset(self) -> int:
        """Byte offset of the first element inside its partition (PSUM bank checks use it)."""
        st = self._st
        return st.base_bytes + (self.offset % st.pstride) * self.itemsize

    def per_partition(self) -> int:
        """Elements per partition (on-chip) = product of the free dims."""
        return math.prod(self.shape[1:])

    def __repr__(self):
        return f"NkiTensor(shape={self.shape}, dtype={self.dtype}, buffer={self.buffer})"

    def __len__(self):
        return self.shape[0]

    def __bool__(self):
        return True

    def __setitem__(self, key, value):
        raise NkiValidationError("tensor item assignment is not part of the NKI >= 0.3 API: write through an "
                                 "instruction, e.g. nisa.tensor_copy(dst=t[...], src=...) or nisa.dma_copy")

    def __iter__(self):
        raise NkiValidationError("NKI tensors are not iterable; index them with ints, slices or nl.ds")

    def _check_bounds(self):
        if self.indirection is not None or not self.shape or not self.size:
            return
        st = self._st
        hi = self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.strides))
        check(self.offset >= 0 and hi < st.data.size, "index",
              f"out-of-bounds access: view {self.shape} at element offset {self.offset} with strides {self.strides} "
              f"exceeds the tensor's {st.data.size} elements")
        if st.buffer.onchip:
            pf, ps = st.pfree, st.pstride
            if self.shape[0] > 1:
                check(self.strides[0] == ps, "index", "an on-chip view must cover contiguous partitions "
                      f"(partition stride {self.strides[0]} elements, partition size {pf}); dim 0 is the partition dim")
            free_hi = self.offset % ps + sum((n - 1) * s for n, s in zip(self.shape[1:], self.strides[1:]))
            check(free_hi < pf, "index", f"free-dim access of view {self.shape} runs past the end of the partition "
                  f"({pf} elements)")

    # -- element access (used by instructions) ---------------------------------------------------------
    def _flat_index(self) -> np.ndarray:
        """Flat storage index of every element (needed for indirect views)."""
        grids = np.indices(self.shape, sparse=True) if self.shape else ()
        flat = np.full((1,) * len(self.shape), self.offset, np.int64)
        for d, (g, s) in enumerate(zip(grids, self.strides)):
            if self.indirection is not None and d == self.indirection[2]:
                kind, src, _ = self.indirection
                if kind == "vector":
                    idx = _vector_index(src, self.shape[d])
                    g = idx.reshape(g.shape)
                else:
                    g = g + _scalar_value(src)
            flat = flat + g.astype(np.int64) * s
        return np.broadcast_to(flat, self.shape)

    def _view(self) -> np.ndarray:
        d = self._st.data
        strides = tuple(s * d.itemsize for s in self.strides)
        return _strided(d[self.offset:], self.shape, strides)

    def read(self) -> np.ndarray:
        """The elements as a NumPy array of this tensor's dtype (a copy for indirect views)."""
        if self.indirection is not None:
            idx = self._flat_index()
            check(idx.min() >= 0 and idx.max() < self._st.data.size, "dma", "indirect access out of bounds")
            return self._st.data[idx]
        return self._view()

    def write(self, values, from_matmul: bool = False):
        """Store values (already in the destination's dtype or castable); records PSUM matmul writes."""
        check(all(s or n == 1 for n, s in zip(self.shape[1:], self.strides[1:])), "dst",
              "cannot write through a broadcast (stride-0) view")
        values = dt.cast(np.asarray(values).reshape(self.shape), self.dtype)
        if self.indirection is not None:
            self._st.data[self._flat_index()] = values
            return
        self._view()[...] = values
        if self._st.mm_written is not None:
            mv = as_strided(self._st.mm_written[self.offset:], shape=self.shape, strides=self.strides)
            mv[...] = from_matmul

    def matmul_written(self) -> np.ndarray:
        mw = self._st.mm_written
        return as_strided(mw[self.offset:], shape=self.shape, strides=self.strides)

    # -- indexing ------------------------------------------------------------------------------------------
    def __getitem__(self, key) -> NkiTensor:
        if self.indirection is not None:
            raise NkiValidationError("index: an .ap() view with an indirect offset cannot be indexed further")
        key = key if isinstance(key, tuple) else (key,)
        if any(k is Ellipsis for k in key):
            i = key.index(Ellipsis)
            key = key[:i] + (slice(None),) * (self.ndim - len(key) + 1) + key[i + 1:]
        check(len(key) <= self.ndim, "index", f"too many indices ({len(key)}) for a {self.ndim}-D tensor {self.shape}")
        key = key + (slice(None),) * (self.ndim - len(key))
        off, shape, strides = self.offset, [], []
        for d, (k, n, s) in enumerate(zip(key, self.shape, self.strides)):
            if isinstance(k, DynSlice):
                if k.size == 0:  # an empty view: instructions given one issue nothing (isa._skips_empty)
                    check(0 <= k.start <= n, "index", f"nl.ds({k.start}, 0) out of bounds for dim {d} of size {n}")
                    off, shape, strides = off + max(min(k.start, n - 1), 0) * s, shape + [0], strides + [s]
                    continue
                k = slice(k.start, k.start + k.size)
            if isinstance(k, (int, np.integer)) and not isinstance(k, bool):
                i = int(k) + (n if k < 0 else 0)
                check(0 <= i < n, "index", f"index {int(k)} out of bounds for dim {d} of size {n} (shape {self.shape})")
                off += i * s
                if self.onchip and d == 0:  # on-chip integer index keeps the partition dim
                    shape.append(1)
                    strides.append(s)
            elif isinstance(k, slice):
                start, stop, step = _slice_bounds(k, n, d, self.shape)
                off += start * s
                shape.append(-(-(stop - start) // step))
                strides.append(s * step)
            else:
                raise NkiValidationError(f"index: unsupported index {k!r} (use ints, slices, nl.ds; dynamic gathers go "
                                         "through .ap(vector_offset=...) in a DMA)")
        if self.onchip and len(shape) == 1:  # on-chip results stay 2-D
            shape.append(1)
            strides.append(1)
        return NkiTensor(self._st, off, shape, strides, self.dtype)

    # -- view methods ------------------------------------------------------------------------------------
    def ap(self, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0, dtype=None) -> NkiTensor:
        """Access pattern [[stride, count], ...] over this tensor's storage, starting at the view's base offset.

        As documented for NkiTensor.ap: `offset=None` keeps the view's base offset and an int is added to it;
        `dtype` reinterprets the storage's bytes first, so pattern strides and offset count elements of it.
        """
        check(scalar_offset is None or vector_offset is None, "ap", "scalar_offset and vector_offset are exclusive")
        pattern = [tuple(int(v) for v in p) for p in pattern]
        check(all(len(p) == 2 for p in pattern) and pattern, "ap", f"pattern must be [[stride, count], ...], got {pattern}")
        check(all(c > 0 and s >= 0 for s, c in pattern), "ap", f"counts must be positive and strides >= 0: {pattern}")
        st, base, new = self._st, self._st.to_logical(self.offset), self.dtype
        if dtype is not None and dt.as_dtype(dtype, "ap") != self.dtype:
            st, base, new = self._reinterpreted(dt.as_dtype(dtype, "ap"), base)
        strides = [s for s, _ in pattern]
        if st.buffer.onchip:
            check(pattern[0][0] == st.pfree or pattern[0][1] == 1, "ap",
                  f"on-chip pattern's first (partition) stride must be the partition size {st.pfree}, got {pattern[0][0]}")
            strides[0] = st.pstride
        start = st.to_physical(base + (0 if offset is None else int(offset)))
        return NkiTensor(st, start, [c for _, c in pattern], strides, new, self._indirection(
            pattern, scalar_offset, vector_offset, indirect_dim))

    def _reinterpreted(self, new, base):
        """(storage, base offset, dtype) of this view's bytes seen as `new` (for .ap(dtype=...))."""
        num, den = self.itemsize, new.itemsize
        check(base * num % den == 0, "ap", f"the view starts at byte {base * num}, not on a {dt.name(new)} boundary")
        return self._st.as_dtype(new, "ap"), base * num // den, new

    def _indirection(self, pattern, scalar_offset, vector_offset, indirect_dim):
        if vector_offset is not None:
            check(not self.onchip, "ap", "vector_offset indirection indexes an HBM tensor")
            check(vector_offset.onchip and vector_offset.shape[0] == pattern[indirect_dim][1], "ap",
                  f"vector_offset must be an on-chip [{pattern[indirect_dim][1]}, 1] tile, got {vector_offset.shape}")
            return ("vector", vector_offset, indirect_dim)
        if scalar_offset is not None:
            return ("scalar", scalar_offset, indirect_dim)
        return None

    def reshape(self, shape) -> NkiTensor:
        shape = tuple(int(n) for n in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        if -1 in shape:
            known = math.prod(n for n in shape if n != -1)
            shape = tuple(self.size // known if n == -1 else n for n in shape)
        check(math.prod(shape) == self.size, "reshape", f"cannot reshape {self.shape} ({self.size} elements) to {shape}")
        if self.onchip:
            check(shape[0] == self.shape[0], "reshape", f"on-chip reshape must keep the partition dim {self.shape[0]}, "
                  f"got {shape}")
            check(self._free_contiguous(), "reshape", "on-chip reshape needs a view contiguous in its free dims")
            return NkiTensor(self._st, self.offset, shape, (self.strides[0],) + _row_major(shape[1:]), self.dtype)
        check(self.strides == _row_major(self.shape) or self.size == 1, "reshape", "HBM reshape needs a contiguous view")
        return NkiTensor(self._st, self.offset, shape, _row_major(shape), self.dtype)

    def _free_contiguous(self) -> bool:
        return all(s == e for s, e, n in zip(self.strides[1:], _row_major(self.shape[1:]), self.shape[1:]) if n > 1)

    def view(self, dtype) -> NkiTensor:
        """Reinterpret the bytes as another dtype (the last dim scales with the itemsize ratio)."""
        new = dt.as_dtype(dtype, "view")
        old = self.dtype
        if new.itemsize == old.itemsize:
            return NkiTensor(self._st.as_dtype(new, "view"), self.offset, self.shape, self.strides, new)
        check(self.strides[-1] == 1, "view", "a dtype view needs a contiguous last dim")
        num, den = (old.itemsize, new.itemsize)
        check(all((s * num) % den == 0 for s in self.strides[:-1]) and (self.offset * num) % den == 0
              and (self.shape[-1] * num) % den == 0, "view", f"{self.shape} {dt.name(old)} cannot be viewed as "
              f"{dt.name(new)}")
        strides = tuple(s * num // den for s in self.strides[:-1]) + (1,)
        return NkiTensor(self._st.as_dtype(new, "view"), self.offset * num // den,
                         self.shape[:-1] + (self.shape[-1] * num // den,), strides, new)

    def slice(self, dim, start, end, step=1) -> NkiTensor:
        key = [slice(None)] * self.ndim
        key[dim] = slice(start, min(end, self.shape[dim]), step)
        return self[tuple(key)]

    def select(self, dim, index) -> NkiTensor:
        check(not (self.onchip and dim == 0), "select", "cannot select away the partition dim of an on-chip tensor")
        shape, strides = list(self.shape), list(self.strides)
        check(0 <= index < shape[dim], "select", f"index {index} out of bounds for dim {dim} of size {shape[dim]}")
        off = self.offset + index * strides[dim]
        del shape[dim], strides[dim]
        return NkiTensor(self._st, off, shape, strides, self.dtype)

    def permute(self, dims) -> NkiTensor:
        dims = tuple(dims)
        check(sorted(dims) == list(range(self.ndim)), "permute", f"{dims} is not a permutation of {self.ndim} dims")
        check(not self.onchip or dims[0] == 0, "permute", "the partition dim must stay first on chip (dims[0] == 0)")
        return NkiTensor(self._st, self.offset, [self.shape[d] for d in dims], [self.strides[d] for d in dims], self.dtype)

    def broadcast(self, dim, size) -> NkiTensor:
        check(self.shape[dim] == 1, "broadcast", f"only size-1 dims broadcast; dim {dim} has size {self.shape[dim]}")
        check(not (self.onchip and dim == 0), "broadcast", "cannot broadcast the partition dim of an on-chip tensor "
              "(copy across partitions with a DMA or a matmul)")
        shape, strides = list(self.shape), list(self.strides)
        shape[dim], strides[dim] = int(size), 0
        return NkiTensor(self._st, self.offset, shape, strides, self.dtype)

    def broadcast_to(self, shape) -> NkiTensor:
        shape = tuple(shape)
        check(len(shape) == self.ndim, "broadcast_to", f"rank must stay {self.ndim}, got {shape}")
        out = self
        for d, (a, b) in enumerate(zip(self.shape, shape)):
            if a != b:
                out = out.broadcast(d, b)
        return out

    def expand_dim(self, dim) -> NkiTensor:
        check(not (self.onchip and dim == 0), "expand_dim", "cannot insert a dim before the partition dim on chip")
        shape, strides = list(self.shape), list(self.strides)
        shape.insert(dim, 1)
        strides.insert(dim, 0)
        return NkiTensor(self._st, self.offset, shape, strides, self.dtype)

    def expand_dims(self, axis) -> NkiTensor:
        return self.expand_dim(axis)

    def squeeze_dim(self, dim) -> NkiTensor:
        check(self.shape[dim] == 1, "squeeze_dim", f"dim {dim} has size {self.shape[dim]}, not 1")
        check(not (self.onchip and dim == 0), "squeeze_dim", "cannot squeeze the partition dim on chip")
        shape, strides = list(self.shape), list(self.strides)
        del shape[dim], strides[dim]
        return NkiTensor(self._st, self.offset, shape, strides, self.dtype)

    def reshape_dim(self, dim, shape) -> NkiTensor:
        shape = tuple(int(n) for n in shape)
        check(math.prod(shape) == self.shape[dim], "reshape_dim", f"{shape} does not split dim {dim} of size "
              f"{self.shape[dim]}")
        check(not (self.onchip and dim == 0 and len(shape) > 1), "reshape_dim", "cannot split the partition dim on chip")
        s = self.strides[dim]
        new_shape = self.shape[:dim] + shape + self.shape[dim + 1:]
        new_strides = self.strides[:dim] + tuple(x * s for x in _row_major(shape)) + self.strides[dim + 1:]
        return NkiTensor(self._st, self.offset, new_shape, new_strides, self.dtype)

    def flatten_dims(self, start, end) -> NkiTensor:
        check(0 <= start <= end < self.ndim, "flatten_dims", f"bad dim range [{start}, {end}] for {self.ndim} dims")
        check(not (self.onchip and start == 0 and end > 0), "flatten_dims", "cannot merge the partition dim on chip")
        for d in range(start, end):
            check(self.strides[d] == self.strides[d + 1] * self.shape[d + 1] or self.shape[d] == 1, "flatten_dims",
                  f"dims {d} and {d + 1} are not contiguous")
        n = math.prod(self.shape[start:end + 1])
        return NkiTensor(self._st, self.offset, self.shape[:start] + (n,) + self.shape[end + 1:],
                         self.strides[:start] + (self.strides[end],) + self.strides[end + 1:], self.dtype)

    def is_indirect(self) -> bool:
        return self.indirection is not None

    def is_contiguous(self) -> bool:
        """Row-major over the free dims (on chip the partition dim is skipped, as documented)."""
        dims = list(zip(self.shape, self.strides))[1 if self.onchip else 0:]
        want = _row_major([n for n, _ in dims])
        return all(s == w for (n, s), w in zip(dims, want) if n > 1)

    def get_pattern(self) -> list:
        """[[stride, count], ...] of this view, in the units .ap() takes (on chip: dense partition stride)."""
        strides = list(self.strides)
        if self.onchip:
            strides[0] = self._st.pfree
        return [[s, n] for s, n in zip(strides, self.shape)]

    def indirect(self, index, num_elem=None):
        raise NotImplementedError("NkiTensor.indirect: Tensor Indirection (TI, NeuronCore-v4) is not emulated; "
                                  "gather with nisa.nc_n_gather / local_gather or an indirect DMA")

    def assert_shape(self, shape):
        check(tuple(shape) == self.shape, "assert_shape", f"expected shape {tuple(shape)}, got {self.shape}")
        return self


def _slice_bounds(k: slice, n: int, d: int, shape):
    step = 1 if k.step is None else int(k.step)
    check(step > 0, "index", f"slice step must be positive, got {step}")
    start = 0 if k.start is None else int(k.start)
    stop = n if k.stop is None else int(k.stop)
    start += n if start < 0 else 0
    stop += n if stop < 0 else 0
    check(0 <= start < stop <= n, "index", f"slice {start}:{stop} out of bounds or empty for dim {d} of size {n} "
          f"(shape {shape}); clamp with min()")
    return start, stop, step


def _vector_index(src, count) -> np.ndarray:
    idx = np.asarray(src.read()).reshape(-1)
    check(idx.size == count, "ap", f"vector_offset has {idx.size} entries, the indirect dim has {count}")
    return idx.astype(np.int64)


def _scalar_value(src) -> int:
    if isinstance(src, NkiTensor):
        check(src.size == 1, "ap", f"scalar_offset tensor must hold one element, got shape {src.shape}")
        return int(np.asarray(src.read()).reshape(-1)[0])
    return int(src)
