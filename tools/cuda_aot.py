"""Compile the cuda kernels for a GPU this machine does not have, and check what only a GPU would.

    python tools/cuda_aot.py [--arch 90] [--op NAME]... [--tier llm]... [--no-cases] [--json F] [--jobs N]
                             [--cold] [--update-record] [--record F]

Each problem (the bench's shapes of the chosen tiers and every conformance case, in float32, float16
and bfloat16) goes through the kernel's host code on torch meta tensors, so tiles, layouts, grids and
specialisations are picked exactly as on a GPU; each launch is then compiled by Triton for the target
(default sm_90, the H200) down to a cubin with the bundled ptxas, instead of running. Derived ops
(`<op>_backward`, `<op>_forward`) with a cuda kernel are problems of their own: their conformance cases, and
the bench's shapes turned into what training hands them (`--op rmsnorm` covers rmsnorm and its derived ops,
`--op rmsnorm_backward` that one alone). The interpreter that runs the conformance suite on CPUs checks none
of what this does:

- the kernel compiles (tl.dot tile minimums, dtype rules, constexpr misuse);
- its shared memory fits the SM (`Required: X, Hardware limit: Y` at launch otherwise);
- its grid fits CUDA's limits (y and z at most 65535);
- registers and spills (ptxas -v), which the summary reports; spills are a warning, not a failure;
- which tensor-core instruction the dots became (wgmma is Hopper's; mma.sync is the older path) and its
  operand types (e4m3 / e5m2: the fp8 tensor cores, bf16, f16, tf32), and
  the widest global load (16 bytes: memory traffic fully vectorised).

Must run in a fresh process: the kernels have to be defined as compiled JIT functions, which a
process that already picked Triton's interpreter cannot undo (the cuda backend's `compile_only()` hook).
Exit 1 on any failure. A CI tool, not part of the runtime package: it checks the checkout it lives in.

The record (tools/cuda_aot_record.json, committed; one line per configuration) holds what the check found
for every configuration it verified, under Triton's own compile key but for line numbers (`compile_key`): a
hash of the kernel's source and of every @triton.jit function it calls (with the constexpr globals they read),
the signature, specialisation attributes and constexprs, the options (num_warps, num_stages, ...), the target
arch, the ptxas version and Triton's own sources. A launch whose key is in the record is not compiled (its
recorded figures are checked instead); any other is compiled and checked. With a record, `--jobs N` first
runs every problem in this process from the record and compiles only the units it could not finish in the N
processes. `--cold` ignores the record and Triton's cache and compiles everything, and fails where a
recompiled configuration disagrees with its record entry; `--update-record` writes what a passing run saw
(`make aot-record`).

Triton caches each compiled configuration (~/.triton/cache); a configuration found there ran no ptxas, so
its registers and spills come from running `ptxas -v` on the cached PTX, and that result is cached in the
same cache entry (under the entry's key: the kernel source, options, target and Triton version).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import hashlib
import inspect
import io
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)  # the checkout's opport, not another installed one

# H100/H200 (sm_90): 227 KiB of shared memory per block (opt-in maximum), 255 registers per thread.
SHARED_LIMIT = {90: 232448, 80: 166912, 89: 101376}
GRID_LIMIT = (2**31 - 1, 65535, 65535)
DTYPES = ("float32", "float16", "bfloat16")
RECORD = Path(__file__).with_name("cuda_aot_record.json")  # the verified configurations, refreshed by make aot-record
KEY_HEX = 32  # a record key's hex digits: 128 bits of sha256, ample for a few thousand configurations


@dataclass
class Build:
    """One compiled kernel configuration (a Triton cache entry)."""

    kernel: str
    dtype: str  # the first pointer argument's element type
    constexprs: dict
    num_warps: int
    num_stages: int
    shared: int
    seconds: float
    registers: int | None = None
    spill_bytes: int | None = None
    mma: str | None = None  # the tensor-core instruction the dots became: "wgmma" (Hopper), "mma.sync", or None
    mma_types: str | None = None  # its operand and accumulator types, e.g. "e4m3.e4m3->f32" (fp8 tensor cores)
    load_bytes: int | None = None  # the widest global load per thread (16: fully vectorised memory traffic)
    problems: list = field(default_factory=list)
    key: str = ""  # Triton's compile key (see compile_key): what the record is keyed by
    source: str = "compiled"  # "record": taken from the record, not compiled in this run

    def as_json(self) -> dict:
        return dict(vars(self))


# what a record entry keeps of a Build, in the order of a record row: the figures the checks and the report use
# (not timings, not problems)
RECORDED = ("kernel", "dtype", "num_warps", "num_stages", "shared", "registers", "spill_bytes", "mma", "mma_types",
            "load_bytes", "constexprs")


@dataclass
class Report:
    arch: int
    builds: dict = field(default_factory=dict)  # compile key -> Build
    failures: list = field(default_factory=list)  # (problem, what went wrong)
    skipped: list = field(default_factory=list)  # (problem, why no cuda kernel takes it)
    problems: int = 0
    grids: dict = field(default_factory=dict)  # problem -> {"bytes": model bytes, "programs": its largest launch}
    labels: list = field(default_factory=list)  # every problem run
    stale: list = field(default_factory=list)  # problems stopped at a launch not in the record (a deferring run)


class _Miss(BaseException):
    """A launch whose key is not in the record, in a run that defers compiling to other processes. A
    BaseException, so that no `except Exception` in host code takes it for a launch that failed."""


class _CompileOnlyDriver:
    """Enough of Triton's driver for JITFunction.run to compile for `arch`; nothing here can launch."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def is_active(self):
        return True


