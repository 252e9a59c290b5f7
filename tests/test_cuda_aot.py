"""The sm_90 compile check (tools/cuda_aot.py): every cuda kernel configuration compiles and fits an H200."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

# The module fixture compiles only what is not in the record: with it fresh, the whole check (3,375 problems, 2,655
# configurations, three dtypes) takes ~15 s and compiles nothing. Each configuration the record lacks costs ~1 s of
# CPU to compile, so 900 s (pytest's default, made explicit) leaves room for a kernel change or two not yet in the
# record; a change that makes most of it stale (a helper in _launch.py used everywhere, a new Triton or ptxas)
# would need the cold check's time (53 min of CPU: ~27 min on 2 idle cores), so the fixture stops at FIXTURE_TIMEOUT and says to
# refresh the record, which such a change must commit (make aot-record).
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None,
                       reason="needs torch and triton"),
    pytest.mark.timeout(900),
]
TOOL = Path(__file__).resolve().parents[1] / "tools" / "cuda_aot.py"
FIXTURE_TIMEOUT = 840  # below the module's timeout, so that a stale record fails with a message, not a stack dump


def _tool():
    """tools/cuda_aot.py as a module (it is a script, not part of the opport package)."""
    if "cuda_aot" not in sys.modules:
        spec = importlib.util.spec_from_file_location("cuda_aot", TOOL)
        sys.modules["cuda_aot"] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
        spec.loader.exec_module(sys.modules["cuda_aot"])
    return sys.modules["cuda_aot"]


def _env():
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


@pytest.fixture(scope="module")
def sm90(tmp_path_factory, request):
    """One run of the whole check (every op, every bench tier, every conformance case, all three dtypes) in a
    fresh process, against the committed record: only configurations not in it are compiled."""
    out = tmp_path_factory.mktemp("aot") / "aot.json"
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, str(TOOL), "--json", str(out)], capture_output=True, text=True,
                              env=_env(), timeout=FIXTURE_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the sm_90 check ran past {FIXTURE_TIMEOUT} s: is tools/cuda_aot_record.json stale? "
                    "Refresh it with `make aot-record` and commit it with the kernel change")
    report = json.loads(out.read_text()) if out.exists() else None
    if report is not None:
        _say_where_configurations_came_from(report, time.monotonic() - t0, request.config)
    return proc, report


def _say_where_configurations_came_from(report: dict, seconds: float, config):
    recorded = sum(1 for b in report["builds"] if b["source"] == "record")
    compiled = len(report["builds"]) - recorded
    line = (f"sm_90 compile check: {len(report['builds'])} configurations, {recorded} from the record, {compiled} "
            f"compiled, {seconds:.0f} s")
    reporter, capture = (config.pluginmanager.get_plugin(n) for n in ("terminalreporter", "capturemanager"))
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():  # a fixture's output is captured otherwise
            reporter.write_line(line)
    if compiled:
        warnings.warn(f"{line}: the compiled ones are not in tools/cuda_aot_record.json (refresh: make aot-record)",
                      stacklevel=2)


def test_every_kernel_compiles_for_sm90_within_its_limits(sm90):
    proc, report = sm90
    assert report is not None, proc.stderr[-3000:]
    assert proc.returncode == 0, "\n".join(f"{p}: {w}" for p, w in report["failures"][:20])
    assert report["failures"] == [] and report["skipped"] == []
    assert all(b["shared"] <= _tool().SHARED_LIMIT[90] for b in report["builds"])


def test_every_op_with_cuda_kernels_and_the_llm_shapes_were_compiled(sm90):
    """Every op, and every derived op (`<op>_backward`, `<op>_forward`) the cuda backend has a kernel for."""
    from opport.ops import builtin_ops

    _, report = sm90
    compiled = {p.split()[0] for b in report["builds"] for p in b["problems"]}
    tool = _tool()
    assert compiled == {s.name for s in tool.cuda_specs(tool.cuda_ops())}
    assert compiled >= set(builtin_ops())  # ops without cuda kernels run on cpu there
    llm = [p for b in report["builds"] for p in b["problems"] if "bench" in p and "S16384x16384" in p]
    assert llm, "the 16K-token attention shape of the llm tier was not compiled"


def test_the_llm_tier_fast_kernels_do_not_spill(sm90):
    """Register spills in the bench's bf16 shapes would cost bandwidth on the H200 (the exact attention re-run may)."""
    _, report = sm90
    spilled = [(b["kernel"], b["constexprs"], b["spill_bytes"]) for b in report["builds"]
               if b["dtype"] == "bf16" and b["spill_bytes"] and not b["constexprs"].get("EXACT")
               and any(" bench " in p for p in b["problems"])]
    assert spilled == []


