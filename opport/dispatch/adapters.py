"""Array adapters: NumPy arrays, torch tensors and JAX arrays in, the same kind out.

An adapter gives (1) a cheap hashable key for the dispatch cache, (2) the `Meta` that validation
sees, (3) conversions to what a backend's kernels take (NumPy or torch) and back. torch and JAX are
never imported here unless the caller already imported them. bfloat16 and the fp8 formats go through
ml_dtypes (as 16- and 8-bit integer views), so they cross between frameworks bit-exactly.
"""

from __future__ import annotations

import sys

import numpy as np

from opport import errors
from opport.dtypes import FP8, np_dtype
from opport.spec import Meta

_BF16 = np_dtype("bfloat16")
_FP8 = {np_dtype(n): n for n in FP8}  # ml_dtypes fp8 dtype -> its name, which is also torch's


def _from_numpy(torch, a):
    """A torch tensor viewing NumPy array `a` (bfloat16 and fp8 through integer views of the same bits)."""
    if a.dtype == _BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    name = _FP8.get(a.dtype) if a.dtype.itemsize == 1 else None
    if name is not None:
        return torch.from_numpy(a.view(np.uint8)).view(getattr(torch, name))
    return torch.from_numpy(a)


class NumpyAdapter:
    kind = "numpy"

    @staticmethod
    def key(a):
        return (a.dtype, a.shape, a.strides)

    @staticmethod
    def meta(a) -> Meta:
        item = a.itemsize
        strides = tuple(s // item for s in a.strides) if item and NumpyAdapter.plain(a) else None
        return Meta("numpy", a.dtype.name, a.shape, strides, "cpu")

    @staticmethod
    def plain(a) -> bool:
        """Native byte order and strides in whole elements: what every kernel can take as is. Other arrays
        (big-endian data, views into records) are copied to a contiguous native array first (`normalized`),
        on every backend alike; their Meta says contiguous, as the kernel will see them."""
        item = a.itemsize
        return a.dtype.isnative and (item == 0 or all(s % item == 0 for s in a.strides))

    @staticmethod
    def normalized(a):
        return np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("="))

    @staticmethod
    def to_numpy(a):
        return a

    @staticmethod
    def to_torch(a, device: str):
        import torch

        if not a.flags.writeable or (not a.flags.c_contiguous and any(s < 0 for s in a.strides)):
            a = a.copy()  # torch cannot wrap read-only or negatively strided memory
        t = _from_numpy(torch, a)
        return t if device == "cpu" else t.to(device)

    @staticmethod
    def from_native(out, like):
        if isinstance(out, np.ndarray):
            return out
        return TorchAdapter.to_numpy(out)


class SubclassAdapter(NumpyAdapter):
    """ndarray subclasses (np.matrix, np.memmap, ...): computed on as the plain ndarray they view, on every
    backend; the output is a plain ndarray. (Masked arrays are refused instead: see `array_type_error`.)"""

    to_numpy = staticmethod(np.asarray)

    @staticmethod
    def to_torch(a, device: str):
        return NumpyAdapter.to_torch(np.asarray(a), device)


class TorchAdapter:
    kind = "torch"
    _names: dict = {}

    @classmethod
    def dtype_name(cls, dt) -> str:
        name = cls._names.get(dt)
        if name is None:
            name = cls._names[dt] = str(dt).removeprefix("torch.")
        return name

    @staticmethod
    def key(t):
        return (t.dtype, t.shape, t.stride(), t.device)

    @classmethod
    def meta(cls, t) -> Meta:
        if t.layout is not (_torch or _bind_torch()).strided:
            raise ValueError(f"a {t.layout} tensor")  # turned into the op's typed error by meta_of
        dev = t.device
        device = dev.type if dev.index is None else f"{dev.type}:{dev.index}"
        return Meta("torch", cls.dtype_name(t.dtype), tuple(t.shape), tuple(t.stride()), device)

    @staticmethod
    def to_numpy(t):
        if t.dtype in (_native or _native_dtypes()):  # a format NumPy reads itself: one call (~0.8 us)
            return t.numpy(force=True)  # = detach().cpu().resolve_conj().resolve_neg().numpy(): a CPU tensor's memory
        if t.requires_grad:
            t = t.detach()
        if not t.is_cpu:
            t = t.cpu()
        try:
            if t.dtype is (_torch_bf16 or _bind_torch().bfloat16):
                return t.view(_torch.int16).numpy().view(_BF16)
            if t.element_size() == 1 and t.is_floating_point():  # torch's float8 dtypes: NumPy has no buffer format
                return t.view(_torch.uint8).numpy().view(np_dtype(TorchAdapter.dtype_name(t.dtype)))
            return t.numpy()
        except RuntimeError:  # a negative-bit view (torch.complex(a, b).conj().imag): its values, materialised
            if not t.is_neg():
                raise
            return TorchAdapter.to_numpy(t.resolve_neg())

    @staticmethod
    def to_torch(t, device: str):
        t = t.detach()
        if t.is_neg():  # kernels read memory: a negative-bit view must be materialised first
            t = t.resolve_neg()
        return t if t.device.type == device.split(":")[0] else t.to(device)

    @staticmethod
    def from_native(out, like):
        if out.__class__ is np.ndarray:
            torch = _torch or _bind_torch()
            # kernels return fresh, writeable arrays, so torch can wrap them without a copy
            out = _from_numpy(torch, out)
            return out if like.is_cpu else out.to(like.device)
        return out if out.device == like.device else out.to(like.device)


# torch and torch.bfloat16, bound when the first tensor is converted: the conversions run on every call
# with torch inputs on a NumPy backend, where an `import torch` statement alone costs ~0.1 us.
_torch = _torch_bf16 = None
_native: frozenset = frozenset()  # torch dtypes with a NumPy buffer format of their own (not bfloat16, not fp8)


