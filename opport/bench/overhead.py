"""`opport bench --overhead`: what `opport.<op>(...)` adds over calling the selected kernel directly.

Tiny inputs, cached path (the first call fills the selection cache before timing). Public call and
direct kernel call (with the same torch<->NumPy conversions where the backend needs them) are timed in
alternating batches with the garbage collector off, twice:

- overhead_us, the headline: the selected kernel swapped for a stub that returns its result at once,
  so the dispatch path runs exactly as it does for the real kernel (key, cache, conversions, output
  wrapping) and nothing else is timed. As `timeit` advises, fastest public batch minus fastest direct
  batch, per call (noise from other processes only ever adds time); the median and p20/p80 of the
  per-round differences show how noisy the machine was.
- in_situ_us: the same difference with the real kernel, as the mean of the per-round differences
  (with its standard error: two kernel timings differ by more noise than the dispatch costs). It is
  larger than overhead_us: the kernel's work evicts the dispatcher's code and data from the caches,
  which then cost misses on every call, as they do between the ops of a real model.

Goal (docs/performance.md): <= 5 us (gate), <= 2 us (moonshot), judged on overhead_us.
"""

from __future__ import annotations

import gc
import importlib.util
import time
from contextlib import contextmanager
from functools import partial

import numpy as np

from opport.bench.workloads import ArrayMaker, get_workload, seed_for
from opport.dispatch import backends, clear_cache, explain, kernel_args, kernels
from opport.public import function

GATE_US, MOONSHOT_US = 5.0, 2.0


def measure(specs: list, budget_ms: float = 300.0, kinds=None) -> list:
    rows = []
    for spec in specs:
        wl = get_workload(spec)
        shape = (wl.shapes_for("smoke") or wl.shapes)[0]
        for kind in kinds or _kinds():
            rows.append(_one(spec, wl, shape, kind, budget_ms))
    return rows


def _kinds() -> list:
    """numpy, torch-cpu, and torch-<device> for each device a usable torch backend runs on (e.g. a GPU)."""
    kinds = ["numpy"]
    if importlib.util.find_spec("torch") is None:
        return kinds
    devices = {b.torch_device() for b in backends().values() if b.array_kind == "torch" and not b.unavailable()}
    return kinds + ["torch-cpu"] + [f"torch-{d}" for d in sorted(devices - {"cpu"})]


def _one(spec, wl, shape, kind: str, budget_ms: float) -> dict:
    row = {"op": spec.name, "shape": shape.label, "inputs": kind}
    device = kind.removeprefix("torch-") if kind != "numpy" else "cpu"
    try:
        mk = ArrayMaker("numpy" if kind == "numpy" else "torch", device, seed_for("overhead", spec.name))
        bound = spec.bind(**wl.make(shape.dims, "float32", mk))
        d = explain(spec, *bound)
        kernel = next(k for k in kernels(spec, backends()[d.backend]) if k.name == d.kernel)
    except Exception as e:
        return {**row, "status": "error", "error": f"{type(e).__name__}: {e}"}
    native, converted, note = _direct_calls(kernel, kernel_args(spec, bound), backends()[d.backend].array_kind)
    sync = _device_sync(device) if device != "cpu" else None
    public = partial(function(spec), *bound)
    public()  # fill the selection cache: the cached path is what is measured
    real_pub, real_dir = _alternate(public, converted, budget_ms, sync)
    with _stubbed(kernel, public):
        pubs, dirs = _alternate(public, converted, budget_ms / 2, sync)
        if native is not converted:  # torch inputs on a NumPy backend: conversion is part of what opport adds
            pubs2, dirs2 = _alternate(public, native, budget_ms / 2, sync)
            row.update(total_added_us=float(pubs2.min() - dirs2.min()), note=note)
    diffs, in_situ = pubs - dirs, real_pub - real_dir
    row.update(status="ok", backend=d.backend, kernel=d.kernel, public_us=float(real_pub.min()),
               direct_us=float(real_dir.min()), overhead_us=float(pubs.min() - dirs.min()),
               median_diff_us=float(np.median(diffs)), p20_us=float(np.quantile(diffs, 0.2)),
               p80_us=float(np.quantile(diffs, 0.8)), rounds=len(diffs), in_situ_us=float(in_situ.mean()),
               in_situ_sem_us=float(in_situ.std() / np.sqrt(len(in_situ))), in_situ_rounds=len(in_situ))
    o = row["overhead_us"]
    row["goal"] = "moonshot" if o <= MOONSHOT_US else ("gate" if o <= GATE_US else "over")
    return row


