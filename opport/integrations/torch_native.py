"""Native torch autograd nodes for small float32 calls of silu, swiglu, layernorm, rmsnorm and add_rmsnorm on the cpu
backend, and their forwards alone for calls that record nothing (decode: no grad mode, or no input requiring grad);
for rope's training calls, x read in place at its strides; and for float32 attention's training calls as torch's
guest, whose compiled tasks (cpu/_attn_tasks.py) the node runs on torch's pool on q, k, v copied once (docs/cpu.md,
rope's node, attention's node).

Through torch autograd, a decode-sized call (1 x 14336 silu, 1 x 4096 layernorm) is mostly fixed cost: a Python
`torch.autograd.Function` alone costs about 25 us forward + backward (45-70 us with three inputs), its kernels
about 10-20 us, torch's own op 35-45 us in all. The nodes in torch_native.cpp are C++ autograd Functions that call
the fused loops' C entry points (opport/backends/cpu/_cfuncs.py) on the tensors' memory, and the op's cpu kernel
(Python) for a call a loop does not finish (NaN, inf, overflow) or under create_graph=True: the same kernels, the
same bits as the Python Function path (`_Eager` in opport/integrations/torch.py), which every other call keeps.

When a call takes a node (`run`): the dispatcher's plan for it is the op's one cpu kernel, every array is a plain
contiguous float32 CPU tensor (layernorm: weight and bias given) smaller than one block of the kernel's own
block machinery (the size it runs inline on the calling thread anyway), the fused loops are on (`OPPORT_NUMBA`),
and no torch.func transform is active. silu and swiglu (elementwise) also take larger calls as torch's guest
(torch's pool has several threads): their loops then run in ranges of GRAIN elements on torch's pool
(at::parallel_for), the same bits. The rest of a call is the dispatcher's: validation, the backend settings,
strict mode (all through `plan_of`).

The extension is compiled once per machine (`make venv`, beside uv's install, or `python -m
opport.integrations.torch_native`; about 28 s) into torch's extension directory, named by a hash of its source,
flags, torch's and Python's versions (_native_build.py), and only loaded afterwards: a call never compiles. Not
built (or no compiler): the Python Function path runs, the same kernels; `opport doctor` says which (`status()`).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import math
import os
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch

from opport.backends.cpu import _cfuncs, _fused
from opport.backends.cpu._common import PARALLEL_MIN, _blas, block_rows, num_threads
from opport.dispatch import registry
from opport.dispatch.core import plan_of
from opport.integrations._first_order import first_order_grads
from opport.integrations._native_build import build, library_path, module_name

_MODULE = None  # the loaded extension, or False once loading failed (STATUS says why)
STATUS = "not loaded yet"
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_ELIGIBLE: dict = {}  # dispatcher plan -> whether its calls take a node (a plan stands for one selection key)
_BOUND: dict = {}  # op name -> (forward, backward) cpu kernels the node calls where a loop leaves work


def load():
    """The bound extension module, or None (not built, no numba, or it failed to load: STATUS says which)."""
    global _MODULE, STATUS
    if _MODULE is None:
        _MODULE, STATUS = _load()
    return _MODULE or None


def _load():
    try:
        if _cfuncs.addresses() is None:
            return False, "off: numba is not installed (the fused loops are what the nodes run)"
    except Exception as e:  # noqa: BLE001 - a numba that cannot compile them: the Python path, doctor says why
        return False, f"the fused loops' C entry points did not compile: {type(e).__name__}: {e}"
    try:
        path = library_path()  # (torch makes the extension directory if it is missing)
    except OSError as e:
        return False, f"no extension directory: {type(e).__name__}: {e}"
    if not path.exists():
        return False, f"not built ({path.name}): `python -m opport.integrations.torch_native` builds it"
    try:
        loader = importlib.machinery.ExtensionFileLoader(module_name(), str(path))
        spec = importlib.util.spec_from_file_location(module_name(), str(path), loader=loader)
        mod = importlib.util.module_from_spec(spec)
        loader.exec_module(mod)
        _bind(mod)
    except (ImportError, OSError, ValueError, RuntimeError) as e:
        return False, f"failed to load {path}: {type(e).__name__}: {e}"
    return mod, f"loaded ({path})"


def _bind(mod) -> None:
    mod.bind_blas(_blas.enter, _blas.exit)
    for name in _SPECS:
        if not _NODES[name].tasks:  # a task op binds on its first call (_bound): its tasks compile or load then
            _bind_op(mod, name)


def _bind_op(mod, name: str) -> None:
    """The op's C entry points (its fused loops', or its compiled tasks') and Python kernels, into the extension;
    _BOUND[name]: (the op's cpu kernel, the kernel the node calls forward, the backward's)."""
    spec, cpu = _SPECS[name], registry.get_backend("cpu")
    trained = spec.train_forward if _NODES[name].tasks else spec  # the tasks' forward keeps lse: the training kernel's
    kernels = tuple(registry.kernels(s, cpu)[0].fn for s in (spec, trained, spec.backward_op))
    if _NODES[name].tasks:
        from opport.backends.cpu import _attn_tasks

        entries = _attn_tasks.compiled()
        fwd_entry, bwd_entry = entries["forward_entry"], entries["backward_entry"]
        mod.bind_decode(_cfuncs.addresses()["attention_decode"])
    else:
        cf = _cfuncs.addresses()
        fwd_name, bwd_name = _LOOPS.get(name, (f"{name}_forward", f"{name}_backward"))
        fwd_entry, bwd_entry = cf[fwd_name], cf.get(bwd_name, 0)
    entry = _NODES[name].node is not None  # a node: the backward's loop and kernel too
    mod.bind(name, fwd_entry, bwd_entry if entry else 0, _forward(kernels[1]),
             _backward(spec, kernels[2], first_order_grads) if entry else None, _fused.LANES)
    if name in _BACKWARD_TASKS:
        mod.bind_split(name, cf[f"{_BACKWARD_TASKS[name]}_rows"], cf[f"{_BACKWARD_TASKS[name]}_cols"])
    _BOUND[name] = kernels


def _bound(name: str) -> tuple:
    """_BOUND[name], binding the op first where it has not been."""
    if name not in _BOUND:
        _bind_op(_MODULE, name)
    return _BOUND[name]


def _forward(kernel):
    def forward(*args):
        out = kernel(*_numpy(args))
        return [torch.from_numpy(o) for o in (out if isinstance(out, tuple) else (out,))]

    return forward


def _backward(spec, kernel, first_order_grads):
    """The backward node's Python path: the cpu kernel; under create_graph=True its gradients computed without
    recording and refusing a second backward (as `_Eager`'s)."""

    def backward(*args):
        recorded = args[-1]
        with torch.no_grad():
            grads = [torch.from_numpy(g) for g in kernel(*_numpy(args[:-1]))]
        return list(first_order_grads(spec, grads)) if recorded else grads

    return backward


def _numpy(args) -> list:
    return [a.numpy(force=True) if isinstance(a, torch.Tensor) else a for a in args]


def run(spec, bound: tuple, backend: str | None, record: bool = True):
    """The call through its native node (`record`: autograd records it) or the node's forward alone (a call that
    records nothing), or NotImplemented where it does not take one (module docstring)."""
    name = spec.name
    if name not in _SPECS or torch._C._are_functorch_transforms_active():
        return NotImplemented
    for i in spec.array_pos:
        if type(bound[i]) not in _PLAIN:
            return NotImplemented
    plan = plan_of(spec, bound, backend)  # raises the call's own validation errors
    ok = _ELIGIBLE.get(plan)
    if ok is None:
        ok = _eligible(spec, bound, plan)
    native = _NODES[name]
    if (not ok or not _fused.enabled() or (native.node if record else native.forward) is None
            or (native.when and not native.when(bound))):
        return NotImplemented
    budget = num_threads()  # OPPORT_NUM_THREADS validated on every call, as the cpu kernels do
    if ok == _GUEST:  # one block or more: as torch's guest split over torch's pool, whole at a budget of one thread
        if torch.get_num_threads() <= 1 and budget > 1:
            return NotImplemented  # opport's pool runs it, or BLAS gets the budget (the Python path)
        return (native.node if record else native.forward)(_MODULE, bound, GRAIN if budget > 1 else _WHOLE)
    # rmsnorm's, add_rmsnorm's and rope's rows as torch's guest: ranges of GRAIN elements on torch's pool (_SPLIT)
    split = name in _SPLIT and budget > 1 and torch.get_num_threads() > 1
    return (native.node if record else native.forward)(_MODULE, bound, GRAIN if split else _WHOLE)


def _eligible(spec, bound: tuple, plan) -> bool:
    """Whether calls of this plan take the node: the op's cpu kernels are the ones the node was bound to (a kernel
    registered or swapped since makes a new plan, and sends its calls the Python way), the arrays plain float32."""
    cpu = registry.get_backend("cpu")
    native = _NODES[spec.name]
    ok = (load() is not None and plan.check is None and (not native.tasks or _tasks_compile())
          and plan.kernel.fn is _bound(spec.name)[0]
          and tuple(registry.kernels(s, cpu)[0].fn for s in (spec, spec.train_forward if native.tasks else spec,
                                                             spec.backward_op)) == _BOUND[spec.name]
          and all((_strided32 if native.strided else _plain32)(bound[i]) for i in spec.array_pos))
    if ok and native.tasks:
        ok = _GUEST  # the tasks spread over torch's pool, whatever the size
    elif ok:
        x = bound[0]
        n = x.shape[-1] if x.dim() else 1
        ok = 0 < x.numel() < PARALLEL_MIN and (not _NODES[spec.name].row_wise or x.numel() // n <= block_rows(n))
        if not ok and x.numel() >= PARALLEL_MIN and not _NODES[spec.name].row_wise:
            ok = _GUEST
    if len(_ELIGIBLE) >= registry.SELECTIONS_MAX:
        _ELIGIBLE.clear()
    _ELIGIBLE[plan] = ok
    return ok


def _plain32(t) -> bool:
    return _strided32(t) and t.is_contiguous()


def _strided32(t) -> bool:
    """A float32 CPU tensor of any strides (a task op's node copies what is not contiguous, once)."""
    return (t is not None and t.dtype is torch.float32 and t.layout is torch.strided and t.device.type == "cpu"
            and not t.is_neg() and not t.is_conj())


def _tasks_compile() -> bool:
    """Whether attention's compiled tasks exist here (numba and scipy, whose BLAS numba's products call)."""
    from opport.backends.cpu import _attn_tasks

    return _attn_tasks._BLAS and _fused.numba is not None


def status() -> str:
    """Whether the nodes run here, for `opport doctor`."""
    load()
    return STATUS


class _Native(NamedTuple):
    """An op's native calls on its bound arguments. The norms' arrays must all be given (a weight, layernorm's bias):
    _plain32 refuses None."""

    node: Callable | None  # its autograd node (module, bound, grain) (None: calls that record go the Python way)
    forward: Callable | None  # its forward alone (module, bound, grain), for calls that record nothing (None: Python)
    row_wise: bool  # the kernel works on rows: one block must hold whole rows
    when: Callable | None = None  # a check of the call's scalars (not in the plan's cached eligibility)
    tasks: bool = False  # compiled tasks on torch's pool as its guest (budget > 1), else on the calling thread
    strided: bool = False  # arrays of any strides (the node copies what its loops cannot read in place)


_NODES = {
    "silu": _Native(lambda m, b, grain: m.silu(b[0], grain), lambda m, b, grain: m.silu_forward(b[0], grain), False),
    "swiglu": _Native(lambda m, b, grain: m.swiglu(b[0], b[1], grain),
                      lambda m, b, grain: m.swiglu_forward(b[0], b[1], grain), False),
    "layernorm": _Native(lambda m, b, _: m.layernorm(b[0], b[1], b[2], float(b[3])),
                         lambda m, b, _: m.layernorm_forward(b[0], b[1], b[2], float(b[3])), True),
    "rmsnorm": _Native(lambda m, b, grain: m.rmsnorm(b[0], b[1], float(b[2]), grain),
                       lambda m, b, grain: m.rmsnorm_forward(b[0], b[1], float(b[2]), grain), True,
                       lambda b: b[3] == 0),
    "add_rmsnorm": _Native(lambda m, b, grain: tuple(m.add_rmsnorm(b[0], b[1], b[2], float(b[3]), grain)),
                           lambda m, b, grain: tuple(m.add_rmsnorm_forward(b[0], b[1], b[2], float(b[3]), grain)),
                           True),
    # (q, k, v, causal, scale, softcap, sliding_window): training calls the tasks cover; decode steps (one query row
    # per head) without gradients through their own loop
    "attention": _Native(lambda m, b, grain: _attention_node(m, b, grain),
                         lambda m, b, grain: _attention_decode(m, b), False, tasks=True, strided=True),
    # (x, cos, sin, interleaved): x read in place at any strides (q and k are views of the projections)
    "rope": _Native(lambda m, b, grain: m.rope(b[0], b[1], b[2], bool(b[3]), grain),
                    lambda m, b, grain: m.rope_forward(b[0], b[1], b[2], bool(b[3]), grain), False, strided=True),
}
# Elementwise calls of one block or more take the nodes only as torch's guest (torch's pool has several threads), and
# split their loops over that pool in ranges of GRAIN elements (at::parallel_for): opport's own pool gains nothing
# against torch's spinning workers (docs/cpu.md, Threads). Smaller calls run whole on the calling thread.
GRAIN = 1 << 16  # elements per range: ~30-100 us of a loop, well above a range's hand-off
_WHOLE = 1 << 62  # a grain no call reaches: one range
_GUEST = 2  # _eligible's answer for those calls (True: a small call, any threads)
# the C entry points (_cfunc_defs.py) an op's node calls, where not <op>_forward / <op>_backward: add_rmsnorm's forward
# is the sum, then rmsnorm's loop on it; rope's backward is its forward's rows with the sine negated
_LOOPS = {"add_rmsnorm": ("rmsnorm_forward", "add_rmsnorm_backward"), "rope": ("rope_rows", None)}
# nodes whose calls below one block split over torch's pool as its guest in ranges of GRAIN elements (two GRAINs or
# more): rows are independent in their forwards; the norms' backward splits by rows (dx), then by columns (dweight,
# each column summed in row order: _BACKWARD_TASKS), the one loop's bits either way
_SPLIT = frozenset({"rmsnorm", "add_rmsnorm", "rope"})
_BACKWARD_TASKS = {"rmsnorm": "rms_backward", "add_rmsnorm": "rms_backward"}


def _scale(bound) -> float:
    return 1.0 / math.sqrt(bound[0].shape[3]) if bound[4] is None else float(bound[4])


def _attention_node(m, b, grain):
    """attention's node where its tasks cover the call (_attn_tasks.covers: no soft cap, no window, more than one
    query row), else NotImplemented."""
    if b[5] is not None or b[6] is not None or b[0].shape[2] <= 1:
        return NotImplemented
    return m.attention(b[0], b[1], b[2], bool(b[3]), _scale(b), _attention_blocks(b[3], grain != _WHOLE))


def _attention_decode(m, b):
    """A decode step's output (one query row per head) by `_attn_decode` without the dispatcher, for the calls the cpu
    kernel's decode path takes (attention.decode_call); NotImplemented elsewhere."""
    from opport.backends.cpu import attention as cpu_attention

    q, k, v = b[0], b[1], b[2]
    call = None if q.shape[2] != 1 else cpu_attention.decode_call(q, k, v, bool(b[3]), b[4], b[5], b[6])
    if call is None:
        return NotImplemented
    out = m.attention_decode(q, k, v, float(call[0]), 0.0 if b[5] is None else float(b[5]), call[1], call[2])
    return NotImplemented if out is None else out


def _attention_blocks(causal, pool: bool) -> list:
    """The cpu kernel's task blocks (read per call, as the kernel reads them): forward query and key, backward's; then
    1 where the tasks spread over torch's pool (as its guest with a budget > 1), 0 for one after another."""
    from opport.backends.cpu import attention as cpu_attention

    a = cpu_attention
    return [a.TASK_BLOCK_Q_MASKED if causal else a.TASK_BLOCK_Q, a.BLOCK_K, a.TASK_BLOCK_Q_BACKWARD,
            a.TASK_BLOCK_K_BACKWARD, int(pool)]


def _specs() -> dict:
    from opport.ops import get_op

    return {name: get_op(name) for name in _NODES}


_SPECS = _specs()


def _warm_tasks() -> str:
    """Compile (or load) the numba tasks the extension runs on torch's pool (attention's; the fused loops' entry points
    load with the extension): once here, in one process, rather than in every test worker that first meets them."""
    from opport.backends.cpu import _attn_tasks

    if not (_attn_tasks._BLAS and _fused.numba is not None):
        return "attention tasks: off (no numba or no scipy)"
    _attn_tasks.compiled()
    return "attention tasks: compiled"


if __name__ == "__main__":  # python -m opport.integrations.torch_native [--verbose]
    print(f"opport torch_native: built {build(verbose='--verbose' in sys.argv[1:] or bool(os.environ.get('VERBOSE')))}")
    print(f"opport torch_native: {status()}")
    print(f"opport torch_native: {_warm_tasks()}")
