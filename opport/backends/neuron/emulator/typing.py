"""nki.typing: `nt.tensor[128, 512]` declares the shape a kernel parameter expects (NKI 0.3 release notes).

The emulator checks annotated kernel arguments against the declared shape when the kernel is called
(jit._check_annotations); as a plain annotation elsewhere (a local variable) it is inert, as in Python.
"""

from __future__ import annotations

from opport.backends.neuron.emulator.errors import NkiValidationError


class TensorType:
    """The annotation `tensor[d0, d1, ...]`."""

    def __init__(self, shape: tuple):
        self.shape = tuple(int(n) for n in shape)

    def __repr__(self):
        return f"nki.typing.tensor[{', '.join(map(str, self.shape))}]"

    def __eq__(self, other):
        return isinstance(other, TensorType) and other.shape == self.shape

    def __hash__(self):
        return hash(self.shape)

    def check(self, value, what: str):
        shape = getattr(value, "shape", None)
        if shape is None or tuple(shape) != self.shape:
            raise NkiValidationError(f"{what} is annotated {self!r} but has shape {shape}")


class _TensorAnnotation:
    """`tensor` itself (usable bare, as nki-library does) and `tensor[shape]`."""

    def __getitem__(self, shape) -> TensorType:
        return TensorType(shape if isinstance(shape, tuple) else (shape,))

    def __repr__(self):
        return "nki.typing.tensor"


tensor = _TensorAnnotation()

__all__ = ["tensor", "TensorType"]