@pytest.mark.parametrize("op, expect", [
    ("softmax_backward", [("grad", (64, 512), "bfloat16"), ("out", (64, 512), "bfloat16"), ("axis", -1)]),
    ("cross_entropy_backward", [("grad", (), "float32"), ("logits", (64, 512), "bfloat16"), ("target", (64,), "int64"),
                                ("lse", (64,), "float32")]),
])
def test_bench_shapes_become_what_training_hands_the_backward(op, expect):
    """A backward's bench problem: grad and the forward's output like the output, statistics in float32 (meta
    tensors: no data, no float64 reference)."""
    from opport.ops import get_op

    tool, bwd = _tool(), get_op(op)
    fwd = {"softmax_backward": {"x": tool._empty((64, 512), "bfloat16"), "axis": -1},
           "cross_entropy_backward": {"logits": tool._empty((64, 512), "bfloat16"),
                                      "target": tool._empty((64,), "int64")}}[op]
    kw = tool._backward_kw(bwd, lambda: fwd)
    assert list(kw) == list(bwd.params)
    for name, *want in expect:
        got = kw[name]
        assert ((tuple(got.shape), str(got.dtype).removeprefix("torch.")) if hasattr(got, "shape") else (got,)) == tuple(want)
        assert not hasattr(got, "device") or got.device.type == "meta"


def test_a_derived_op_name_selects_that_op_alone():
    tool = _tool()
    assert [s.name for s in tool.cuda_specs(["rmsnorm_backward"])] == ["rmsnorm_backward"]
    names = [s.name for s in tool.cuda_specs(["rmsnorm", "rmsnorm_backward"])]
    assert names[0] == "rmsnorm" and len(names) == len(set(names))


def _fake_kernel(shared: int):
    md = SimpleNamespace(hash=f"h{shared}", num_warps=4, num_stages=3, shared=shared)
    fn = SimpleNamespace(params=[SimpleNamespace(name="BLOCK", is_constexpr=True)])
    src = SimpleNamespace(fn=fn, constants={(0,): 64}, signature={"x": "*bf16"})
    return SimpleNamespace(metadata=md, src=src, asm={})


def test_the_check_fails_on_shared_memory_and_grids_past_the_limits():
    """The recorder itself: a config over 227 KB of shared memory or a grid axis past 65535 is a failure."""
    tool = _tool()
    report = tool.Report(90)
    rec = tool._Recorder(report)
    rec.problem = "ok"
    rec.record("k", _fake_kernel(1024), (132, 1), 0.1)
    assert report.failures == []
    rec.problem = "too much shared memory"
    rec.record("k", _fake_kernel(300_000), (132,), 0.1)
    rec.problem = "grid"
    rec.record("k", _fake_kernel(1024), (1, 70_000), 0.1)
    assert [p for p, _ in report.failures] == ["too much shared memory", "grid"]
    assert report.builds["h1024"].problems == ["ok", "grid"] and report.builds["h1024"].constexprs == {"BLOCK": 64}