@contextmanager
def _stubbed(kernel, public):
    """The selected kernel replaced by a stub returning the result of one real call, for the block.

    The selection cache is refilled on entry (its plan holds the stub) and on exit (the real kernel).
    """
    real, result = kernel.fn, []

    def stub(*args):
        if not result:
            result.append(real(*args))
        return result[0]

    kernel.fn = stub
    clear_cache()
    try:
        public()  # the one real call; the plan now holds the stub
        yield
    finally:
        kernel.fn = real
        clear_cache()
        public()


def _direct_calls(kernel, bound: tuple, array_kind: str):
    """(kernel on arrays already of its kind, kernel with the same conversions opport makes, note).

    Both look `kernel.fn` up on every call, so that `_stubbed` reaches them too.
    """
    from opport.dispatch.adapters import TorchAdapter, adapter_for

    torch_pos = [i for i, a in enumerate(bound) if adapter_for(a) is TorchAdapter]
    if array_kind != "numpy" or not torch_pos:
        f = lambda: kernel.fn(*bound)
        return f, f, ""
    to_numpy, from_native, like = TorchAdapter.to_numpy, TorchAdapter.from_native, bound[torch_pos[0]]
    native_bound = list(bound)
    for i in torch_pos:
        native_bound[i] = to_numpy(bound[i])

    def back(out):  # each output back to a tensor, as the dispatcher does: one array, several (a tuple), or None
        if out.__class__ is tuple:
            return tuple(None if o is None else from_native(o, like) for o in out)
        return None if out is None else from_native(out, like)

    def converted():  # what a hand-written call converting just the tensors would do
        args = list(bound)
        for i in torch_pos:
            args[i] = to_numpy(args[i])
        return back(kernel.fn(*args))

    note = "overhead_us: dispatch only (kernel timed with the same torch<->numpy conversions); total_added_us includes them"
    return (lambda: kernel.fn(*native_bound)), converted, note


def _device_sync(device: str):
    """Wait for the device's queued work (torch.<device>.synchronize: cuda, xpu, mps alike)."""
    import torch

    return getattr(torch, device).synchronize


def _batch_us(fn, n: int, sync) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    if sync:
        sync()
    return (time.perf_counter() - t0) * 1e6 / n


def _alternate(public, direct, budget_ms: float, sync):
    """Alternating batches of public and direct calls: per-call times (us) of each batch, as two arrays."""
    one = max(min(_batch_us(direct, 5, sync), _batch_us(public, 5, sync)), 0.05)
    n = max(3, int(200 / one))  # about 0.2 ms per batch: far above timer resolution, short enough to dodge preemption
    pubs, dirs = [], []
    deadline = time.perf_counter() + budget_ms / 1e3
    was = gc.isenabled()
    gc.disable()
    try:
        while len(pubs) < 15 or (time.perf_counter() < deadline and len(pubs) < 2000):
            pubs.append(_batch_us(public, n, sync))
            dirs.append(_batch_us(direct, n, sync))
    finally:
        if was:
            gc.enable()
    return np.array(pubs), np.array(dirs)


def print_overhead(console, rows: list):
    from rich.table import Table

    t = Table(title=f"dispatch overhead: opport.<op>() minus the selected kernel called directly, fastest batches, "
                    f"kernel stubbed (goal <= {GATE_US:g} us, moonshot <= {MOONSHOT_US:g} us)")
    for col in ("op", "inputs", "kernel", "kernel us", "overhead us", "per-round diff us\nmedian [p20-p80]",
                "goal", "in situ us\n(real kernel)", "incl. conversion us"):
        t.add_column(col, justify="left" if col in ("op", "inputs", "kernel") else "right")
    for r in rows:
        if r["status"] != "ok":
            t.add_row(r["op"], r["inputs"], f"[red]{r['status']}[/red]", r.get("error", "")[:70])
            continue
        color = {"moonshot": "green", "gate": "yellow", "over": "red"}[r["goal"]]
        t.add_row(r["op"], r["inputs"], r["kernel"], f"{r['direct_us']:.2f}",
                  f"{r['overhead_us']:.2f}", f"{r['median_diff_us']:.2f} [{r['p20_us']:.2f}-{r['p80_us']:.2f}]",
                  f"[{color}]{r['goal']}[/{color}]", f"{r['in_situ_us']:.1f} ± {r['in_situ_sem_us']:.1f}",
                  f"{r['total_added_us']:.2f}" if "total_added_us" in r else "")
    console.print(t)
