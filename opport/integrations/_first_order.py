"""Gradients that may be used but not differentiated: what opport's torch autograd paths (the Python Function in
opport/integrations/torch.py, the native nodes in torch_native.py) return under create_graph=True, since opport's
backward kernels have no backward of their own."""

from __future__ import annotations

import torch

from opport import errors


def first_order_grads(spec, grads) -> tuple:
    """Gradients made part of the graph (create_graph=True) that raise UnsupportedError if differentiated again."""
    anchor = torch.zeros((), requires_grad=True)  # makes them part of the graph, whatever they came from
    return tuple(None if g is None else _FirstOrder.apply(spec, g, anchor) for g in grads)


class _FirstOrder(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec, g, anchor):
        ctx.spec = spec
        return g.view_as(g)

    @staticmethod
    def backward(ctx, _):
        raise double_backward_error(ctx.spec)


def double_backward_error(spec) -> errors.UnsupportedError:
    return errors.UnsupportedError(op=spec.name, arg=None, constraint=f"{spec.name}.double_backward",
                                   expected="first derivatives only", got="a second backward",
                                   message=f"{spec.name}: double backward (gradients of gradients) is not "
                                           "supported by opport's backward kernels")
