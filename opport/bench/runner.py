"""One benchmark problem: build inputs, check every provider against the reference, time them interleaved.

Providers are opport (the public call, dispatch included) and the baselines a user would call instead,
all on the same inputs in the same process: torch eager (and torch.compile where the backend's bench
module asks for it, or with --compile) on the backend's torch device, plus a NumPy composition for
NumPy backends. Every output is judged by opport.accuracy against a float64 reference: the op's NumPy
reference for NumPy backends, torch on float64 copies of the same (already rounded) inputs, on the
device, for torch backends (NumPy would take longer than the whole benchmark on LLM shapes).

Passes: "fwd" times the op's forward as above; "fwd+bwd" and "bwd" (ops with a backward kernel on the
backend) time the training forward plus backward and the backward alone, with gradients judged against
the float64 VJP on the values the forward saves (opport/bench/training.py). Every row says its `pass`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import numpy as np

from opport import accuracy
from opport.bench import training
from opport.bench.timing import summarize
from opport.bench.workloads import ArrayMaker, seed_for
from opport.dispatch import FallbackWarning, explain
from opport.dispatch.adapters import metas_of
from opport.public import function

LAUNCH_BOUND_BYTES = 8 << 20  # docs/performance.md section 4: small/latency-bound shapes (< ~8 MB working set)
LAUNCH_BOUND_FLOOR_MS = 0.010


@dataclass
class Settings:
    backend: str
    kind: str  # what the backend's kernels take: "numpy" or "torch"
    device: str  # where inputs live
    timer: object
    ceilings: object
    rounds: int = 2
    budget_ms: float | None = None  # per provider, summed over the rounds
    compile: bool = False
    compile_mode: str = "default"
    graphs: bool = False  # CUDA-graph variant and host wall time for launch-bound shapes
    max_minutes: float | None = None  # the backend's default time limit for a run
    passes: tuple = ("fwd",)  # fwd, fwd+bwd, bwd (opport/bench/training.py)
    batch_invariant: bool = False  # also time opport under opport.batch_invariant() (the opport_invariant row)


@dataclass
class Provider:
    impl: str
    call: str
    fn: Callable
    compiled: bool = False
    unchecked: str | None = None  # why its output is not judged against the op's reference (a different op's)


def run_shape(spec, wl, shape, dtype: str, st: Settings) -> list:
    """Rows (dicts) for every provider and pass on one shape and dtype; errors become rows, never exceptions."""
    base = {"op": spec.name, "shape": shape.label, "case": shape.name, "dims": shape.dims, "dtype": dtype}
    passes = passes_for(spec, st.backend, st.passes)
    try:
        kw = wl.make(shape.dims, dtype, ArrayMaker(st.kind, st.device, seed_for(spec.name, shape.name, dtype)))
        bound = spec.bind(**kw)
        cost = spec.get_cost(*metas_of(spec, bound))
    except Exception as e:
        return [{**base, "pass": p, "impl": "opport", "status": "error", "error": f"{type(e).__name__}: {e}"}
                for p in passes]
    rows = _forward_rows(spec, wl, bound, cost, dtype, st, {**base, "pass": "fwd"}) if "fwd" in passes else []
    train = [p for p in passes if p in training.TRAINING]
    if train:
        rows += _training_rows(spec, wl, bound, cost, dtype, st, base, train)
    return rows


def passes_for(spec, backend: str, passes) -> list:
    """The passes that make rows for this op: the forward always, the training passes where the backend has a
    kernel for the op's backward."""
    return [p for p in passes if p == "fwd" or training.has_backward(spec, backend)]


def _forward_rows(spec, wl, bound, cost, dtype: str, st: Settings, base: dict) -> list:
    try:
        decision = _explain(spec, bound, st.backend)
    except Exception as e:
        return [{**base, "impl": "opport", "status": "error", "error": f"{type(e).__name__}: {e}"}]
    if decision.kernel is None or decision.backend != st.backend:
        why = decision.fallback or decision.error or "no kernel"
        return [{**base, "impl": "opport", "status": "skip", "error": f"no {st.backend} kernel takes it: {why}"}]
    base.update(bytes=cost.bytes, flops=cost.flops)
    providers = _providers(spec, wl, bound, st, decision.kernel)
    ref = _reference(spec, wl, bound, st.kind)
    out_dtype = spec.out_dtype(metas_of(spec, bound))
    rows = [_check(p, ref, spec, dtype, out_dtype, st, base, bound) for p in providers]
    live = [(p, r) for p, r in zip(providers, rows) if r["status"] != "error"]
    _time_all(live, st, cost, dtype)
    _add_ratios(rows)
    return rows


