"""The sm_90 compile check (tools/cuda_aot.py): every cuda kernel configuration compiles and fits an H200."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None,
                       reason="needs torch and triton"),
    pytest.mark.timeout(1800),  # the module fixture compiles every configuration cold in CI (~15 min on 2 cores)
]
TOOL = Path(__file__).resolve().parents[1] / "tools" / "cuda_aot.py"


def _tool():
    """tools/cuda_aot.py as a module (it is a script, not part of the opport package)."""
    if "cuda_aot" not in sys.modules:
        spec = importlib.util.spec_from_file_location("cuda_aot", TOOL)
        sys.modules["cuda_aot"] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
        spec.loader.exec_module(sys.modules["cuda_aot"])
    return sys.modules["cuda_aot"]


# float16 kernels are bfloat16's twins (same tiles, same register and shared-memory use; only the conversions
# differ), so CI compiles float32 and bfloat16: with eighteen ops a cold three-dtype run no longer fits CI's
# half hour. `make aot` (python tools/cuda_aot.py) compiles all three.
CI_DTYPES = ("float32", "bfloat16")


@pytest.fixture(scope="module")
def sm90(tmp_path_factory):
    """One run of the whole check (every op, every bench tier, every conformance case; float32 and bfloat16) in a
    fresh process."""
    out = tmp_path_factory.mktemp("aot") / "aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(TOOL), "--json", str(out), *[f"--dtype={d}" for d in CI_DTYPES]],
                          capture_output=True, text=True, env=env, timeout=1800)
    return proc, json.loads(out.read_text()) if out.exists() else None


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
