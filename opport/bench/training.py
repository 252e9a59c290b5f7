"""The training passes of `opport bench`: forward+backward ("fwd+bwd") and the backward alone ("bwd").

What each provider runs (docs/benchmarking.md, "Training passes"), on the same inputs and the same
upstream gradient `g` (seeded, shaped and typed like the op's output; 1 for a 0-d output, a loss, as
`loss.backward()` seeds it):

    fwd+bwd  opport         y = opport.<op>(*leaves, backend=B); torch.autograd.grad(y, leaves, g): the
                            training forward and backward kernels as a torch training loop runs them
                            (without torch: opport.vjp(...) and its pullback on the kernels' arrays);
                            where the backend has the op's fused value-and-grad (cross_entropy), that is
                            what runs, and the row's kernel and cost say so ("<kernel> + scale")
             torch_eager    the same autograd call on the workload's torch function
             torch_compile  the same on torch.compile of that function (forward and backward compiled)
    bwd      opport         opport.dispatch.call(<op>_backward, (g, *saved), B) on what opport's training
                            forward saved: what a pullback runs
             torch_*        torch.autograd.grad(y, leaves, g, retain_graph=True) on a graph recorded once

Every provider's gradients are judged, before anything is timed, with the backward's per-gradient
tolerance against the float64 vector-Jacobian product on what the forward saves, rounded as it is saved
(the output in its dtype, statistics in float32), as the conformance suite judges a backward: the
tolerances are made for that. A 16-bit softmax's dx = y (g - sum(g y)) cancels where g is near sum(g y),
so against the VJP of the exact y every implementation that saves a 16-bit y (torch's too) misses some
elements. The reference is the op's NumPy reference VJP for NumPy backends; for torch backends (LLM
shapes, on the device) torch float64 autograd of the workload's reference, or, for ops whose backward
reads the forward's output, the workload's `torch_vjp_reference` on that output rounded to its dtype.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import warnings
from dataclasses import dataclass

import numpy as np

from opport import accuracy, autodiff
from opport.bench.workloads import ArrayMaker
from opport.dispatch import FallbackWarning, call, explain, get_backend, kernels
from opport.dispatch.adapters import NumpyAdapter, metas_of
from opport.dtypes import np_dtype
from opport.public import function, vjp
from opport.spec import Case, Cost

PASSES = ("fwd", "fwd+bwd", "bwd")
TRAINING = ("fwd+bwd", "bwd")
DEFAULT_PASSES = ("fwd", "fwd+bwd")  # bwd alone is a diagnostic (which half is slow): asked for with --pass


def has_backward(spec, backend: str) -> bool:
    """Whether `backend` registers a kernel for the op's backward: only such ops get training rows."""
    return spec.backward_op is not None and bool(kernels(spec.backward_op, get_backend(backend)))


def has_torch() -> bool:
    return importlib.util.find_spec("torch") is not None


def uses_autograd(kind: str) -> bool:
    """opport's fwd+bwd runs through torch autograd wherever torch is installed (what training code runs)."""
    return kind == "torch" or has_torch()


@dataclass
class Problem:
    """One shape's training problem, shared by every provider of both training passes."""

    names: tuple  # the differentiable inputs present, in the backward's `wrt` order
    grad: object  # the upstream gradient, in the kernels' array kind (a tuple, one per output, for add_rmsnorm)
    saved: tuple  # the backward op's arguments, (g, *what opport's training forward saved)
    cost: Cost  # the backward's minimum bytes and FLOPs on `saved`
    kernel: str  # which kernels run: "<training forward kernel> + <backward kernel>"
    ref: tuple | Exception  # float64 reference gradients, or why they could not be computed
    tols: tuple  # per gradient: the backward's tolerance for it
    dtypes: tuple  # per gradient: its input's dtype, which the gradient must have
    fused_cost: Cost | None = None  # fwd+bwd through the op's fused value-and-grad (what training runs): its cost


