"""`opport bench`: the smoke run end to end, its JSON and plot, baselines, overhead, and the pieces they use."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

import opport
from opport.accuracy import compare, like
from opport.backends.cpu.bench import HostTimer
from opport.bench import report
from opport.bench.ceilings import Ceilings
from opport.bench.runner import Settings, run_shape
from opport.bench.timing import summarize
from opport.bench.workloads import ArrayMaker, get_workload
from opport.cli import main
from opport.dispatch import get_backend, kernels
from opport.ops import all_ops, get_op
from opport.spec import Tolerance

HAS_TORCH = importlib.util.find_spec("torch") is not None
TOL = Tolerance(rtol=1e-3, atol=1e-6)


@pytest.fixture(scope="module")
def smoke_report(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    js, png = d / "r.json", d / "r.png"
    rc = main(["bench", "--smoke", "--op", "rmsnorm", "--op", "matmul", "--json", str(js), "--plot", str(png)])
    return rc, json.loads(js.read_text()), png


def test_smoke_run_writes_the_design_json(smoke_report):
    rc, rep, _ = smoke_report
    assert rc == 0
    assert {"backend", "mode", "device", "ceilings", "rows", "versions", "timing", "summary"} <= set(rep)
    assert rep["backend"] == "cpu" and rep["ceilings"]["copy_GBps"] > 0 and rep["ceilings"]["matmul_TFLOPs"] > 0
    assert "numpy" in rep["versions"] and rep["timing"]["timer"] and rep["device"]["name"]
    mine = [r for r in rep["rows"] if r["impl"] == "opport"]
    assert {r["op"] for r in mine} == {"rmsnorm", "matmul"}
    for r in mine:
        for key in ("op", "shape", "dtype", "impl", "ms", "GBps", "TFLOPs", "roofline_pct", "vs"):
            assert key in r, key
        assert r["correct"] is True and r["p20_ms"] <= r["ms"] <= r["p80_ms"]
        assert set(r["vs"]) >= {"numpy"} | ({"torch_eager"} if HAS_TORCH else set())
        floor = max(r["bytes"] / (rep["ceilings"]["copy_GBps"] * 1e6), r["flops"] / (rep["ceilings"]["matmul_TFLOPs"] * 1e9))
        assert r["roofline_pct"] == pytest.approx(100 * floor / r["ms"], rel=0.01)  # this run's (rounded) ceilings
        base = next(b for b in rep["rows"] if b["op"] == r["op"] and b["impl"] == "numpy")
        assert r["vs"]["numpy"] == pytest.approx(base["ms"] / r["ms"])
        assert r["GBps"] == pytest.approx(r["bytes"] / (r["ms"] * 1e6))


def test_smoke_plot_is_a_png(smoke_report):
    _, _, png = smoke_report
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_baseline_fails_only_on_a_real_slowdown(smoke_report, tmp_path):
    _, rep, _ = smoke_report
    fast = json.loads(json.dumps(rep))
    for r in fast["rows"]:
        if r.get("ms"):
            r["ms"] /= 1000  # a baseline 1000x faster: every opport row now "regressed"
    slow = json.loads(json.dumps(rep))
    for r in slow["rows"]:
        if r.get("ms"):
            r["ms"] *= 1000
    (tmp_path / "fast.json").write_text(json.dumps(fast))
    (tmp_path / "slow.json").write_text(json.dumps(slow))
    out = tmp_path / "now.json"
    args = ["bench", "--smoke", "--op", "rmsnorm", "--repeats", "1", "--json", str(out)]
    assert main([*args, "--baseline", str(tmp_path / "fast.json")]) == 1
    got = json.loads(out.read_text())["regressions"]
    assert [s["op"] for s in got["slower"]] == ["rmsnorm"]
    mine = next(r for r in json.loads(out.read_text())["rows"] if r["impl"] == "opport")
    assert len(mine["rerun_ms"]) == 1  # the suspect row was run again before it counted
    assert main([*args, "--baseline", str(tmp_path / "slow.json")]) == 0


def test_regressions_are_noise_aware():
    base = [{"op": "a", "case": "c", "dtype": "float32", "impl": "opport", "ms": 1.0, "shape": "s"}]
    row = {"op": "a", "case": "c", "dtype": "float32", "impl": "opport", "ms": 1.3, "shape": "s"}
    assert report.regressions([row], base, 0.10)[0]["slower_by"] == pytest.approx(0.3)
    assert report.regressions([{**row, "rerun_ms": [1.05]}], base, 0.10) == []  # one run inside the margin clears it
    assert report.regressions([{**row, "ms": 1.09}], base, 0.10) == []
    assert report.missing_rows([{**row, "ms": None}], base) == [("a", "c", "float32", "opport")]


def test_summary_geomean_and_fast_p():
    rows = [
        {"op": "x", "impl": "opport", "status": "ok", "correct": True, "vs": {"torch_eager": 2.0}},
        {"op": "x", "impl": "opport", "status": "ok", "correct": True, "vs": {"torch_eager": 0.5}},
        {"op": "x", "impl": "opport", "status": "ok", "correct": True, "vs": {"torch_eager": 8.0}},
        {"op": "x", "impl": "opport", "status": "ok", "correct": False, "vs": {"torch_eager": 16.0}},
        {"op": "x", "impl": "torch_eager", "status": "ok", "correct": True},
    ]
    agg = report.summary(rows)["per_op"]["x"]
    assert agg["shapes"] == 4 and agg["correct"] == 3
    e = agg["vs_torch_eager"]
    assert e["geomean"] == pytest.approx(2.0)  # (2 * 0.5 * 8) ** (1/3); the incorrect row is left out
    assert e["fast_1.0"] == pytest.approx(2 / 4)  # correct and faster, over every shape opport ran
    assert e["fast_0.8"] == pytest.approx(2 / 4)


def test_roofline_floor_picks_the_binding_roof():
    c = Ceilings(copy_GBps=100.0, matmul_TFLOPs={"float32": 1.0}, default_dtype="float32")
    assert c.floor_ms(10**8, 10, "float32") == (pytest.approx(1.0), "memory")  # 1e8 B at 100 GB/s = 1 ms
    assert c.floor_ms(10, 10**10, "bfloat16") == (pytest.approx(10.0), "compute")  # falls back to the float32 rate


def test_host_timer_summary_orders_quantiles():
    t = summarize(HostTimer(budget_ms=5, warmup_ms=1).samples(lambda: sum(range(100))))
    assert t.n >= 5 and 0 < t.p20_ms <= t.ms <= t.p80_ms


@pytest.mark.parametrize("name", sorted(all_ops()))
def test_baselines_compute_the_op(name):
    """Every baseline agrees with the op's float64 reference on the smoke shape, so a ratio compares like with like."""
    spec = get_op(name)
    wl = get_workload(spec)
    if not wl.shapes:
        pytest.skip(f"{name}: no workload and no case tagged llm, so opport bench skips it")
    shape = (wl.shapes_for("smoke") or wl.shapes)[0]
    bound = spec.bind(**wl.make(shape.dims, "float32", ArrayMaker("numpy", seed=1)))
    ref = spec.run_reference(*bound)
    tol = spec.tolerances["float32"]
    if wl.numpy is not None and (name != "gelu" or importlib.util.find_spec("scipy")):  # NumPy has no erf
        assert compare(wl.numpy(*bound), ref, tol, "float32").ok, f"{name}: {wl.numpy_call}"
    if wl.torch_eager is not None and HAS_TORCH:
        import torch

        from opport.dispatch.adapters import NumpyAdapter

        tb = tuple(NumpyAdapter.to_torch(a, "cpu") if isinstance(a, np.ndarray) else a for a in bound)
        assert compare(like(wl.torch_eager(*tb), ref), ref, tol, "float32").ok, f"{name}: {wl.torch_call}"
        t64 = tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in tb)
        with torch.no_grad():
            r64 = (wl.torch_reference or wl.torch_eager)(*t64)  # the reference the cuda run checks against
        assert compare(like(r64, ref), ref, Tolerance(1e-9, 1e-12), "float64").ok, name