def _training_rows(spec, wl, bound, fwd_cost, dtype: str, st: Settings, base: dict, passes: list) -> list:
    """fwd+bwd and bwd rows (opport/bench/training.py): the training forward runs once, untimed, for what the
    backward receives; each pass is then checked and timed like the forward, providers interleaved."""
    seed = seed_for(spec.name, base["case"], dtype, "grad")
    try:
        prob = training.problem(spec, wl, bound, dtype, (st.backend, st.kind, st.device), seed)
    except Exception as e:
        return [{**base, "pass": p, "impl": "opport", "status": "error", "error": f"{type(e).__name__}: {e}"}
                for p in passes]
    if isinstance(prob, str):
        return [{**base, "pass": p, "impl": "opport", "status": "skip", "error": prob} for p in passes]
    rows = []
    for p in passes:
        cost = training.pass_cost(p, fwd_cost, prob)
        rows += _training_pass(p, spec, wl, bound, prob, cost, dtype, st,
                               {**base, "pass": p, "bytes": cost.bytes, "flops": cost.flops})
    return rows


def _training_pass(pass_: str, spec, wl, bound, prob, cost, dtype: str, st: Settings, base: dict) -> list:
    try:
        unchecked = {name: getattr(fn, "unchecked", None) for name, _, fn in wl.torch_others}
        providers = [Provider(*p, unchecked=unchecked.get(p[0])) for p in training.providers(pass_, spec, wl, bound,
                                                                                             prob, st)]
    except Exception as e:
        return [{**base, "impl": "opport", "status": "error", "error": f"{type(e).__name__}: {e}"}]
    rows = [_check_grads(p, prob, st, base) for p in providers]
    live = [(p, r) for p, r in zip(providers, rows) if r["status"] != "error"]
    _time_all(live, replace(st, graphs=False), cost, dtype)  # graph capture of autograd's backward: not attempted
    _add_ratios(rows)
    return rows


def _check_grads(p: Provider, prob, st: Settings, base: dict) -> dict:
    row = {**base, "impl": p.impl, "call": p.call, "status": "ok"}
    try:
        grads = p.fn()  # also the warm-up (a compiled forward+backward compiles here)
        st.timer.sync()
        if isinstance(prob.ref, Exception):
            row.update(correct=None, note=f"unchecked: reference failed ({type(prob.ref).__name__}: {prob.ref})")
        elif p.unchecked:
            row.update(correct=None, note=f"unchecked: {p.unchecked}")
        else:
            row.update(training.judge(grads, prob))
        del grads
        if hasattr(st.timer, "peak_mb"):
            row["peak_MB"] = st.timer.peak_mb(p.fn)
    except Exception as e:
        row.update(status="error", error=f"{type(e).__name__}: {e}")
    return row