def _bind_torch():
    global _torch, _torch_bf16, _native
    _torch = sys.modules["torch"]
    _torch_bf16 = _torch.bfloat16
    t = _torch
    _native = frozenset((t.float32, t.float64, t.float16, t.int64, t.int32, t.int16, t.int8, t.uint8, t.bool))
    return _torch


def _native_dtypes() -> frozenset:
    _bind_torch()
    return _native


class JaxAdapter:
    kind = "jax"

    @staticmethod
    def key(a):
        return (a.dtype, a.shape, None, _jax_device(a))

    @staticmethod
    def meta(a) -> Meta:
        dev = _jax_device(a)
        platform = "cuda" if dev.platform in ("gpu", "cuda") else dev.platform  # JAX on a GPU selects cuda
        device = "cpu" if platform == "cpu" else f"{platform}:{dev.id}"
        return Meta("jax", np.dtype(a.dtype).name, a.shape, None, device)

    to_numpy = staticmethod(np.asarray)
    to_torch = staticmethod(SubclassAdapter.to_torch)  # through a NumPy view, as ndarray subclasses

    @staticmethod
    def from_native(out, like):
        import jax

        if not isinstance(out, np.ndarray):
            out = TorchAdapter.to_numpy(out)
        return jax.device_put(out, _jax_device(like))


def _jax_device(a):
    dev = getattr(a, "device", None)  # jax >= 0.4.31: a property holding the single device
    if dev is None or callable(dev):
        (dev,) = a.devices()
    return dev


_by_type: dict[type, type] = {np.ndarray: NumpyAdapter}


def adapter_for(a):
    """The adapter for `a`'s type, or None if it is not an array opport takes."""
    t = type(a)
    ad = _by_type.get(t)
    if ad is None:
        ad = _resolve(a)
        if ad is not None:
            _by_type[t] = ad
    return ad


def _resolve(a):
    if isinstance(a, np.ndarray):
        if isinstance(a, np.ma.MaskedArray):
            return None  # refused: kernels would silently compute on (or drop) the masked data
        return NumpyAdapter if type(a) is np.ndarray else SubclassAdapter
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):
        return TorchAdapter
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
        return JaxAdapter
    return None



def array_type_error(op, arg: str, a, why: str | None = None) -> errors.DTypeError:
    """The typed error for an argument that is not an array opport takes (raise it)."""
    expected = "a NumPy array, torch tensor or JAX array"
    if isinstance(a, np.ma.MaskedArray):
        expected = "an array without a mask (NumPy masked arrays are refused: pass a.filled(value) or a.data)"
    elif why is not None:
        expected = f"a dense (strided) array, not {why}"
    got = type(a).__name__ if why is None else f"{type(a).__name__} ({why})"
    return errors.DTypeError(op=op.name, arg=arg, constraint=f"{op.name}.array_type", expected=expected, got=got)


def meta_of(op, arg: str, a) -> Meta:
    """The `Meta` of array argument `arg` of op `op`, or its typed error."""
    ad = adapter_for(a)
    if ad is None:
        raise array_type_error(op, arg, a)
    try:
        return ad.meta(a)
    except ValueError as e:  # an array of a kind kernels cannot read (sparse tensors)
        raise array_type_error(op, arg, a, str(e)) from None


def metas_of(op, bound: tuple) -> list:
    """The bound arguments with every array replaced by its `Meta` (None for an absent optional array;
    the array_type error for an absent required one)."""
    metas = list(bound)
    for i in op.array_pos:
        if bound[i] is not None:
            try:
                metas[i] = meta_of(op, op.params[i], bound[i])
            except errors.DTypeError:
                raise _tracer_error(op, bound, i) or sys.exc_info()[1] from None
        elif i not in op.optional_pos:
            raise array_type_error(op, op.params[i], None)
    return metas


def _tracer_error(op, bound: tuple, i: int) -> errors.DTypeError | None:
    """The error for a traced JAX array (argument `i`) that reached the eager dispatcher, or None if it is not one.
    It gets here when the call's first array is a NumPy array (the public functions route only calls whose first
    array is not one: NumPy calls stay cheap), so that argument is named, with the fix; or when the op writes in
    place (JAX arrays are immutable)."""
    jax = sys.modules.get("jax")
    if jax is None or not isinstance(bound[i], jax.core.Tracer):
        return None
    if op.writes:
        return errors.DTypeError(op=op.name, arg=op.params[i], constraint=f"{op.name}.array_type",
                                 expected=f"a NumPy array or torch tensor ({op.name} writes in place; JAX arrays are "
                                          "immutable)", got=f"a traced JAX array ({type(bound[i]).__name__})")
    first = next(j for j in op.array_pos if bound[j] is not None)
    if first == i:  # the dispatcher called directly with a tracer first: the plain array_type error
        return None
    name, traced = op.params[first], op.params[i]
    return errors.DTypeError(op=op.name, arg=name, constraint=f"{op.name}.array_type",
                             expected=f"a JAX array, as {traced!r} is a traced one (inside jax.jit the first array "
                                      f"argument decides how the call is traced: pass jnp.asarray({name}))",
                             got=f"a NumPy array ({type(bound[first]).__name__})")


def python_scalars(op, bound: tuple) -> tuple:
    """The bound arguments with NumPy scalars (np.float32(1e-6), np.bool_(True), np.int64(0)) and 0-d
    NumPy arrays in scalar positions as the Python scalars validation and kernels expect."""
    out = list(bound)
    for i in op.scalar_pos:
        v = bound[i]
        if isinstance(v, np.generic) or (isinstance(v, np.ndarray) and v.ndim == 0):
            out[i] = v.item()
    return tuple(out)