class _Recorder:
    """Turns every JIT launch into a compile, or a record look-up; records the config and checks it against the target.

    `entries` is the record (compile key -> figures): a launch whose key is there is not compiled unless `cold`;
    when `cold`, a recompiled configuration must agree with its entry."""

    def __init__(self, report: Report, progress: bool = False, entries: dict | None = None, cold: bool = False,
                 defer: bool = False):
        self.report, self.problem, self.progress = report, "", progress
        self.entries, self.cold, self.defer = entries or {}, cold, defer

    def install(self):
        """Wrap JITFunction.run (compile instead of launch) and the `triton.compiler.compile` that each JIT
        function's binder picks up at its first launch (so must run before any kernel launches)."""
        import triton.compiler
        from triton.runtime.jit import JITFunction

        original, compile_ = JITFunction.run, triton.compiler.compile
        rec = self

        def run(self, *args, grid, warmup, **kwargs):
            t0 = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()) as log:  # Triton prints ptxas -v here (dump_ptxas_log)
                kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
            rec.record(self.fn.__name__, kernel, grid, time.perf_counter() - t0, log.getvalue())
            return kernel

        def keyed_compile(src, target=None, options=None, _env_vars=None):
            key = compile_key(src, target, options, _env_vars)
            entry = None if rec.cold else rec.entries.get(key)
            if entry is not None:
                return _Recorded(key, entry)
            if rec.defer:
                raise _Miss(key)
            kernel = compile_(src, target=target, options=options, _env_vars=_env_vars)
            exact = compile_key(src, target, options, _env_vars, lines=True)
            if kernel.metadata.hash != exact:  # compile_key no longer hashes what this Triton hashes
                raise RuntimeError(f"compile_key(lines=True) {exact} differs from Triton's cache key "
                                   f"{kernel.metadata.hash}: update tools/cuda_aot.py's compile_key to this Triton")
            kernel.record_key = key
            return kernel

        JITFunction.run = run
        triton.compiler.compile = keyed_compile

    def record(self, name: str, kernel, grid, seconds: float, ptxas_log: str = ""):
        md, key = kernel.metadata, getattr(kernel, "record_key", kernel.metadata.hash)
        if not callable(grid) and self.problem in self.report.grids:
            g = self.report.grids[self.problem]
            g["programs"] = max(g["programs"], math.prod(grid))
        build = self.report.builds.get(key)
        if build is None:
            build = self._build(name, kernel, key, round(seconds, 3), ptxas_log)
            self.report.builds[key] = build
            if self.progress:
                how = "record" if build.source == "record" else f"{seconds:.1f} s"
                print(f"{len(self.report.builds):4d} {name} {build.dtype} {build.constexprs} {how} ({self.problem})",
                      file=sys.stderr, flush=True)
        build.problems.append(self.problem)
        limit = SHARED_LIMIT.get(self.report.arch)
        if limit is not None and md.shared > limit:
            self.report.failures.append((self.problem, f"{name}: {md.shared} bytes of shared memory > {limit}"))
        g = tuple(grid) + (1,) * (3 - len(grid)) if not callable(grid) else None
        if g is not None and any(n > lim or n < 1 for n, lim in zip(g, GRID_LIMIT)):
            self.report.failures.append((self.problem, f"{name}: grid {g} outside CUDA's limits {GRID_LIMIT}"))

    def _build(self, name: str, kernel, key: str, seconds: float, ptxas_log: str) -> Build:
        """The Build of a configuration seen for the first time: its record entry's figures, or the compiled
        kernel's (checked against the record entry of the same key in a cold run)."""
        md = kernel.metadata
        if isinstance(kernel, _Recorded):
            return Build(**{k: kernel.entry.get(k) for k in RECORDED}, seconds=seconds, key=key, source="record")
        build = Build(name, *_describe(kernel.src), md.num_warps, md.num_stages, md.shared, seconds, key=key)
        build.registers, build.spill_bytes = _cached_usage(md.hash, ptxas_log, kernel.asm.get("ptx"), self.report.arch)
        ptx = kernel.asm.get("ptx") or ""
        build.mma = "wgmma" if "wgmma." in ptx else "mma.sync" if "mma.sync" in ptx else None
        build.mma_types = _mma_types(ptx)
        build.load_bytes = max((_width(m) for m in _LOAD.findall(ptx)), default=None)
        entry = self.entries.get(key)
        if entry is not None and entry != record_entry(build):
            diff = ", ".join(f"{k} {getattr(build, k)!r} (recorded {entry.get(k)!r})" for k in RECORDED
                             if record_entry(build).get(k) != entry.get(k))
            self.report.failures.append((self.problem, f"{name}: recompiled, disagrees with the record under the "
                                         f"same key: {diff}"))
        return build