def kernel_for(op, bound: tuple, backend: str):
    """(kernel name, None) when `backend` has a kernel that takes the call, else (None, why not)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        d = explain(op, *bound, backend=backend)
    if d.kernel is None or d.backend != backend:
        return None, f"no {backend} kernel for {op.name} takes it: {d.fallback or d.error or 'no kernel'}"
    return d.kernel, None


def problem(spec, wl, bound: tuple, dtype: str, where: tuple, seed: int) -> Problem | str:
    """The training problem on these inputs, or why the backend's kernels do not take it.

    `where` is (backend, array kind, device). Runs opport's training forward once (untimed) for what the
    backward receives, whose shapes its cost model reads."""
    backend, kind, device = where
    bwd, trained = spec.backward_op, spec.train_forward or spec
    fwd_kernel, why = kernel_for(trained, bound, backend)
    if why:
        return why
    out, stats = autodiff.training_forward(spec, bound, backend)
    maker = ArrayMaker(kind, device, seed)
    outs = floating(spec, out)
    grad = tuple(_upstream(o, maker) for o in outs) if isinstance(outs, tuple) else _upstream(outs, maker)
    saved = (*(grad if isinstance(grad, tuple) else (grad,)), *autodiff.saved_values(spec, bound, out, stats))
    bwd_kernel, why = kernel_for(bwd, saved, backend)
    if why:
        return why
    names = tuple(n for n in bwd.wrt if bound[spec.params.index(n)] is not None)
    kernel, fused_cost = f"{fwd_kernel} + {bwd_kernel}", None
    if autodiff.fused_op(spec, bound, backend) is not None:  # training runs the fused value-and-grad instead
        vag = spec.value_and_grad_op
        kernel = f"{kernel_for(vag, bound, backend)[0]} + scale" + (" (skipped: upstream 1)" if out.ndim == 0 else "")
        fused_cost = vag.get_cost(*metas_of(vag, bound))
        if out.ndim:  # the upstream is not 1: the scale reads and writes each gradient once more
            grads = sum(math.prod(m[0]) * np.dtype(np_dtype(m[1])).itemsize for m in vag.out_metas(metas_of(vag, bound))[1:]
                        if m is not None)
            fused_cost = Cost(fused_cost.bytes + 2 * grads, fused_cost.flops)
    return Problem(names, grad, saved, bwd.get_cost(*metas_of(bwd, saved)), kernel,
                   _reference(spec, wl, bound, grad, names, kind, dtype),
                   tuple(bwd.tolerance_for(dtype, bwd.wrt.index(n)) for n in names),
                   tuple(accuracy.dtype_name(bound[spec.params.index(n)]) for n in names), fused_cost)


def pass_cost(pass_: str, fwd_cost: Cost, prob: Problem) -> Cost:
    """The row's minimum bytes and FLOPs: the forward's plus the backward's for fwd+bwd, the backward's alone for bwd."""
    if pass_ == "fwd+bwd" and prob.fused_cost is not None:  # one pass: the fused value-and-grad (and its scale)
        return prob.fused_cost
    if pass_ == "fwd+bwd":
        return Cost(fwd_cost.bytes + prob.cost.bytes, fwd_cost.flops + prob.cost.flops)
    return prob.cost


def floating(spec, outs):
    """Of an op's outputs (or values per output), those of its floating outputs, which take an upstream gradient: an
    integer output (a router's indices, group offsets) takes none. One left is returned as it is, not as a tuple."""
    if not isinstance(outs, tuple) or not spec.integer_outputs:
        return outs
    kept = autodiff.floating_grads(spec, outs)
    return kept[0] if len(kept) == 1 else kept


def _upstream(out, maker: ArrayMaker):
    """A seeded normal gradient shaped and typed like `out`; 1 for a 0-d output (a loss), as `loss.backward()`
    seeds it (what lets cross_entropy's fused path skip its scale: the rows time what training runs)."""
    g = maker.normal(tuple(out.shape), accuracy.dtype_name(out))
    if not g.shape:
        g = g * 0 + 1
    return np.asarray(g) if maker.kind == "numpy" else g


def _reference(spec, wl, bound, grad, names, kind: str, dtype: str):
    try:
        if kind == "numpy":
            return numpy_reference(spec, bound, grad, names, dtype)
        # an op with no torch form (a plugin's), or one whose reference rounds part-way to the dtype under test
        # (add_rmsnorm's sum, which a float64 torch form would not): the NumPy VJP
        if (wl.torch_reference or wl.torch_eager) is None or spec.reference_takes_dtype:
            from opport.dispatch.adapters import TorchAdapter

            host = tuple(TorchAdapter.to_numpy(a) if hasattr(a, "device") else a for a in bound)
            g = tuple(map(TorchAdapter.to_numpy, grad)) if isinstance(grad, tuple) else TorchAdapter.to_numpy(grad)
            return numpy_reference(spec, host, g, names, dtype)
        return torch_reference(spec, wl, bound, grad, names)
    except Exception as e:  # the rows are then unchecked, and say why
        return e


def numpy_reference(spec, bound: tuple, grad, names: tuple, dtype: str) -> tuple:
    """The op's float64 reference VJP on the backward's arguments as the conformance suite builds them: the
    float64 forward's output and statistics rounded as they are saved."""
    bwd = spec.backward_op
    full = bwd.run_reference(*bwd.from_forward(Case("bench", bound), dtype, grad=grad).args)
    return tuple(full[bwd.wrt.index(n)] for n in names)


def torch_reference(spec, wl, bound: tuple, grad, names: tuple) -> tuple:
    """float64 gradients on float64 copies of the inputs, on their device: the workload's `torch_vjp_reference`
    on the output rounded to its dtype where the backward reads the output, else autograd of its reference."""
    import torch

    b64 = [a.detach().double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in bound]
    forward = wl.torch_reference or wl.torch_eager
    bwd = spec.backward_op
    if "out" in bwd.params:
        if wl.torch_vjp_reference is None:
            raise ValueError(f"{bwd.name} reads the forward's output and workloads/{spec.name}.py declares no "
                             "torch_vjp_reference to judge it on that output as saved")
        with torch.no_grad():
            out = floating(spec, forward(*b64)).to(getattr(torch, spec.out_dtype(metas_of(spec, bound)))).double()
            full = wl.torch_vjp_reference(grad.double(), out, *b64)
        return tuple(full[bwd.wrt.index(n)] for n in names)
    leaves = [b64[spec.params.index(n)].requires_grad_(True) for n in names]
    with torch.enable_grad():
        y = floating(spec, forward(*b64))
    return torch.autograd.grad(y, leaves, tuple(g.double() for g in grad) if isinstance(grad, tuple) else grad.double())


def judge(grads, prob: Problem) -> dict:
    """Row fields: `correct`, the worst gradient's metrics, `grads` (per gradient) and `error_detail`."""
    per, detail = {}, None
    for n, got, ref, tol, dt in zip(prob.names, grads, prob.ref, prob.tols, prob.dtypes):
        got = accuracy.like(got, ref)
        broken = accuracy.contract(got, ref, dt)
        v = accuracy.compare(got, ref, tol, dt) if broken is None else accuracy.Verdict(False, {}, broken)
        per[n] = {"ok": v.ok, **v.metrics}
        detail = detail or (None if v.ok else f"d{n}: {v.message}")
    worst = max(per.values(), key=lambda m: m.get("tol_ratio", float("inf")))
    fields = {k: v for k, v in worst.items() if k != "ok"}
    fields.update(correct=detail is None, grads=per, mismatches=sum(m.get("mismatches", 0) for m in per.values()))
    return {**fields, "error_detail": detail} if detail else fields


# --------------------------------------------------------------------------- what each provider runs


def providers(pass_: str, spec, wl, bound: tuple, prob: Problem, st) -> list:
    """(impl, call, fn, compiled) per provider of one training pass; fn() returns the gradients of `names`."""
    mine = _opport_fwd_bwd(spec, bound, prob, st) if pass_ == "fwd+bwd" else _opport_bwd(spec, prob, st)
    if wl.torch_eager is None or not has_torch():
        return [mine]
    tb, leaves, g = _torch_leaves(spec, bound, prob, st)
    fns = [("torch_eager", wl.torch_call, wl.torch_eager, False)]
    fns += [(name, desc, fn, False) for name, desc, fn in wl.torch_others]
    if st.compile:
        import torch

        torch._dynamo.reset()  # every shape compiles afresh, as the forward's baseline does
        fns.append(("torch_compile", f"torch.compile({wl.torch_eager.__name__}, dynamic=False, "
                                     f"mode={st.compile_mode!r})", torch.compile(wl.torch_eager, dynamic=False,
                                                                                  mode=st.compile_mode), True))
    make = _autograd_fwd_bwd if pass_ == "fwd+bwd" else _autograd_bwd
    return [mine] + [(impl, *make(_floating_fn(spec, f), desc, tb, leaves, g), compiled) for impl, desc, f, compiled in fns]


def _floating_fn(spec, f):
    """f returning only its floating outputs (what autograd differentiates), or f itself for an op without integer
    outputs."""
    return f if not spec.integer_outputs else lambda *a, **kw: floating(spec, f(*a, **kw))


def _opport_fwd_bwd(spec, bound, prob: Problem, st) -> tuple:
    if uses_autograd(st.kind):
        tb, leaves, g = _torch_leaves(spec, bound, prob, st)
        desc, fn = _autograd_fwd_bwd(_floating_fn(spec, function(spec)), f"opport.{spec.name}(..., backend={st.backend!r})",
                                     tb, leaves, g,
                                     backend=st.backend)
        return "opport", f"{desc} -> {prob.kernel}", fn, False
    return ("opport", f"out, pullback = opport.vjp({spec.name!r}, ..., backend={st.backend!r}); pullback(g) -> "
                      f"{prob.kernel}", pullback_call(spec, bound, prob, st.backend), False)


def _opport_bwd(spec, prob: Problem, st) -> tuple:
    kernel = prob.kernel.split(" + ")[-1]
    return ("opport", f"opport.dispatch.call({spec.backward_op.name}, (g, *saved), backend={st.backend!r}) -> {kernel}",
            backward_call(spec, prob, st.backend), False)


def pullback_call(spec, bound: tuple, prob: Problem, backend: str):
    """fn() -> gradients: `opport.vjp` and its pullback on the kernels' own arrays (no framework)."""
    present = _picker(spec.backward_op.wrt, prob.names)

    def fn():
        _, pullback = vjp(spec, *bound, backend=backend)
        return present(pullback(prob.grad))

    return fn


def backward_call(spec, prob: Problem, backend: str):
    """fn() -> gradients: the backward op alone, through the dispatcher, on what the training forward saved."""
    bwd, present = spec.backward_op, _picker(spec.backward_op.wrt, prob.names)
    return lambda: present(call(bwd, prob.saved, backend))


def _picker(wrt: tuple, names: tuple):
    """From one gradient per name in `wrt` (None for an absent input), the gradients of `names`."""
    idx = [wrt.index(n) for n in names]
    return lambda grads: tuple(grads[i] for i in idx)


def _autograd_fwd_bwd(f, desc: str, tb: tuple, leaves: list, g, **kw) -> tuple:
    import torch

    return f"y = {desc}; torch.autograd.grad(y, leaves, g)", lambda: torch.autograd.grad(f(*tb, **kw), leaves, g)


def _autograd_bwd(f, desc: str, tb: tuple, leaves: list, g) -> tuple:
    """The backward alone: the forward records its graph once, here, untimed (a compiled forward compiles here)."""
    import torch

    with torch.enable_grad(), _keep_saved_buffers():
        y = f(*tb)
    return (f"y = {desc} (once); torch.autograd.grad(y, leaves, g, retain_graph=True)",
            lambda: torch.autograd.grad(y, leaves, g, retain_graph=True))


def _keep_saved_buffers():
    """A compiled backward frees ("donates") its saved buffers and then refuses retain_graph=True; timing it more
    than once needs them kept (a memory optimisation only: the backward's code is the same)."""
    try:
        from torch._functorch import config

        return config.patch(donated_buffer=False)
    except (ImportError, AttributeError):  # a torch without the option: nothing is donated
        return contextlib.nullcontext()


def _torch_leaves(spec, bound: tuple, prob: Problem, st) -> tuple:
    """(torch arguments, the leaves among them that require grad, the upstream gradient as a tensor), on fresh
    tensors sharing the inputs' memory: the forward pass's tensors never require grad."""
    import torch

    tb = [_tensor(a, st.kind) for a in bound]
    tb = [a.detach() if isinstance(a, torch.Tensor) else a for a in tb]
    leaves = [tb[spec.params.index(n)].requires_grad_(True) for n in prob.names]
    g = tuple(_tensor(a, st.kind) for a in prob.grad) if isinstance(prob.grad, tuple) else _tensor(prob.grad, st.kind)
    return tuple(tb), leaves, g


def _tensor(a, kind: str):
    """A NumPy backend's array as a CPU tensor (bfloat16 bit-exact); anything else as it is."""
    return NumpyAdapter.to_torch(a, "cpu") if kind == "numpy" and isinstance(a, np.ndarray) else a