def test_ptxas_usage_is_remembered_in_the_triton_cache_entry(tmp_path, monkeypatch):
    """A cache hit runs no ptxas: the usage Triton's own ptxas run reported is read back from the entry."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    tool = _tool()
    log = "ptxas info    : Used 40 registers, 8 bytes spill stores, 4 bytes spill loads"
    assert tool._cached_usage("ab" * 32, log, None, 90) == (40, 12)
    monkeypatch.setattr(tool, "_ptxas_usage", lambda ptx, arch: pytest.fail("ptxas ran again"))
    assert tool._cached_usage("ab" * 32, "", ".version 8.0", 90) == (40, 12)
    assert tool._cached_usage("cd" * 32, "", None, 90) == (None, None) and len(list(tmp_path.iterdir())) == 1


def test_prefill_matmul_and_attention_use_hopper_tensor_cores(sm90):
    """bf16 GEMM tiles of 128 rows and FA2 attention tiles must lower to wgmma, not the older mma.sync path."""
    _, report = sm90

    def mma(kernel, shape):
        found = {b["mma"] for b in report["builds"] if b["kernel"] == kernel and b["dtype"] == "bf16"
                 and any(f"bench {shape} bfloat16" in p for p in b["problems"]) and not b["constexprs"].get("EXACT")}
        assert found, (kernel, shape)
        return found

    assert mma("_matmul_kernel", "4096x4096x4096") == {"wgmma"}
    assert mma("_attention_kernel", "B4 H32/8 S4096x4096 D128 causal") == {"wgmma"}
    assert mma("_attention_kernel", "B8 H32/32 S2048x2048 D64") == {"wgmma"}


MEMORY_BOUND = ("rmsnorm", "layernorm", "softmax", "gelu", "silu", "swiglu", "rope", "cross_entropy")


@pytest.mark.parametrize("op", MEMORY_BOUND)
def test_memory_bound_llm_kernels_load_16_bytes_at_a_time(sm90, op):
    """Contiguous bf16 rows must compile to 16-byte vector loads; narrower ones leave HBM bandwidth unused."""
    _, report = sm90
    # chosen by the problem's dtype (a build is labelled by its first tensor: cross_entropy's float32 grad);
    # `sum_partials` reads the float32 weight-gradient partials, a [programs, columns] buffer, not the bf16 rows
    widths = {b["load_bytes"] for b in report["builds"] if b["kernel"] != "_sum_partials_kernel"
              and any(p.startswith(f"{op} bench ") and p.endswith(" bfloat16") for p in b["problems"])}
    assert widths == {16}, widths


@pytest.mark.parametrize("op", [f"{name}_backward" for name in MEMORY_BOUND])
def test_memory_bound_llm_backward_kernels_load_16_bytes_at_a_time(sm90, op):
    """The same for the backward kernels, where the cuda backend has one (else the op's backward runs on cpu)."""
    _, report = sm90
    if not any(p.startswith(f"{op} ") for b in report["builds"] for p in b["problems"]):
        pytest.skip(f"no cuda kernel for {op}")
    # chosen by the problem's dtype (a build is labelled by its first tensor: cross_entropy's float32 grad);
    # `sum_partials` reads the float32 weight-gradient partials, a [programs, columns] buffer, not the bf16 rows
    widths = {b["load_bytes"] for b in report["builds"] if b["kernel"] != "_sum_partials_kernel"
              and any(p.startswith(f"{op} bench ") and p.endswith(" bfloat16") for p in b["problems"])}
    assert widths == {16}, widths


def test_large_llm_problems_fill_the_h200(sm90):
    """A bench problem moving >= 64 MB (more than the L2) must launch at least 80% of the H200's 132 SMs' worth
    of programs (decode attention over 16K keys and a 16-row GEMM once ran 64 programs: half the GPU idle)."""
    _, report = sm90
    big = {p: g for p, g in report["grids"].items() if " bench " in p and g["bytes"] >= 64 << 20}
    assert len(big) > 20
    thin = {p: g["programs"] for p, g in big.items() if g["programs"] < 0.8 * 132}
    assert thin == {}


# --------------------------------------------------------------------------- the record of verified configurations

HELPER = '''
import triton


@triton.jit
def helper(x):
    return x * {factor}
'''
KERNEL = '''
import triton
import triton.language as tl
from aot_helpers import helper

SHIFT = tl.constexpr({shift})


@triton.jit
def kernel(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, helper(tl.load(x_ptr + i, mask=i < n)) + SHIFT, mask=i < n)
'''


def _module(path: Path, name: str, text: str):
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def kernel_key(tmp_path, monkeypatch):
    """key(factor=, shift=, ...): the record key of a small kernel whose helper (in another module, as the cuda
    kernels' helpers live in _launch.py) multiplies by `factor`, the kernel adding the constexpr global `shift`."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # define compiled JIT functions, as the tool does
    made = iter(range(100))

    def key(factor="2.0", shift="1.0", block=64, ptr="*fp32", attrs=None, arch=90, moved=0, lines=False, **options):
        i = next(made)  # each version from its own files: the key must come from the text, not the file or module
        helper = "\n" * moved + HELPER.format(factor=factor)  # `moved` lines further down its file
        monkeypatch.setitem(sys.modules, "aot_helpers", _module(tmp_path / f"h{i}.py", "aot_helpers", helper))
        mod = _module(tmp_path / f"k{i}.py", f"k{i}", KERNEL.format(shift=shift))
        src = ASTSource(mod.kernel, {"x_ptr": ptr, "n": "i32", "BLOCK": "constexpr"}, {(2,): block}, attrs or {})
        options = {"num_warps": 4, "num_stages": 3, **options}
        return _tool().compile_key(src, GPUTarget("cuda", arch, 32), options, lines=lines)

    return key


def test_the_record_key_changes_with_the_kernel_its_helpers_and_the_configuration(kernel_key, monkeypatch):
    import triton.backends.nvidia.compiler as nvidia
    import triton.runtime.cache as cache

    base = kernel_key()
    assert re.fullmatch(r"[0-9a-f]{32}", base) and kernel_key() == base  # same text, other files: same key
    changed = {
        "helper source": kernel_key(factor="3.0"),  # the kernel's own text is the same
        "constexpr global": kernel_key(shift="2.0"),
        "constexpr argument": kernel_key(block=128),
        "argument dtype": kernel_key(ptr="*bf16"),
        "specialisation": kernel_key(attrs={(0,): [["tt.divisibility", 16]]}),
        "num_warps": kernel_key(num_warps=8),
        "num_stages": kernel_key(num_stages=4),
        "arch": kernel_key(arch=80),
    }
    monkeypatch.setattr(cache, "triton_key", lambda: "3.6.1-other-sources")
    changed["Triton version"] = kernel_key()
    monkeypatch.undo()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(nvidia, "get_ptxas_version", lambda arch: "Cuda compilation tools, release 12.9, V12.9.0")
    changed["ptxas version"] = kernel_key()
    assert {what: k for what, k in changed.items() if k == base} == {}
    assert len(set(changed.values())) == len(changed)


def test_the_record_key_is_tritons_but_for_line_numbers(kernel_key):
    """A helper moved down its file (an edit above it) compiles to the same code but for debug line info: Triton's
    own key changes, the record's does not. The same text at the same lines gives Triton's key in any file."""
    assert kernel_key(moved=3) == kernel_key()
    assert kernel_key(moved=3, lines=True) != kernel_key(lines=True) == kernel_key(lines=True)
    assert kernel_key(lines=True) != kernel_key()


def test_a_configuration_in_the_record_is_not_compiled_again(tmp_path):
    """End to end on two small kernels: the first run compiles them (its keys checked against Triton's own on each
    compile) and records them; the second, with an empty Triton cache, compiles nothing and reports the same."""
    record, cache = tmp_path / "record.json", tmp_path / "cache"
    args = [sys.executable, str(TOOL), "--op=gelu", "--tier=smoke", "--no-cases", "--dtype=float32", f"--record={record}"]
    runs = []
    for i, extra in enumerate((["--jobs=1", "--update-record"], ["--jobs=2"])):
        env = {**_env(), "TRITON_CACHE_DIR": str(cache / str(i))}
        proc = subprocess.run(args + extra + ["--json", str(tmp_path / f"{i}.json")], capture_output=True, text=True,
                              env=env, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        runs.append(json.loads((tmp_path / f"{i}.json").read_text()))
    first, second = ({b["key"]: b for b in r["builds"]} for r in runs)
    assert len(first) == 2 and {b["source"] for b in first.values()} == {"compiled"}
    assert set(second) == set(first) and {b["source"] for b in second.values()} == {"record"}
    tool = _tool()
    assert all(tool.record_entry(tool.Build(**second[k])) == tool.record_entry(tool.Build(**first[k])) for k in first)
    assert not (cache / "1").exists() or not any((cache / "1").iterdir())  # nothing was compiled


def test_the_record_holds_one_line_per_configuration(tmp_path):
    tool = _tool()
    entries = {"ab" * 32: {"kernel": "_k", "dtype": "bf16", "constexprs": {"BLOCK": 64}, "num_warps": 4,
                           "num_stages": 3, "shared": 0, "registers": 40},
               "cd" * 32: {"kernel": "_j", "dtype": "fp32", "constexprs": {}, "num_warps": 8, "num_stages": 1,
                           "shared": 1024, "mma": "wgmma", "load_bytes": 16}}
    tool.save_record(tmp_path / "r.json", entries, 90)
    lines = (tmp_path / "r.json").read_text().splitlines()
    assert len(lines) == 2 + len(entries) and lines[1].startswith('"' + "cd" * 32)  # sorted by kernel name
    assert tool.load_record(tmp_path / "r.json") == entries
    assert tool.load_record(tmp_path / "missing.json") == {}


def _compiled_kernel(key: str, shared: int, ptx: str = ""):
    """A compiled kernel as the recorder sees one, without compiling (no ptxas log, so no usage figures)."""
    k = _fake_kernel(shared)
    k.metadata.hash, k.asm = key, {"ptx": ptx} if ptx else {}
    return k


def test_a_cold_run_fails_where_a_recompiled_configuration_disagrees_with_the_record():
    tool = _tool()
    entry = {"kernel": "k", "dtype": "bf16", "constexprs": {"BLOCK": 64}, "num_warps": 4, "num_stages": 3,
             "shared": 1024}
    report = tool.Report(90)
    rec = tool._Recorder(report, entries={"same": entry, "moved": {**entry, "shared": 2048}}, cold=True)
    rec.problem = "agrees"
    rec.record("k", _compiled_kernel("same", 1024), (1,), 0.1)
    rec.problem = "disagrees"
    rec.record("k", _compiled_kernel("moved", 1024), (1,), 0.1)
    assert [p for p, _ in report.failures] == ["disagrees"] and "shared 1024 (recorded 2048)" in report.failures[0][1]
    assert {b.source for b in report.builds.values()} == {"compiled"}


def test_a_recorded_configuration_is_checked_with_its_recorded_figures():
    """A record hit is not compiled, but its shared memory still meets the limit check, its figures the report."""
    tool = _tool()
    entry = {"kernel": "k", "dtype": "bf16", "constexprs": {"BLOCK": 64}, "num_warps": 8, "num_stages": 2,
             "shared": 300_000, "registers": 96, "spill_bytes": 0, "mma": "wgmma", "load_bytes": 16}
    report = tool.Report(90)
    rec = tool._Recorder(report, entries={"h": entry})
    rec.problem = "p"
    rec.record("k", tool._Recorded("h", entry), (1,), 0.0)
    build = report.builds["h"]
    assert build.source == "record" and tool.record_entry(build) == entry and build.problems == ["p"]
    assert [p for p, _ in report.failures] == ["p"]  # 300,000 bytes of shared memory > 227 KiB


def test_the_record_is_written_only_from_a_passing_run_and_a_full_run_drops_stale_entries(tmp_path, capsys):
    tool = _tool()
    path = tmp_path / "r.json"
    old = {"kernel": "k", "dtype": "fp32", "constexprs": {}, "num_warps": 4, "num_stages": 3, "shared": 0}
    tool.save_record(path, {"stale": old}, 90)
    report = tool.Report(90)
    report.builds["new"] = tool.Build("k", "fp32", {}, 8, 3, 0, 0.1, key="new")
    tool._update_record(report, str(path), full=False)
    assert set(tool.load_record(path)) == {"stale", "new"}
    tool._update_record(report, str(path), full=True)
    assert set(tool.load_record(path)) == {"new"}
    report.failures.append(("p", "a failure"))
    report.builds["other"] = tool.Build("k", "fp32", {}, 2, 3, 0, 0.1, key="other")
    tool._update_record(report, str(path), full=True)
    assert set(tool.load_record(path)) == {"new"} and "not updated" in capsys.readouterr().err


def test_the_committed_record_is_well_formed():
    tool = _tool()
    text = tool.RECORD.read_text()
    entries = tool.load_record(tool.RECORD)
    assert len(text.splitlines()) == 2 + len(entries) > 100
    assert all(re.fullmatch(r"[0-9a-f]{32}", k) for k in entries)
    required = {"kernel", "dtype", "constexprs", "num_warps", "num_stages", "shared"}
    assert all(required <= set(e) <= set(tool.RECORDED) for e in entries.values())


def test_only_the_op_and_dtype_units_with_a_stale_launch_go_to_compile_processes():
    """After the first pass (record only), a unit with a problem the record could not finish is redone in a process,
    in that problem's dtype alone; the first pass's results for it are dropped, the rest kept."""
    tool = _tool()
    report = tool.Report(90)
    report.labels = ["gelu bench 8x256 float32", "gelu_backward case c float32", "gelu bench 8x256 bfloat16",
                     "rope bench r bfloat16"]
    report.problems, report.stale = 4, ["gelu_backward case c float32"]
    report.grids = {p: {"bytes": 1, "programs": 1} for p in report.labels}
    report.failures = [("gelu bench 8x256 float32", "x")]
    report.builds = {"a": tool.Build("k", "fp32", {}, 4, 3, 0, 0.0, problems=report.labels[::2], key="a"),
                     "b": tool.Build("j", "fp32", {}, 4, 3, 0, 0.0, problems=report.labels[1:2], key="b"),
                     "c": tool.Build("r", "bf16", {}, 4, 3, 0, 0.0, problems=report.labels[3:], key="c")}
    units = tool._stale_units(report, [("gelu", tool.DTYPES), ("rope", tool.DTYPES)])
    assert units == [("gelu", ("float32",))]
    assert report.labels == ["gelu bench 8x256 bfloat16", "rope bench r bfloat16"] and report.problems == 2
    assert set(report.grids) == set(report.labels) and report.failures == [] and report.stale == []
    assert {k: b.problems for k, b in report.builds.items()} == {"a": ["gelu bench 8x256 bfloat16"],
                                                                   "c": ["rope bench r bfloat16"]}