class _Recorded:
    """What `triton.compiler.compile` returns for a configuration found in the record: nothing compiled, nothing
    to launch; the recorder reads the entry's figures."""

    def __init__(self, key: str, entry: dict):
        from types import SimpleNamespace

        self.entry = entry
        self.metadata = SimpleNamespace(hash=key, num_warps=entry["num_warps"], num_stages=entry["num_stages"],
                                        shared=entry["shared"])


# --------------------------------------------------------------------------- the record


def compile_key(src, target, options: dict | None, env_vars: dict | None = None, lines: bool = False) -> str:
    """The record's key for compiling `src` (an ASTSource) for `target` with `options`: Triton's own cache key
    (the hash `triton.compiler.compile` computes before it looks in its cache) but for the kernels' line numbers.

    Triton's key covers `src.hash()`: the kernel's `cache_key` (its source, the cache_key of every @triton.jit
    function it calls, transitively, the tl.constexpr globals they read, and each one's first line number), the
    signature (argument types), specialisation attributes (divisibility by 16, ...) and constexpr values; the
    options (num_warps, num_stages, ...); the backend's hash (ptxas version and target arch); `triton_key()`
    (Triton's version, its compiler and language sources, libtriton); the cache-invalidating environment.
    The record's key is the same with `_source_key` for each function's cache_key: the same text, helpers and
    constexprs, not the line numbers (a kernel that an edit above it moves down its file compiles to the same
    code but for debug line info). `lines=True` gives Triton's key exactly, which the recorder checks against
    every kernel it compiles."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.compiler.compiler import make_backend
    from triton.runtime import cache

    backend = make_backend(target)
    opts = backend.parse_options(dict(options or {}, **src.parse_options()))
    env = get_cache_invalidating_env_vars() if env_vars is None else env_vars
    src_hash = src.hash() if lines else _src_hash(src)
    key = f"{cache.triton_key()}-{src_hash}-{backend.hash()}-{opts.hash()}-{str(sorted(env.items()))}"
    digest = hashlib.sha256(key.encode()).hexdigest()
    return digest if lines else digest[:KEY_HEX]


def _src_hash(src) -> str:
    """`ASTSource.hash()` with `_source_key` in place of each JIT function's cache_key."""
    from triton.runtime.jit import JITCallable

    memo: dict = {}

    def key(v):
        return _source_key(v, memo) if isinstance(v, JITCallable) else v.cache_key if hasattr(v, "cache_key") else str(v)

    sig = [v for _, v in sorted(src.signature.items())]
    consts = "-".join(key(v) for _, v in sorted(src.constants.items()))
    return hashlib.sha256(f"{key(src.fn)}-{str(src.attrs)}-{sig}-{consts}".encode()).hexdigest()