def _explain(spec, bound, backend: str):
    """The dispatch decision, without the fallback warning: a shape no kernel takes becomes a skip row."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        return explain(spec, *bound, backend=backend)


def _providers(spec, wl, bound, st: Settings, kernel: str) -> list:
    ps = [Provider("opport", f"opport.{spec.name}(..., backend={st.backend!r}) -> {kernel}",
                   partial(function(spec), *bound, backend=st.backend))]
    if st.batch_invariant and getattr(spec, "batch_args", ()):
        ps.append(Provider("opport_invariant", f"opport.{spec.name}(..., backend={st.backend!r}) under "
                           "opport.batch_invariant()", partial(_invariant_call, function(spec), bound, st.backend)))
    torch_ok = wl.torch_eager is not None and importlib.util.find_spec("torch") is not None
    if torch_ok:
        tb = _torch_bound(bound, st)
        call = wl.torch_call
        if wl.torch_detail is not None:
            call += f" [{wl.torch_detail(*tb)}]"
        ps.append(Provider("torch_eager", call, lambda: wl.torch_eager(*tb)))
        ps += [Provider(name, desc, partial(fn, *tb), unchecked=getattr(fn, "unchecked", None))
               for name, desc, fn in wl.torch_others]
        if st.compile:
            ps.append(_compiled(wl, tb, st))
    if st.kind == "numpy" and wl.numpy is not None:
        ps.append(Provider("numpy", wl.numpy_call, lambda: wl.numpy(*bound)))
    return ps


def _invariant_call(fn, bound, backend):
    from opport.dispatch import batch_invariant

    with batch_invariant():
        return fn(*bound, backend=backend)


def _torch_bound(bound, st: Settings) -> tuple:
    if st.kind == "torch":
        return bound
    import numpy as np

    from opport.dispatch.adapters import NumpyAdapter

    return tuple(NumpyAdapter.to_torch(a, "cpu") if isinstance(a, np.ndarray) else a for a in bound)


def _compiled(wl, tb, st: Settings) -> Provider:
    import torch

    torch._dynamo.reset()  # every shape compiles afresh: no recompile limit reached, no stale guards
    cf = torch.compile(wl.torch_eager, dynamic=False, mode=st.compile_mode)
    call = f"torch.compile({wl.torch_eager.__name__}, dynamic=False, mode={st.compile_mode!r}) of the eager call"
    return Provider("torch_compile", call, lambda: cf(*tb), compiled=True)


def _reference(spec, wl, bound, kind: str):
    """float64 reference on the same rounded inputs (torch on the inputs' device for torch kernels); the
    exception instead if it cannot be computed (the row is then unchecked)."""
    try:
        if kind == "numpy":
            return spec.run_reference(*bound)
        if spec.writes:  # an op that writes in place: the values of its region, from the inputs
            return spec.run_reference(*(_host(a) for a in bound))
        if spec.reference_takes_dtype:  # rounds part-way to the dtype (add_rmsnorm): NumPy's
            from opport.dispatch.adapters import TorchAdapter

            return spec.run_reference(*(TorchAdapter.to_numpy(a) if hasattr(a, "device") else a for a in bound))
        import torch

        b64 = tuple(a.detach().double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in bound)
        with torch.no_grad():
            return (wl.torch_reference or wl.torch_eager)(*b64)
    except Exception as e:
        return e


def _host(a):
    """A NumPy view or copy of a bound argument (torch tensors read back)."""
    if a is None or isinstance(a, (np.ndarray, bool, int, float, str)) or not hasattr(a, "shape"):
        return a
    from opport.dispatch.adapters import TorchAdapter

    return TorchAdapter.to_numpy(a)


def _written(spec, bound, poison: bool):
    """An op that writes in place (providers share its arrays): before a provider's call, NaN into the region
    it must write, so what it leaves unwritten shows; after, the region's values, one output per written array."""
    host = tuple(_host(a) for a in bound)
    outs = []
    for i, region in zip(spec.write_pos, spec.written_region(host)):
        if not poison:
            outs.append(np.array(host[i][region], copy=True))
        elif isinstance(bound[i], np.ndarray):
            bound[i][region] = np.nan
        else:
            import torch

            bound[i][tuple(torch.as_tensor(ix, device=bound[i].device) for ix in region)] = float("nan")
    return tuple(outs)


def _verdict(spec, out, ref, dtype: str, out_dtype: str):
    """The output judged against the reference; an op with several outputs (quantize_fp8's q and scales,
    add_rmsnorm's normed and sum) has each judged with its own tolerance and dtype, and the row shows the first
    that fails (else the one closest to its tolerance); an op that writes in place has its written arrays judged in
    their own dtypes (an fp8 cache's codes by fp8 ulps)."""
    if not isinstance(ref, tuple):
        return accuracy.compare(accuracy.like(out, ref), ref, spec.tolerances[dtype], out_dtype)
    dtypes = [accuracy.dtype_name(out[0]) if spec.writes else out_dtype] + [accuracy.dtype_name(o) for o in out[1:]]
    verdicts = [accuracy.compare(accuracy.like(o, r), r, spec.tolerance_for(dtype, i), d)
                for i, (o, r, d) in enumerate(zip(out, ref, dtypes))]
    return next((v for v in verdicts if not v.ok), max(verdicts, key=lambda v: v.metrics.get("tol_ratio") or 0.0))


def _check(p: Provider, ref, spec, dtype: str, out_dtype: str, st: Settings, base: dict, bound=()) -> dict:
    row = {**base, "impl": p.impl, "call": p.call, "status": "ok"}
    try:
        if spec.writes:
            _written(spec, bound, poison=True)
        out = p.fn()  # also the warm-up: JIT compilation, autotuning, torch.compile happen here
        st.timer.sync()
        if spec.writes:
            out = _written(spec, bound, poison=False)
        if isinstance(ref, Exception):
            row.update(correct=None, note=f"unchecked: reference failed ({type(ref).__name__}: {ref})")
        elif p.unchecked:
            row.update(correct=None, note=f"unchecked: {p.unchecked}")
        else:
            v = _verdict(spec, out, ref, dtype, out_dtype)
            row.update(correct=v.ok, **v.metrics, **({"error_detail": v.message} if not v.ok else {}))
        del out
        if hasattr(st.timer, "peak_mb"):
            row["peak_MB"] = st.timer.peak_mb(p.fn)
    except Exception as e:
        row.update(status="error", error=f"{type(e).__name__}: {e}")
    return row


def _time_all(live: list, st: Settings, cost, dtype: str):
    """Interleaved rounds (every provider once per round), samples pooled per provider."""
    samples = {id(p): [] for p, _ in live}
    budget = (st.budget_ms or st.timer.budget_ms) / st.rounds  # the per-provider budget, split over the rounds
    for _ in range(st.rounds):
        for p, row in live:
            if row["status"] == "error":
                continue
            try:
                with _no_recompile(p):
                    samples[id(p)] += st.timer.samples(p.fn, budget)
            except Exception as e:
                row.update(status="error", error=f"while timing: {type(e).__name__}: {e}")
    floor, bound = st.ceilings.floor_ms(cost.bytes, cost.flops, dtype)
    launch_bound = cost.bytes < LAUNCH_BOUND_BYTES or floor < LAUNCH_BOUND_FLOOR_MS
    for p, row in live:
        if row["status"] == "error" or not samples[id(p)]:
            continue
        t = summarize(samples[id(p)])
        row.update(ms=t.ms, p20_ms=t.p20_ms, p80_ms=t.p80_ms, samples=t.n, bound=bound, launch_bound=launch_bound,
                   GBps=cost.bytes / (t.ms * 1e6), TFLOPs=cost.flops / (t.ms * 1e9), roofline_pct=100 * floor / t.ms)
        if st.graphs and launch_bound:
            _graph_and_host(p, row, st)


def _graph_and_host(p: Provider, row: dict, st: Settings):
    try:
        with _no_recompile(p):
            row["graph_ms"] = summarize(st.timer.graph(p.fn)).ms
    except Exception as e:
        row["graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    with contextlib.suppress(Exception), _no_recompile(p):
        row["host_us"] = st.timer.host_us(p.fn)


@contextlib.contextmanager
def _no_recompile(p: Provider):
    """torch.compile providers may not recompile while timed (docs/performance.md 5.4)."""
    if not p.compiled:
        yield
        return
    import torch

    with torch.compiler.set_stance("fail_on_recompile"):
        yield


def _add_ratios(rows: list):
    """vs = baseline time / opport time (> 1: opport faster); docs/performance.md 5.8 sanity notes."""
    mine = next((r for r in rows if r["impl"] == "opport" and "ms" in r), None)
    if mine is None:
        return
    vs, vs_graph = {}, {}
    for r in rows:
        if r is mine or "ms" not in r:
            continue
        vs[r["impl"]] = r["ms"] / mine["ms"]
        if "graph_ms" in r and "graph_ms" in mine:
            vs_graph[r["impl"]] = r["graph_ms"] / mine["graph_ms"]
    mine["vs"] = vs
    mem = {r["impl"]: r["peak_MB"] / mine["peak_MB"] for r in rows
           if r is not mine and r.get("peak_MB") is not None and mine.get("peak_MB")}
    if mem:
        mine["mem_vs"] = mem  # baseline peak memory / opport's (> 1: opport allocates less)
    if vs_graph:
        mine["vs_graph"] = vs_graph
    fast = [k for k, v in vs.items() if v > 2.0]
    if fast:
        mine["note"] = f"speedup > 2x over {', '.join(fast)}: re-check (docs/performance.md 5.8)"


def run_counts(prof, spec, wl, shape, dtype: str, passes=("fwd",)) -> list:
    """An emulated device: the backend's counters for one call per pass (counts, not speed), and its accuracy."""
    backend = prof.backend.name
    base = {"op": spec.name, "shape": shape.label, "case": shape.name, "dims": shape.dims, "dtype": dtype,
            "impl": "opport", "status": "ok"}
    passes = passes_for(spec, backend, passes)
    try:
        kw = wl.make(shape.dims, dtype, ArrayMaker(prof.backend.array_kind, prof.input_device,
                                                   seed_for(spec.name, shape.name, dtype)))
        bound = spec.bind(**kw)
        cost = spec.get_cost(*metas_of(spec, bound))
    except Exception as e:
        return [{**base, "pass": p, "status": "error", "error": f"{type(e).__name__}: {e}"} for p in passes]
    rows = [_count_forward(prof, spec, wl, bound, cost, dtype, {**base, "pass": "fwd"})] if "fwd" in passes else []
    train = [p for p in passes if p in training.TRAINING]
    return rows + (_count_training(prof, spec, wl, bound, cost, dtype, base, train) if train else [])


def _count_forward(prof, spec, wl, bound, cost, dtype: str, base: dict) -> dict:
    backend = prof.backend.name
    try:
        decision = _explain(spec, bound, backend)
        if decision.kernel is None or decision.backend != backend:
            why = decision.fallback or decision.error or "no kernel"
            return {**base, "status": "skip", "error": f"no {backend} kernel takes it: {why}"}
        ref = _reference(spec, wl, bound, prof.backend.array_kind)
        if isinstance(ref, Exception):
            raise ref
    except Exception as e:
        return {**base, "status": "error", "error": f"{type(e).__name__}: {e}"}
    out_dtype = spec.out_dtype(metas_of(spec, bound))

    def check(out) -> dict:
        if spec.writes:  # returns None: judged by the region it wrote, as the timed path judges it
            out = _written(spec, bound, poison=False)
        v = _verdict(spec, out, ref, dtype, out_dtype)
        return {"correct": v.ok, **v.metrics}

    if spec.writes:
        _written(spec, bound, poison=True)
    return _counted(prof, partial(function(spec), *bound, backend=backend), check, cost, decision.kernel, base)


def _count_training(prof, spec, wl, bound, fwd_cost, dtype: str, base: dict, passes: list) -> list:
    """Counts of the training forward plus backward (through opport.vjp: the kernels autograd would run) and of
    the backward alone, for an op whose backward has a kernel on the emulated backend."""
    backend, kind = prof.backend.name, prof.backend.array_kind
    try:
        seed = seed_for(spec.name, base["case"], dtype, "grad")
        prob = training.problem(spec, wl, bound, dtype, (backend, kind, prof.input_device), seed)
        if not isinstance(prob, str) and isinstance(prob.ref, Exception):
            raise prob.ref  # counts of a call nobody can check are not reported
    except Exception as e:
        return [{**base, "pass": p, "status": "error", "error": f"{type(e).__name__}: {e}"} for p in passes]
    if isinstance(prob, str):
        return [{**base, "pass": p, "status": "skip", "error": prob} for p in passes]
    rows = []
    for p in passes:
        fn = training.pullback_call(spec, bound, prob, backend) if p == "fwd+bwd" else training.backward_call(
            spec, prob, backend)
        rows.append(_counted(prof, fn, lambda g: training.judge(g, prob), training.pass_cost(p, fwd_cost, prob),
                             prob.kernel, {**base, "pass": p}))
    return rows


def _counted(prof, fn, check, cost, kernel: str, base: dict) -> dict:
    """One call of `fn` inside the backend's counters, judged by `check(result) -> row fields`."""
    try:
        t0 = time.perf_counter()
        with prof.module.counters() as stats:
            out = fn()
        host_s = time.perf_counter() - t0
        judged = check(out)
    except Exception as e:
        return {**base, "status": "error", "error": f"{type(e).__name__}: {e}"}
    counts = stats.as_dict()
    key = prof.get("BYTES_COUNTER")
    row = {**base, "kernel": kernel, "bytes": cost.bytes, "flops": cost.flops, **judged, "counts": counts,
           "emulator_host_s": round(host_s, 3)}
    if key in counts:
        row[f"{key}_vs_min"] = counts[key] / cost.bytes if cost.bytes else None
    return row
