"""The sm_90 compile check (opport/backends/cuda/aot.py): every cuda kernel configuration compiles and fits an H200."""

import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None, reason="needs torch and triton"
)


@pytest.fixture(scope="module")
def sm90(tmp_path_factory):
    """One run of the whole check (every op, every bench tier, every conformance case) in a fresh process."""
    out = tmp_path_factory.mktemp("aot") / "aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "opport.backends.cuda.aot", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=1800)
    return proc, json.loads(out.read_text()) if out.exists() else None


def test_every_kernel_compiles_for_sm90_within_its_limits(sm90):
    proc, report = sm90
    assert report is not None, proc.stderr[-3000:]
    assert proc.returncode == 0, "\n".join(f"{p}: {w}" for p, w in report["failures"][:20])
    assert report["failures"] == [] and report["skipped"] == []
    from opport.backends.cuda.aot import SHARED_LIMIT

    assert all(b["shared"] <= SHARED_LIMIT[90] for b in report["builds"])


def test_every_op_and_the_llm_shapes_were_compiled(sm90):
    from opport.ops import all_ops

    _, report = sm90
    compiled = {p.split()[0] for b in report["builds"] for p in b["problems"]}
    assert compiled == set(all_ops())
    llm = [p for b in report["builds"] for p in b["problems"] if "bench" in p and "S16384x16384" in p]
    assert llm, "the 16K-token attention shape of the llm tier was not compiled"


def test_the_llm_tier_fast_kernels_do_not_spill(sm90):
    """Register spills in the bench's bf16 shapes would cost bandwidth on the H200 (the exact attention re-run may)."""
    _, report = sm90
    spilled = [(b["kernel"], b["constexprs"], b["spill_bytes"]) for b in report["builds"]
               if b["dtype"] == "bf16" and b["spill_bytes"] and not b["constexprs"].get("EXACT")
               and any(" bench " in p for p in b["problems"])]
    assert spilled == []


def _fake_kernel(shared: int):
    md = SimpleNamespace(hash=f"h{shared}", num_warps=4, num_stages=3, shared=shared)
    fn = SimpleNamespace(params=[SimpleNamespace(name="BLOCK", is_constexpr=True)])
    src = SimpleNamespace(fn=fn, constants={(0,): 64}, signature={"x": "*bf16"})
    return SimpleNamespace(metadata=md, src=src, asm={})


def test_the_check_fails_on_shared_memory_and_grids_past_the_limits():
    """The recorder itself: a config over 227 KB of shared memory or a grid axis past 65535 is a failure."""
    from opport.backends.cuda.aot import Report, _Recorder

    report = Report(90)
    rec = _Recorder(report)
    rec.problem = "ok"
    rec.record("k", _fake_kernel(1024), (132, 1), 0.1)
    assert report.failures == []
    rec.problem = "too much shared memory"
    rec.record("k", _fake_kernel(300_000), (132,), 0.1)
    rec.problem = "grid"
    rec.record("k", _fake_kernel(1024), (1, 70_000), 0.1)
    assert [p for p, _ in report.failures] == ["too much shared memory", "grid"]
    assert report.builds["h1024"].problems == ["ok", "grid"] and report.builds["h1024"].constexprs == {"BLOCK": 64}


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
    widths = {b["load_bytes"] for b in report["builds"] if b["dtype"] == "bf16"
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