def _source_key(fn, memo: dict) -> str:
    """`JITCallable.cache_key` without line numbers: a hash of the function's source, of the `_source_key` of every
    JIT function it references (and whether that one is noinline) and of the tl.constexpr globals it reads."""
    from triton.language.core import constexpr
    from triton.runtime.jit import BoundConstexprFunction, DependenciesFinder

    fn = fn.__func__ if isinstance(fn, BoundConstexprFunction) else fn
    if hasattr(fn, "_opport_source_key"):  # a function's source and globals do not change in a process
        return fn._opport_source_key
    if id(fn) in memo:
        return memo[id(fn)]
    memo[id(fn)] = f"recursion:{fn._fn_name}"  # as Triton does for a function that calls itself

    class Finder(DependenciesFinder):
        def _update_hash(self, func):
            self.hasher.update((_source_key(func, memo) + str(getattr(func, "noinline", False))).encode())

    finder = Finder(name=fn._fn_name, globals=fn.__globals__, nonlocals=inspect.getclosurevars(fn.fn).nonlocals,
                    src=fn.src)
    finder.visit(fn.parse())
    consts = [(name, val) for (name, _), (val, _) in sorted(finder.used_global_vals.items(), key=lambda kv: kv[0][0])
              if isinstance(val, constexpr)]
    fn._opport_source_key = hashlib.sha256((finder.ret + str(consts)).encode()).hexdigest()
    return fn._opport_source_key


def record_entry(build: Build) -> dict:
    """The figures the record keeps for a configuration (fields that are None are left out)."""
    return {k: getattr(build, k) for k in RECORDED if getattr(build, k) is not None}


def load_record(path) -> dict:
    """compile key -> entry (a dict of RECORDED fields); empty when there is no record (everything compiles)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    return {k: {f: v for f, v in zip(data["fields"], row) if v is not None} for k, row in data["configurations"].items()}


def save_record(path, entries: dict, arch: int):
    """Write the record (compile key -> entry): a header naming the fields, then one line per configuration (its
    key and the fields' values), sorted by kernel so that a kernel's change shows as its lines in a diff."""
    import triton
    from triton.backends.nvidia.compiler import get_ptxas_version

    ptxas = re.search(r"release [\d.]+, V[\d.]+", get_ptxas_version(arch))
    header = {"format": 2, "arch": arch, "triton": triton.__version__, "ptxas": ptxas and ptxas.group(0),
              "refresh": "make aot-record (python tools/cuda_aot.py --update-record)", "fields": RECORDED}
    rows = sorted(entries.items(), key=lambda kv: (kv[1]["kernel"], kv[1]["dtype"], kv[0]))
    lines = [f'"{key}":{json.dumps([entry.get(f) for f in RECORDED], separators=(",", ":"))}' for key, entry in rows]
    text = json.dumps(header)[:-1] + ', "configurations": {\n' + ",\n".join(lines) + "\n}}\n"
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _describe(src) -> tuple:
    """(the first pointer's element type, the declared tl.constexpr arguments) of a compile source."""
    params = src.fn.params
    named = {params[k[0]].name: v for k, v in src.constants.items() if len(k) == 1 and params[k[0]].is_constexpr}
    ptr = next((t for t in src.signature.values() if isinstance(t, str) and t.startswith("*")), "")
    return ptr.lstrip("*"), {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in named.items()}


_USAGE = re.compile(r"Used (\d+) registers")
_LOAD = re.compile(r"ld\.global(?:\.[\w:]+?)*?(?:\.v(\d))?\.[bfsu](\d+)\b")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
# wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 / mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
_MMA = re.compile(r"\b(?:wgmma\.mma_async|mma\.sync)(?:\.\w+)*?\.m\d+n\d+k\d+(?:\.row\.col)?\.(\w+)\.(\w+)\.(\w+)")


def _mma_types(ptx: str) -> str | None:
    """The first tensor-core instruction's "A.B->D" types (e4m3 / e5m2: fp8 tensor cores), or None without one."""
    m = _MMA.search(ptx)
    return None if m is None else f"{m.group(2)}.{m.group(3)}->{m.group(1)}"


def _width(match: tuple) -> int:
    """Bytes of one `ld.global[.vN].bT` from its (N, T)."""
    vec, bits = match
    return int(vec or 1) * int(bits) // 8


def _usage(log: str) -> tuple:
    """(registers, spill bytes) from a `ptxas -v` log."""
    regs = [int(m) for m in _USAGE.findall(log)]
    spills = [int(a) + int(b) for a, b in _SPILL.findall(log)]
    return (max(regs) if regs else None), (max(spills) if spills else None)


_USAGE_FILE = "opport-ptxas-usage.json"


def _cached_usage(key: str, ptxas_log: str, ptx: str | None, arch: int) -> tuple:
    """(registers, spill bytes): from Triton's own ptxas log when it just compiled the kernel; else (a cache
    hit) from the Triton cache entry `key` (a content hash: same PTX, same answer), else from running ptxas
    on the cached PTX. Either way the answer is stored in the entry for the next run."""
    from triton.runtime.cache import get_cache_manager

    if not ptx and not _USAGE.search(ptxas_log):
        return None, None  # nothing to read the usage from (and no cache entry to create)
    cache = get_cache_manager(key)
    found = None if _USAGE.search(ptxas_log) else cache.get_file(_USAGE_FILE)
    if found:
        with open(found) as f:
            return tuple(json.load(f))
    usage = _usage(ptxas_log) if _USAGE.search(ptxas_log) else _ptxas_usage(ptx, arch)
    if usage != (None, None):
        cache.put(json.dumps(usage), _USAGE_FILE, binary=False)
    return usage


def _ptxas_usage(ptx: str | None, arch: int) -> tuple:
    """(registers, spill bytes) from running `ptxas -v` on `ptx`, or (None, None) when that cannot be done."""
    if not ptx:
        return None, None
    from triton.backends.nvidia.compiler import get_ptxas

    suffix = "a" if arch >= 90 else ""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        try:
            log = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}{suffix}", f.name, "-o", "/dev/null"],
                                 capture_output=True, text=True, timeout=300).stderr
        except (OSError, subprocess.SubprocessError):
            return None, None
    return _usage(log)


