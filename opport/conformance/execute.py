"""Running one case against one backend, in whatever process calls it (a worker, pytest, or the CLI).

A value case calls the op through the dispatcher with `backend=` inside `opport.strict()`, so a
kernel that declines can only skip, never fall back to cpu and pass. It calls three times:
outputs poisoned with NaN, then with a second sentinel, then NaN again (the allocator is poisoned,
since kernels allocate their own outputs); the reference runs between the first and second call.
Results must agree bitwise (unless the kernel declares itself non-deterministic), inputs are
checksummed before and after, and the output is judged by `compare`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import time
import traceback
import warnings
from contextlib import contextmanager

import numpy as np

from opport import accuracy as cmp
from opport.conformance.cases import Item, lay_out, layout_ok
from opport.dispatch import call, clear_cache, explain, kernels, strict
from opport.dispatch.adapters import metas_of
from opport.dispatch.registry import registered
from opport.dtypes import acc_dtype, finfo, np_dtype
from opport.errors import OpError
from opport.ops import get_op
from opport.public import function
from opport.spec import Case

SENTINEL = 1234.5  # the second poison: finite, so it survives where a NaN check would not look
CALLS = 3
BUILTIN_BASES = (TypeError, ValueError, NotImplementedError, RuntimeError)
# Messages after which a device context is unusable (cuml PR #7954): the worker must be replaced.
STICKY = ("illegal memory access", "device-side assert", "unspecified launch failure", "misaligned address",
          "an illegal instruction", "CUDA error: uncorrectable", "NRT_EXEC", "hardware error")


def new_result(item: Item) -> dict:
    return {"id": item.id, "op": item.op, "direction": direction(item.op), "backend": item.backend, "kernel": "",
            "dtype": item.dtype, "case": item.name, "source": item.source, "layout": item.layout,
            "tags": list(item.tags), "status": "pass", "metrics": {}, "message": "", "worst": None}


def direction(op: str) -> str:
    """forward, backward, or forward_train (a forward that also returns saved statistics)."""
    try:
        return get_op(op).direction
    except OpError:  # a name no op has (a preset row of an unknown op): say nothing wrong
        return "forward"


def forward_name(op: str) -> str:
    """The declared op a derived op belongs to (`rmsnorm_backward` -> `rmsnorm`); itself otherwise."""
    try:
        spec = get_op(op)
    except OpError:
        return op
    return spec.forward.name


def run_item(item: Item) -> dict:
    """Run one item; never raises (a harness or kernel exception becomes status `error`)."""
    res = new_result(item)
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore", RuntimeWarning)  # overflow in a kernel is judged by its output
            _dispatch(item, res)
    except Exception as e:  # the kernel (or the case) raised: report it, keep going
        res["status"] = "error"
        res["message"] = f"{type(e).__name__}: {e}\n{_short_tb(e)}"
        if any(s in str(e) for s in STICKY):
            res["status"], res["sticky"] = "crash", True
            res["message"] = "device left unusable (worker replaced): " + res["message"]
    res["duration_s"] = round(time.perf_counter() - t0, 4)
    return res


def _dispatch(item: Item, res: dict):
    if item.source == "error":
        _error_case(item, res)
    elif item.source == "batch":
        _batch_case(item, res)
    elif item.source == "coverage":
        res["status"] = "fail"
        res["message"] = f"declared constraints without a bad-input case: {', '.join(item.missing)}"
    else:
        _value_case(item, res)


_HARNESS = (f"{os.sep}opport{os.sep}conformance{os.sep}", f"{os.sep}opport{os.sep}dispatch{os.sep}",
            f"{os.sep}opport{os.sep}spec.py")


def _short_tb(e: BaseException, frames: int = 4) -> str:
    """The last frames of the traceback that are not the harness or the dispatcher (the kernel's own)."""
    tb = [f for f in traceback.extract_tb(e.__traceback__) if not any(h in f.filename for h in _HARNESS)]
    return "".join(traceback.format_list(tb[-frames:])).rstrip()


# --------------------------------------------------------------------------- value cases


def _value_case(item: Item, res: dict):
    from opport.dispatch import get_backend

    spec, case, b = get_op(item.op), item.case, get_backend(item.backend)
    if case.tolerance is not None and not case.tolerance.reason:
        raise ValueError(f"case {case.name}: tolerance override without a reason")
    laid = lay_out(case, item.layout, _torch_device(b) if item.layout else None)
    if item.layout and not any(layout_ok(v, item.layout) for v in laid.views):
        raise AssertionError(f"layout {item.layout} did not produce a strided view")
    kernel = _chosen_kernel(spec, b, laid, res)
    if kernel is None:
        return
    if spec.writes:
        return _write_case(spec, b, case, item.dtype, laid, kernel, res)
    sums = [checksum(buf) for buf in laid.buffers]
    calls = [_call(spec, b, laid, np.nan)]
    refs = _outputs(spec.run_reference(*laid.ref_args, **laid.ref_kwargs))  # between kernel calls, on purpose
    calls += [_call(spec, b, laid, SENTINEL), _call(spec, b, laid, np.nan)]

    changed = [i for i, buf in enumerate(laid.buffers) if checksum(buf) != sums[i]]
    problems = [f"kernel wrote into its input (argument buffers {changed} changed)"] if changed else []
    bound = spec.bind(*laid.ref_args, **laid.ref_kwargs)
    metas = spec.out_metas(metas_of(spec, bound))
    for outs, why in calls:  # output kind, aliasing, count, dtype and shape before any value
        broken = why or _contract(spec, outs, refs, metas)
        if broken:
            return _fail(res, broken, problems)
    problems += _judge_outputs(spec, case, item.dtype, bound, [outs for outs, _ in calls], refs, metas, kernel, res)
    if problems:
        _fail(res, "; ".join(problems), [])


# --------------------------------------------------------------------------- batch invariance


def _batch_case(item: Item, res: dict):
    """Whether each checked row's outputs are bitwise the same computed in the whole batch, alone (rows 0, n/2 and
    n - 1) and at another position (the batch reversed). res["batch_invariant"] says; the item fails only where
    the backend declares `opport.batch_invariant()` (Capabilities.batch_invariant) and the mode is on."""
    from opport.dispatch import get_backend, is_batch_invariant

    spec, case, b = get_op(item.op), item.case, get_backend(item.backend)
    kernel = _chosen_kernel(spec, b, lay_out(case, None, None), res)
    if kernel is None:
        return
    bound = spec.bind(*case.args, **case.kwargs)
    batched = [spec.params.index(a) for a in spec.batch_args if bound[spec.params.index(a)] is not None]
    n = bound[batched[0]].shape[0]

    def run(index) -> list:
        args = [a[index] if i in batched else a for i, a in enumerate(bound)]
        outs, why = _call(spec, b, lay_out(Case(case.name, tuple(args), {}, case.tags), None, _torch_device(b)),
                          np.nan)
        if why:
            raise AssertionError(why)
        return [o if o is not None and o.ndim and o.shape[0] == len(range(n)[index]) else None for o in outs]

    whole = run(slice(None))
    if all(o is None for o in whole):
        res["status"], res["message"] = "skip", "no output has the batch's axis (a reduced loss)"
        return
    moved = run(slice(None, None, -1))
    differ = [f"row {i} alone" for i in sorted({0, n // 2, n - 1}) if not _same_rows(whole, run(slice(i, i + 1)), i, 0)]
    differ += [f"row {i} moved to {n - 1 - i}" for i in range(n) if not _same_rows(whole, moved, i, n - 1 - i)][:1]
    res["batch_invariant"] = not differ
    res["metrics"] = {"rows": n}
    if differ:
        res["message"] = f"not batch-invariant: {', '.join(differ)} differs from the batch's bits"
        if b.capabilities.batch_invariant and is_batch_invariant():
            res["status"] = "fail"


def _same_rows(a: list, b: list, i: int, j: int) -> bool:
    """Output rows a[k][i] and b[k][j] bitwise equal for every output that has the batch's axis."""
    return all(x is None or y is None or np.array_equal(_bits(x[i]), _bits(y[j])) for x, y in zip(a, b))


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint8)


def _outputs(value) -> list:
    """An op's result as a list of outputs: several for derived ops (gradients; output and statistics)."""
    return [None if v is None else np.asarray(v) for v in value] if isinstance(value, tuple) else [np.asarray(value)]


def _contract(spec, outs: list, refs: list, metas: list) -> str | None:
    if len(outs) != len(refs):
        return f"returned {len(outs)} outputs, expected {len(refs)} ({', '.join(list(spec.output_labels))})"
    for name, o, r, m in zip(list(spec.output_labels), outs, refs, metas):
        if (o is None) != (m is None):
            return f"{name}: {'no output' if o is None else 'an output'} where {'one' if m is not None else 'None'} is due"
        broken = o is not None and cmp.contract(o, r, m[1])
        if broken:
            return broken if len(outs) == 1 else f"{name}: {broken}"
    return None


def _judge_outputs(spec, case, dtype, bound, calls: list, refs: list, metas: list, kernel, res: dict) -> list:
    """`_judge` for each output; one output's metrics are the result's, several keep the worst one's and all."""
    names, problems, per = list(spec.output_labels), [], {}
    plain = functools.cache(lambda out_dtype: plain_numpy(spec, bound, out_dtype))  # once for all outputs
    for j, (name, ref, m) in enumerate(zip(names, refs, metas)):
        if m is None:
            continue
        one = {"metrics": {}, "worst": None}
        found = _judge(spec, case, dtype, bound, [outs[j] for outs in calls], ref, m[1], kernel, one, j, plain)
        problems += found if len(refs) == 1 else [f"{name}: {p}" for p in found]
        per[name] = one
        if one["worst"] is not None and res["worst"] is None:
            res["worst"] = {**one["worst"], "output": name}
    if len(per) == 1 or not per:
        res["metrics"] = next(iter(per.values()))["metrics"] if per else {}
    else:
        worst = max(per, key=lambda n: per[n]["metrics"].get("tol_ratio") or 0.0)
        res["metrics"] = {**per[worst]["metrics"], "output": worst, "outputs": {n: v["metrics"] for n, v in per.items()}}
    return problems


def _chosen_kernel(spec, b, laid, res: dict):
    """The kernel strict dispatch picks for this call on `b`, or None (the case is skipped, with why)."""
    with strict():
        decision = explain(spec, *laid.args, backend=b.name, **laid.kwargs)
    if decision.kernel is None or decision.backend != b.name:
        res["status"], res["message"] = "skip", f"declined by {b.name}: {decision.error or decision.fallback}"
        return None
    res["kernel"] = decision.kernel
    return next(k for k in kernels(spec, b) if k.name == decision.kernel)


def _judge(spec, case, dtype, bound, arrays, ref, out_dtype, kernel, res: dict, index: int, plain) -> list:
    """Values, repeated calls, invariants and the noise floor of output `index`; fills res metrics/worst,
    returns the problems. `plain(out_dtype)`: plain_numpy's outputs (every one), shared by a case's outputs."""
    override = case.tolerance is not None
    tol = spec.tolerance_for(dtype, index, case)
    cancel = _cancel_allowance(spec, bound, dtype, index)
    verdict = cmp.compare(arrays[0], ref, tol, out_dtype, override, cancel)
    res["metrics"] = dict(verdict.metrics)
    problems = []
    if not verdict.ok:
        problems.append(verdict.message)
        res["worst"] = {**verdict.worst, "inputs": _inputs_at(bound, spec, verdict.worst["index"], ref.shape)}
    problems += _repeat_problems(arrays, ref, tol, out_dtype, kernel.deterministic, res, override, cancel)
    out64 = arrays[0].astype(np.float64)
    for inv in spec.invariants if spec.n_outputs == 1 else ():
        msg = inv(out64, *bound)
        if msg:
            problems.append(f"invariant {getattr(inv, '__name__', 'invariant')}: {msg}")
    if verdict.ok:
        floor = cmp.noise_floor(arrays[0], ref, plain(_dtype_name(out_dtype))[index], tol, out_dtype, cancel)
        res["metrics"].update(floor.metrics)
        if not floor.ok:
            problems.append(floor.message)
    return problems


def _cancel_allowance(spec, bound, dtype: str, index: int):
    """One unit roundoff (accumulation dtype) of output `index`'s sum |terms|, for ops that declare `@magnitude`."""
    if spec._magnitude is None:
        return None
    f64 = [a.astype(np.float64) if isinstance(a, np.ndarray) and a.dtype.kind in "fV" else a for a in bound]
    mags = spec.get_magnitude(tuple(f64))
    return cmp.sum_allowance(mags[index] if index < len(mags) else None, acc_dtype(dtype).name)


def _fail(res: dict, msg: str, more: list):
    res["status"] = "fail"
    res["message"] = "; ".join([*more, msg])


def _torch_device(b) -> str | None:
    """Layout views are torch tensors: on the backend's device for torch kernels, on the CPU otherwise."""
    if b.array_kind == "torch":
        return b.torch_device()
    try:
        import torch  # noqa: F401
    except ImportError:
        return None  # NumPy views then
    return "cpu"


def _call(spec, b, laid, poison) -> tuple:
    """([each output as a NumPy copy, None where an output is None], None) or (None, why the outputs break
    the contract). Derived ops (training forward, backward) are called through the dispatcher, as autograd
    and `opport.vjp` call them; ops through their public function."""
    with poisoned(poison), strict():
        if spec.public:
            out = function(spec)(*laid.args, backend=b.name, **laid.kwargs)
        else:
            out = call(spec, spec.bind(*laid.args, **laid.kwargs), b.name)
    first = next(a for a in (*laid.args, *laid.kwargs.values()) if hasattr(a, "shape"))
    outs = []
    for o in out if isinstance(out, tuple) else (out,):
        if o is None:
            outs.append(None)
            continue
        got, why = _as_numpy(o, first, laid)
        if why:
            return None, why
        outs.append(got)
    return outs, None


def _as_numpy(out, like, laid) -> tuple:
    """The output copied to NumPy, after checking it is the input's array kind and aliases no input."""
    torch = sys.modules.get("torch")
    is_torch = torch is not None and isinstance(like, torch.Tensor)
    if is_torch:
        if not isinstance(out, torch.Tensor):
            return None, f"returned {type(out).__name__} for torch input"
        if out.device != like.device:
            return None, f"output on {out.device}, input on {like.device}"
        ptrs = {_storage(a) for a in (*laid.args, *laid.kwargs.values()) if isinstance(a, torch.Tensor)}
        if out.numel() and _storage(out) in ptrs:
            return None, "output aliases an input"
        from opport.dispatch.adapters import TorchAdapter

        return np.array(TorchAdapter.to_numpy(out), copy=True), None
    if isinstance(out, np.generic):
        out = np.asarray(out)
    if not isinstance(out, np.ndarray):
        return None, f"returned {type(out).__name__} for NumPy input"
    if any(isinstance(a, np.ndarray) and out.size and np.shares_memory(out, a) for a in laid.buffers):
        return None, "output aliases an input"
    return np.array(out, copy=True), None


def _storage(t) -> int:
    return t.untyped_storage().data_ptr()


def _repeat_problems(arrays, ref, tol, out_dtype, deterministic: bool, res: dict, override: bool, cancel=None) -> list:
    """Calls 2 and 3 (poisoned with the sentinel, then NaN) must equal call 1 bitwise, or pass on their own."""
    first = arrays[0]
    if not deterministic:
        out = []
        for k, o in enumerate(arrays[1:], 2):
            v = cmp.compare(o, ref, tol, out_dtype, override, cancel)
            if not v.ok:
                out.append(f"call {k}: {v.message}")
        return out
    for k, o in enumerate(arrays[1:], 2):
        if o.tobytes() != first.tobytes():
            diff = _bit_diff(first, o)
            idx = tuple(int(i) for i in np.unravel_index(int(np.flatnonzero(diff)[0]), diff.shape))
            sentinel = np.asarray(SENTINEL).astype(np_dtype(out_dtype)).astype(np.float64)
            unwritten = k == 2 and np.isnan(first.astype(np.float64)[idx]) and o.astype(np.float64)[idx] == sentinel
            res["worst"] = res["worst"] or {"index": idx, "got": float(first[idx]), "call": k, "got_call": float(o[idx])}
            what = "output left unwritten (the poison survived)" if unwritten else "nondeterministic"
            return [f"call {k} differs from call 1 bitwise in {int(diff.sum())} elements ({what}); "
                    f"first at {idx}: {float(first[idx])!r} vs {float(o[idx])!r}"]
    return []


def _bit_diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    u = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    return np.ascontiguousarray(a).view(u) != np.ascontiguousarray(b).view(u)


def _inputs_at(bound: tuple, spec, idx: tuple, shape: tuple) -> dict:
    """The input values behind the worst element: arguments shaped like the output, at the same index."""
    out = {}
    for i in spec.array_pos:
        a = bound[i]
        if isinstance(a, np.ndarray) and a.shape == shape and a.size:
            out[spec.params[i]] = float(a[idx])
    return out


def _dtype_name(dt) -> str:
    return getattr(dt, "name", dt)


def plain_numpy(spec, bound: tuple, out_dtype: str) -> tuple:
    """The reference evaluated in the accumulation dtype (float32 for 16-bit) on the same inputs, each output
    rounded to `out_dtype`: the noise floor a plain same-dtype NumPy implementation reaches."""
    args = list(bound)
    for i in spec.array_pos:
        a = args[i]
        if isinstance(a, np.ndarray) and a.dtype.kind in "fV":
            args[i] = a.astype(acc_dtype(a.dtype.name))
    with np.errstate(all="ignore"):
        r = spec.call_reference(args, _dtype_name(out_dtype))  # ops that round part-way: to the output dtype
        return tuple(None if o is None else np.asarray(o).astype(np_dtype(out_dtype))
                     for o in (r if isinstance(r, tuple) else (r,)))


def checksum(buf) -> bytes:
    """blake2b of an array's bytes (torch tensors are read back to the host)."""
    if not isinstance(buf, np.ndarray):
        from opport.dispatch.adapters import TorchAdapter

        buf = TorchAdapter.to_numpy(buf)
    flat = np.ascontiguousarray(buf).reshape(-1)
    return hashlib.blake2b(flat.view(np.uint8).data if flat.size else b"").digest()


# --------------------------------------------------------------------------- ops that write in place


def _write_case(spec, b, case, dtype: str, laid, kernel, res: dict):
    """An op declared with `writes=`: called three times, each time on the written arguments as they were
    before; each call must return None, leave the declared region (`@<op>.written`) holding the reference's
    values (judged with the op's tolerance: exact for a copy), every other element of the written arguments
    bitwise unchanged, the memory around strided views untouched and every other input unchanged; the calls
    must agree bitwise."""
    bound = list(spec.bind(*laid.args, **laid.kwargs))
    ref_bound = spec.bind(*laid.ref_args, **laid.ref_kwargs)
    before = [np.array(_host(ref_bound[i]), copy=True) for i in spec.write_pos]
    if not _laid_out(laid, bound, spec.write_pos):  # the case's own arrays: the kernel writes copies of them
        for i, a in zip(spec.write_pos, before):
            bound[i] = a.copy()
    refs = _outputs(spec.run_reference(*ref_bound))
    regions = spec.written_region(ref_bound)
    sums = [checksum(buf) for buf in laid.buffers]
    problems, firsts = [], None
    for k in range(1, CALLS + 1):
        for i, a in zip(spec.write_pos, before):
            _assign(bound[i], a)
        with poisoned(np.nan if k != 2 else SENTINEL), strict():
            ret = function(spec)(*bound, backend=b.name)
        if ret is not None:
            return _fail(res, f"returned {type(ret).__name__}, expected None (the op writes {', '.join(spec.writes)} "
                              "in place)", [])
        after = [np.array(_host(bound[i]), copy=True) for i in spec.write_pos]
        if firsts is None:
            firsts = after
            for i, (name, got, old, ref, region) in enumerate(zip(spec.writes, after, before, refs, regions)):
                problems += [f"{name}: {p}" for p in _judge_written(spec, case, dtype, i, got, old, ref, region, res)]
        else:
            diff = [n for n, x, y in zip(spec.writes, firsts, after) if x.tobytes() != y.tobytes()]
            if diff:
                problems.append(f"call {k} wrote {', '.join(diff)} differently from call 1 (nondeterministic)")
        for i, a in zip(spec.write_pos, before):  # restored, the buffers must be as they were: gaps untouched
            _assign(bound[i], a)
        changed = [j for j, buf in enumerate(laid.buffers) if checksum(buf) != sums[j]]
        if changed:
            problems.append(f"call {k} wrote outside its written arguments' views or into an input "
                            f"(argument buffers {changed} changed)")
            break
    if problems:
        _fail(res, "; ".join(problems), [])


def _laid_out(laid, bound: list, positions: tuple) -> bool:
    """Whether the written arguments are layout views or moved tensors (fresh buffers) rather than the case's own
    arrays."""
    return all(any(bound[i] is v for v in (*laid.views, *laid.moved)) for i in positions)


def _judge_written(spec, case, dtype: str, index: int, got, old, ref, region, res: dict) -> list:
    """Written array `index`'s region against the reference (its own tolerance, in its own dtype: an fp8 cache's
    codes by fp8 ulps); everything else bitwise as it was."""
    tol = spec.tolerance_for(dtype, index, case)
    verdict = cmp.compare(got[region], np.asarray(ref, np.float64), tol, str(got.dtype), case.tolerance is not None)
    res["metrics"] = {**res["metrics"], **verdict.metrics} if res["metrics"] else dict(verdict.metrics)
    out = [] if verdict.ok else [f"written region: {verdict.message}"]
    keep = np.ones(got.shape, bool)
    keep[region] = False
    moved = int(_bit_diff(got[keep], old[keep]).sum()) if keep.any() else 0
    if moved:
        out.append(f"{moved} elements outside the written region changed")
    return out


def _host(a) -> np.ndarray:
    if isinstance(a, np.ndarray):
        return a
    from opport.dispatch.adapters import TorchAdapter

    return TorchAdapter.to_numpy(a)


def _assign(dst, values: np.ndarray):
    """dst[...] = values, for a NumPy array or a torch tensor (view)."""
    if isinstance(dst, np.ndarray):
        dst[...] = values
        return
    from opport.dispatch.adapters import NumpyAdapter

    dst.copy_(NumpyAdapter.to_torch(np.ascontiguousarray(values), str(dst.device)))


# --------------------------------------------------------------------------- poisoning


@contextmanager
def poisoned(value: float):
    """Every float buffer from np.empty/np.empty_like (and torch.empty*, when torch is loaded) starts as `value`.

    Kernels allocate their own outputs, so poisoning the allocator is how an unwritten element shows:
    it keeps the poison, and the two poisons differ.
    """
    patches = [(np, "empty", _filled(np.empty, value)), (np, "empty_like", _filled(np.empty_like, value))]
    torch = sys.modules.get("torch")
    if torch is not None:
        patches += [(torch, n, _filled_torch(getattr(torch, n), value)) for n in ("empty", "empty_like", "empty_strided")]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
    for mod, name, fn in patches:
        setattr(mod, name, fn)
    try:
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def _filled(alloc, value):
    def empty(*args, **kwargs):
        out = alloc(*args, **kwargs)
        if out.dtype.kind in "fcV" and out.dtype.fields is None:
            out.fill(_fits(value, out.dtype.itemsize, lambda: float(finfo(out.dtype.name).max)))
        elif out.dtype.kind == "i":  # integer outputs (indices, offsets): two poisons that differ, as NaN does not fit
            out.fill(_int_poison(value))
        return out

    return empty


def _fits(value: float, itemsize: int, fmax) -> float:
    """The poison as an 8-bit float holds it: the sentinel saturates to the format's max (torch refuses an
    overflowing fill; ml_dtypes would make it NaN, the other poison)."""
    return min(value, fmax()) if itemsize == 1 and value == value else value


def _int_poison(value: float) -> int:
    """The integer stand-in of a poison: -1 for NaN's call, 77 for the sentinel's (both fit int8, neither is an index
    a kernel would write for an empty input)."""
    return -1 if value != value else 77


def _filled_torch(alloc, value):
    def empty(*args, **kwargs):
        out = alloc(*args, **kwargs)
        if out.device.type == "meta":
            return out
        if out.is_floating_point():
            out.fill_(_fits(value, out.element_size(), lambda: float(sys.modules["torch"].finfo(out.dtype).max)))
        elif out.dtype.is_signed and not out.is_complex() and out.dtype != sys.modules["torch"].bool:
            out.fill_(_int_poison(value))
        return out

    return empty


# --------------------------------------------------------------------------- bad inputs


def _error_case(item: Item, res: dict):
    """The declared error class with the declared constraint id, before any kernel runs, inputs untouched."""
    from opport.dispatch import get_backend

    spec, ec, b = get_op(item.op), item.error, get_backend(item.backend)
    res["kernel"] = "-"
    arrays = [a for a in (*ec.args, *ec.kwargs.values()) if hasattr(a, "shape") and not getattr(a, "is_meta", False)]
    sums = [checksum(a) for a in arrays]
    ran: list = []
    got = None
    kernels(spec, b)  # load the backend's kernels so the tripwire covers them
    with tripwire(spec, ran):
        try:
            with strict():
                out = function(spec)(*ec.args, backend=b.name, **ec.kwargs)
        except Exception as e:  # what we are here to look at
            got = e
    problems = []
    if got is None:
        problems.append(f"returned {type(out).__name__} instead of raising {ec.error.__name__} [{ec.constraint}]")
    else:
        problems += _error_problems(spec, ec, got)
    if ran:
        problems.append(f"kernel {ran[0]} ran before the error")
    if any(checksum(a) != s for a, s in zip(arrays, sums)):
        problems.append("an input was modified")
    res["metrics"] = {}
    if problems:
        _fail(res, "; ".join(problems), [])
    else:
        res["message"] = f"{type(got).__name__}: {got}"


def _error_problems(spec, ec, e) -> list:
    name = f"{type(e).__name__}: {e}"
    if not isinstance(e, ec.error):
        return [f"raised {name}, expected {ec.error.__name__} [{ec.constraint}]"]
    out = []
    if not isinstance(e, OpError) or not isinstance(e, BUILTIN_BASES):
        out.append(f"{type(e).__name__} is not an opport.OpError that is also a builtin error")
    if getattr(e, "constraint", None) != ec.constraint:
        out.append(f"constraint {getattr(e, 'constraint', None)!r}, expected {ec.constraint!r}")
    if getattr(e, "op", None) != spec.name:
        out.append(f"error names op {getattr(e, 'op', None)!r}, expected {spec.name!r}")
    missing = [a for a in ("arg", "expected", "got") if not hasattr(e, a)]
    if missing:
        out.append(f"error lacks {missing}")
    return out


@contextmanager
def tripwire(spec, ran: list):
    """Replace every loaded kernel of `spec` with one that records that it ran, then restore them."""
    saved = []
    for k in registered(spec):
        saved.append((k, k.fn))
        k.fn = _tripped(k, ran)
    clear_cache()
    try:
        yield
    finally:
        for k, fn in saved:
            k.fn = fn
        clear_cache()


def _tripped(k, ran):
    def fn(*args, **kwargs):
        ran.append(k.name)
        raise RuntimeError(f"tripwire: kernel {k.name} ran on a bad input")

    return fn