@pytest.mark.skipif(not HAS_TORCH or importlib.util.find_spec("triton") is None, reason="needs torch and triton")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(all_ops()))
def test_torch_kernel_path_checks_against_a_torch_float64_reference(name, dtype):
    """The cuda code path (torch inputs, torch float64 reference, torch baselines), run by Triton's interpreter.

    What `opport bench --backend cuda` does on a GPU for every op, except that CPU timers stand in for CUDA events.
    """
    if not _has_module("cuda", name):
        pytest.skip(f"no cuda {name} kernel")
    spec = get_op(name)
    wl = get_workload(spec)
    st = Settings("cuda", "torch", "cpu", _GraphTimer(budget_ms=2, warmup_ms=0, min_samples=2),
                  Ceilings(20.0, {"float32": 0.2, "bfloat16": 0.2}, "float32"), rounds=1, graphs=True)
    rows = run_shape(spec, wl, wl.shapes_for("smoke")[0], dtype, st)
    by = {r["impl"]: r for r in rows}
    assert by["opport"]["correct"] is True and f"cuda.{name}" in by["opport"]["call"], by["opport"]
    assert by["torch_eager"]["status"] == "ok" and by["opport"]["vs"]["torch_eager"] > 0
    if dtype == "float32":  # in bfloat16, torch's cross_entropy returns a bfloat16-rounded loss
        assert by["torch_eager"]["correct"] is True, by["torch_eager"]
    assert by["opport"]["launch_bound"] and by["opport"]["host_us"] > 0  # a tiny shape gets the graph variant
    assert by["opport"]["vs_graph"]["torch_eager"] == pytest.approx(by["torch_eager"]["graph_ms"] / by["opport"]["graph_ms"])