# --------------------------------------------------------------------------- problems


class _MetaMaker:
    """The bench's ArrayMaker interface, handing out torch meta tensors (shapes and dtypes, no data)."""

    kind, device = "torch", "meta"

    def normal(self, shape, dtype: str, scale: float = 1.0):
        return _empty(shape, dtype)

    def uniform(self, shape, dtype: str, lo: float, hi: float):
        return _empty(shape, dtype)

    def integers(self, shape, lo: int, hi: int):
        return _empty(shape, "int64")


def _empty(shape, dtype: str):
    import torch

    return torch.empty(tuple(shape), dtype=getattr(torch, dtype), device="meta")


def _meta_like(a):
    """A meta tensor with a NumPy array's shape, dtype and (non-negative) strides."""
    import numpy as np
    import torch

    if not isinstance(a, np.ndarray):
        return a
    name = "bfloat16" if a.dtype.name == "bfloat16" else a.dtype.name
    dt = getattr(torch, name)
    if a.size and all(s >= 0 for s in a.strides):
        return torch.empty_strided(a.shape, [s // a.itemsize for s in a.strides], dtype=dt, device="meta")
    return torch.empty(a.shape, dtype=dt, device="meta")


def problems(specs, tiers, cases: bool, dtypes=DTYPES):
    """(label, spec, make) for the bench shapes and the conformance cases; make() binds meta tensors.

    A derived op takes its forward's bench shapes: a training forward the same arguments, a backward what
    training hands it after that forward (`_backward_kw`)."""
    from opport.bench.workloads import get_workload

    for spec in specs:
        fwd = spec.forward
        wl = get_workload(fwd)
        for dtype in dtypes:
            if dtype not in spec.dtypes:
                continue
            for shape in wl.shapes:
                if set(shape.tiers) & set(tiers):
                    kw = functools.partial(wl.make, shape.dims, dtype, _MetaMaker())
                    if spec is fwd.backward_op:
                        kw = functools.partial(_backward_kw, spec, kw)
                    yield f"{spec.name} bench {shape.label} {dtype}", spec, functools.partial(_bind_kw, spec, kw)
            for case in spec.get_cases(dtype) if cases else ():
                yield f"{spec.name} case {case.name} {dtype}", spec, functools.partial(_bind_case, spec, case)


def _bind_kw(spec, make_kwargs):
    return spec.bind(**make_kwargs())


def _backward_kw(bwd, make_forward_kwargs) -> dict:
    """A backward's arguments for a forward problem of meta tensors: an upstream gradient and the forward's
    output shaped like the output, saved statistics in float32, arranged by `autodiff.saved_values` as
    training hands them over. (`BackwardSpec.from_forward` builds the same from data, running the float64
    reference for the output and statistics: the llm tier's shapes would need gigabytes for that.)"""
    from opport.autodiff import saved_values

    fwd = bwd.parent
    bound = fwd.bind(**make_forward_kwargs())
    outs = [_empty(shape, str(dtype).removeprefix("torch.")) for shape, dtype in fwd.out_metas(bound)]
    stats = ()
    if fwd.train_forward is not None:
        stats = tuple(_empty(s, str(d).removeprefix("torch.")) for s, d in fwd.train_forward.out_metas(bound)[1:])
    grads = [_empty(o.shape, str(o.dtype).removeprefix("torch.")) for o, name in zip(outs, fwd.output_labels)
             if name not in fwd.integer_outputs]  # one upstream gradient per floating output
    out = outs[0] if len(outs) == 1 else tuple(outs)
    return dict(zip(bwd.params, (*grads, *saved_values(fwd, bound, out, stats))))


def _bind_case(spec, case):
    return spec.bind(*map(_meta_like, case.args), **{k: _meta_like(v) for k, v in case.kwargs.items()})


def check(report: Report, recorder: _Recorder, label: str, spec, make):
    """Run the problem's cuda kernel host code; its launches compile through the recorder."""
    from opport.dispatch.adapters import metas_of
    from opport.dispatch.core import kernel_args
    from opport.dispatch.registry import get_backend, kernels

    report.problems += 1
    report.labels.append(label)
    recorder.problem = label
    try:
        bound = kernel_args(spec, make())  # as the dispatcher hands them over (0-d per-tensor scales as (1, 1))
        report.grids[label] = {"bytes": spec.get_cost(*metas_of(spec, bound)).bytes, "programs": 0}
        dtype = str(spec.dtype_of(bound)).removeprefix("torch.")  # a backward's: its first input's, not grad's
        reasons = []
        for k in kernels(spec, get_backend("cuda")):
            why = k.check(dtype, bound)
            if why is None:
                k.fn(*bound)
                return
            reasons.append(f"{k.name}: {why}")
        report.skipped.append((label, "; ".join(reasons) or "no cuda kernel"))
    except _Miss:
        report.stale.append(label)
    except Exception as e:  # a compile error, or host code that needs data a meta tensor lacks
        report.failures.append((label, f"{type(e).__name__}: {str(e).strip()[:2000]}"))


# --------------------------------------------------------------------------- entry point


def run(arch: int = 90, ops=(), tiers=("smoke", "small", "llm"), cases: bool = True, progress: bool = False,
        dtypes=DTYPES, record=RECORD, cold: bool = False, defer: bool = False) -> Report:
    """The check in this process. Launches whose key is in the `record` file are not compiled unless `cold`
    (which also ignores Triton's cache: every configuration compiles, and must agree with its record entry).
    `defer`: a problem that reaches a launch not in the record stops there and is listed in `report.stale`."""
    from opport.backends import cuda

    cuda.compile_only()
    import triton

    triton.runtime.driver.set_active(_CompileOnlyDriver(arch))
    triton.knobs.nvidia.dump_ptxas_log = True  # Triton's own ptxas run reports registers and spills
    triton.knobs.compilation.always_compile = cold
    report = Report(arch)
    recorder = _Recorder(report, progress, load_record(record) if record else {}, cold, defer)
    recorder.install()
    specs = cuda_specs(ops or cuda_ops())
    for label, spec, make in problems(specs, tiers, cases, dtypes):
        check(report, recorder, label, spec, make)
    return report


def print_report(report: Report, console):
    from rich.table import Table

    t = Table(title=f"cuda kernels compiled for sm_{report.arch} (one row per compiled configuration)")
    for col in ("kernel", "dtype", "constexprs", "warps", "stages", "regs", "spill B", "shared KiB", "mma", "load B",
                "compile s", "problems"):  # compile s: "record" for a configuration taken from the record
        t.add_column(col, justify="left" if col in ("kernel", "dtype", "constexprs") else "right")
    for b in sorted(report.builds.values(), key=lambda b: (b.kernel, b.dtype, -b.shared)):
        consts = " ".join(f"{k}={v}" for k, v in b.constexprs.items())
        spill = "" if b.spill_bytes is None else (f"[yellow]{b.spill_bytes}[/yellow]" if b.spill_bytes else "0")
        mma = " ".join(filter(None, (b.mma, b.mma_types)))
        t.add_row(b.kernel, b.dtype, consts, str(b.num_warps), str(b.num_stages), str(b.registers or ""), spill,
                  f"{b.shared / 1024:.1f}", mma, str(b.load_bytes or ""),
                  "record" if b.source == "record" else f"{b.seconds:.2f}", str(len(b.problems)))
    console.print(t)
    for label, why in report.skipped:
        console.print(f"[dim]skipped {label}: {why}[/dim]")
    for label, what in report.failures:
        console.print(f"[red]FAILED {label}: {what}[/red]")
    spilled = sum(1 for b in report.builds.values() if b.spill_bytes)
    recorded = sum(1 for b in report.builds.values() if b.source == "record")
    console.print(f"aot sm_{report.arch}: {report.problems} problems, {len(report.builds)} kernel configurations "
                  f"({recorded} from the record, {len(report.builds) - recorded} compiled), "
                  f"{len(report.failures)} failures, {len(report.skipped)} skipped, {spilled} configurations spill")


# ops by rough compile cost, heaviest first: attention's dot-heavy kernels take seconds each
_COST = {"attention": 10, "matmul": 2}


def cuda_ops() -> list:
    """The ops the check compiles by default: those with a cuda kernel module (an op without one runs on cpu)."""
    from opport.dispatch.registry import get_backend, has_kernel_module
    from opport.ops import all_ops

    return [name for name, spec in all_ops().items() if has_kernel_module(spec, get_backend("cuda"))]


def cuda_specs(names) -> list:
    """The specs `names` select: an op and those of its derived ops (`<op>_forward`, `<op>_backward`) that the cuda
    backend has a kernel for, or a derived op alone. Imports the ops' cuda kernel modules (nothing compiles)."""
    from opport.dispatch.registry import get_backend, kernels
    from opport.ops import get_op

    cuda = get_backend("cuda")
    specs = []
    for name in names:
        spec = get_op(name)
        for d in spec.family():
            if (d is spec or kernels(d, cuda)) and d not in specs:
                specs.append(d)
    return specs


def run_parallel(jobs: int, arch: int, ops, tiers, cases: bool, dtypes=DTYPES, record=RECORD, cold: bool = False) -> Report:
    """`run` in fresh processes, at most `jobs` at a time, one per op with its derived ops (per op and dtype for
    the ops heavy in _COST, so that attention does not hold up the rest); their JSON reports merged, a
    configuration that several ops launch once.

    With a record (and not `cold`), every problem first runs here, taking what the record has and compiling
    nothing (each process would spend seconds importing torch and Triton for a fraction of a second of host
    code); only the (op, dtype) units with a launch the record lacks then go to the processes."""
    cost = {n: _COST.get(n.removesuffix("_backward").removesuffix("_forward"), 1) for n in ops or cuda_ops()}
    units = [(n, dts) for n in sorted(cost, key=lambda n: -cost[n])
             for dts in ([(d,) for d in dtypes] if cost[n] > 1 else [tuple(dtypes)])]
    report = Report(arch)
    if record and not cold:
        report = run(arch, ops, tiers, cases, dtypes=dtypes, record=record, defer=True)
        units = _stale_units(report, units)
    with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        def one(i, op, dts):
            cmd = [sys.executable, __file__, "--arch", str(arch), "--jobs", "1", f"--op={op}", f"--record={record or ''}",
                   "--json", f"{tmp}/{i}.json", *[f"--dtype={d}" for d in dts], *[f"--tier={t}" for t in tiers]]
            cmd += ([] if cases else ["--no-cases"]) + (["--cold"] if cold else [])
            code = subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode
            return op, code, f"{tmp}/{i}.json"

        for op, code, path in pool.map(lambda u: one(*u), [(i, op, dts) for i, (op, dts) in enumerate(units)]):
            if not os.path.exists(path):
                report.failures.append((op, f"the compile process exited with {code}"))
                continue
            with open(path) as f:
                part = json.load(f)
            report.problems += part["problems"]
            report.failures += [tuple(x) for x in part["failures"]]
            report.skipped += [tuple(x) for x in part["skipped"]]
            report.grids.update(part["grids"])
            for b in map(lambda b: Build(**b), part["builds"]):
                if b.key in report.builds:
                    report.builds[b.key].problems += b.problems
                else:
                    report.builds[b.key or len(report.builds)] = b
    return report


def _stale_units(report: Report, units: list) -> list:
    """The units (op, dtypes) to compile in processes after a deferring run: those with a stale problem, in its
    dtypes only. The report keeps its results for every other (op or derived op, dtype): the units' replace them."""
    stale = {(label.split()[0], label.rsplit(" ", 1)[1]) for label in report.stale}
    covers = {op: {s.name for s in cuda_specs([op])} for op, _ in units}
    units = [(op, tuple(d for d in dts if any((n, d) in stale for n in covers[op]))) for op, dts in units]
    units = [(op, dts) for op, dts in units if dts]
    redone = {(n, d) for op, dts in units for n in covers[op] for d in dts}

    def keep(label: str) -> bool:
        return (label.split()[0], label.rsplit(" ", 1)[1]) not in redone

    report.labels = [p for p in report.labels if keep(p)]
    report.problems, report.stale = len(report.labels), []
    report.failures = [f for f in report.failures if keep(f[0])]
    report.skipped = [s for s in report.skipped if keep(s[0])]
    report.grids = {p: g for p, g in report.grids.items() if keep(p)}
    for key, b in list(report.builds.items()):
        b.problems = [p for p in b.problems if keep(p)]
        if not b.problems:
            del report.builds[key]
    return units


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tools/cuda_aot.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: H100/H200)")
    p.add_argument("--op", action="append", default=[],
                   help="only this op and its derived ops, or one derived op such as rmsnorm_backward "
                   "(repeatable; default: every op with cuda kernels)")
    p.add_argument("--tier", action="append", default=[], help="bench shape tiers (default: smoke, small, llm)")
    p.add_argument("--no-cases", action="store_true", help="skip the conformance cases (bench shapes only)")
    p.add_argument("--dtype", action="append", default=[], choices=DTYPES, help="only this dtype (repeatable)")
    p.add_argument("--json", metavar="F", help="write the report as JSON")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes to split the ops over (default: one per CPU)")
    p.add_argument("--cold", action="store_true",
                   help="ignore the record and Triton's cache: compile and check every configuration (make aot); fails "
                   "where a recompiled configuration disagrees with its record entry")
    p.add_argument("--update-record", action="store_true",
                   help="after a check that passed, write what it saw to the record (make aot-record); a full check "
                   "(no --op, --tier, --dtype, --no-cases) also drops the entries it did not see")
    p.add_argument("--record", metavar="F", default=str(RECORD),
                   help=f"the record of verified configurations (default {RECORD.relative_to(_ROOT)}; '' for none)")
    args = p.parse_args(argv)
    from rich.console import Console

    tiers = tuple(args.tier) or ("smoke", "small", "llm")
    dtypes = tuple(args.dtype) or DTYPES
    if args.jobs > 1:
        report = run_parallel(args.jobs, args.arch, args.op, tiers, not args.no_cases, dtypes, args.record, args.cold)
    else:
        report = run(args.arch, args.op, tiers, not args.no_cases, True, dtypes, args.record, args.cold)
    print_report(report, Console(width=None if sys.stdout.isatty() else 200))
    if args.update_record:
        _update_record(report, args.record, full=not (args.op or args.tier or args.dtype or args.no_cases))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arch": report.arch, "problems": report.problems, "failures": report.failures,
                       "skipped": report.skipped, "builds": [b.as_json() for b in report.builds.values()],
                       "grids": report.grids}, f, indent=1)
    return 1 if report.failures else 0


def _update_record(report: Report, path: str, full: bool):
    """Write a passing run's configurations to the record; a full run's replace it (stale entries go), a partial
    run's are added to it. A failing run leaves it as it was."""
    if report.failures:
        print(f"record not updated: {len(report.failures)} failures", file=sys.stderr)
        return
    before = load_record(path)
    seen = {b.key: record_entry(b) for b in report.builds.values() if b.key}
    entries = seen if full else {**before, **seen}
    save_record(path, entries, report.arch)
    print(f"record {path}: {len(entries)} configurations ({len(set(seen) - set(before))} new, "
          f"{len(set(before) - set(entries))} dropped)")


if __name__ == "__main__":
    sys.exit(main())