class _GraphTimer(HostTimer):
    """A CPU stand-in for CudaTimer's graph and host-time measurements (no GPU here)."""

    def graph(self, fn):
        return self.samples(fn)

    def host_us(self, fn):
        return 1e3 * summarize(self.samples(fn)).ms


def _has_module(backend: str, op: str) -> bool:
    return importlib.util.find_spec(f"opport.backends.{backend}.{op}") is not None


def test_overhead_reports_the_cached_path(tmp_path):
    out = tmp_path / "o.json"
    assert main(["bench", "--overhead", "--op", "rmsnorm", "--budget-ms", "40", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    numpy_row = next(r for r in rows if r["inputs"] == "numpy")
    assert numpy_row["kernel"] == "cpu.rmsnorm" and numpy_row["goal"] in ("moonshot", "gate", "over")
    assert numpy_row["public_us"] > numpy_row["direct_us"] > 0  # the public call does more work than the kernel
    assert numpy_row["overhead_us"] > 0 and numpy_row["in_situ_rounds"] >= 15 and numpy_row["in_situ_sem_us"] > 0
    if HAS_TORCH:
        t = next(r for r in rows if r["inputs"] == "torch-cpu")
        assert t["total_added_us"] > t["overhead_us"] > 0  # converting torch <-> numpy costs more than nothing
    # the kernel stub is gone afterwards: the cached path runs the real kernel again
    x, w = np.full((2, 8), 3.0, np.float32), np.full(8, 2.0, np.float32)
    np.testing.assert_allclose(opport.rmsnorm(x, w), np.full((2, 8), 2.0, np.float32), rtol=1e-6)
    assert kernels(opport.rmsnorm.spec, get_backend("cpu"))[0].fn.__name__ == "rmsnorm"


def test_cuda_without_a_gpu_is_refused_clearly(capsys):
    if HAS_TORCH:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is present")
    assert main(["bench", "--backend", "cuda", "--op", "rmsnorm"]) == 2
    err = capsys.readouterr().err
    assert "cannot benchmark here" in err and "timings mean nothing" in err and len(err.strip().splitlines()) == 1


def test_neuron_emulator_reports_counts_not_times(tmp_path):
    from opport.dispatch import get_backend

    if get_backend("neuron").unavailable() or get_backend("neuron").mode() != "emulator":
        pytest.skip("neuron backend not in emulator mode")
    out = tmp_path / "n.json"
    assert main(["bench", "--backend", "neuron", "--op", "rmsnorm", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    (row,) = rep["rows"]
    assert "ms" not in row and row["correct"] is True
    assert row["counts"]["hbm_bytes"] >= row["bytes"] * 0.99 and row["counts"]["instructions"]["dma"] > 0
    assert row["hbm_bytes_vs_min"] == pytest.approx(row["counts"]["hbm_bytes"] / row["bytes"])


def test_each_backend_declares_how_it_is_measured():
    """Tier, dtypes, baselines and the kind of measurement come from the backend's bench module."""
    from opport.bench.profile import Unsupported, profile

    cpu = profile(get_backend("cpu"))
    assert (cpu.measures, cpu.tier, cpu.dtypes, cpu.compile_baseline, cpu.graphs) == ("time", "small", ("float32",),
                                                                                      False, False)
    assert cpu.device()["threads"]["opport"] >= 1  # the cpu backend reports its own thread pool
    neuron = get_backend("neuron")
    if not neuron.unavailable() and neuron.mode() == "emulator":
        assert (profile(neuron).measures, profile(neuron).tier) == ("counts", "smoke")
    cuda = get_backend("cuda")
    if not cuda.unavailable() and cuda.capabilities.emulated():
        with pytest.raises(Unsupported, match="timings mean nothing"):
            profile(cuda)


def test_a_backend_without_a_bench_module_is_refused_clearly(backend_factory, capsys):
    with backend_factory("nobench"):
        assert main(["bench", "--backend", "nobench", "--smoke"]) == 2
    err = capsys.readouterr().err
    assert "declares no bench module" in err and len(err.strip().splitlines()) == 1


def test_an_emulated_backend_is_never_timed_on_the_host(capsys):
    """Even when its bench module has a timer: it would time this CPU, not the device."""
    from opport.dispatch import Backend, Capabilities, register_backend, unregister_backend
    from opport.dtypes import FLOATS

    register_backend(Backend(name="emu", package="_opport_test_backends.emu", array_kind="numpy", device_types=(),
                             dtypes=FLOATS, probe=lambda: None, mode=lambda: "emulator",
                             capabilities=Capabilities(emulated=lambda: True, bench="opport.backends.cpu.bench")))
    try:
        assert main(["bench", "--backend", "emu", "--smoke"]) == 2
    finally:
        unregister_backend("emu")
    err = capsys.readouterr().err
    assert "emulates the device" in err and "declares no counters" in err


def test_bench_and_conformance_name_no_backend_and_read_no_mode():
    """What they need to know about a backend is its declaration (Capabilities, its bench module): no
    branch on a backend's name or mode string. cpu is left out: it is also torch's name for host memory; so are
    backends other packages add, whose names and modes opport cannot know (and may be common words)."""
    from pathlib import Path

    from opport.dispatch import backends

    words = set()
    for b in backends().values():
        if b.name != "cpu" and b.package.startswith("opport.backends."):
            words |= {b.name, *([] if b.unavailable() else [b.mode()])}
    root = Path(opport.__file__).parent
    found = [(str(p.relative_to(root)), w) for sub in ("bench", "conformance") for p in sorted((root / sub).rglob("*.py"))
             for w in sorted(words) if f'"{w}"' in p.read_text() or f"'{w}'" in p.read_text()]
    assert words >= {"cuda", "neuron"} and found == []
