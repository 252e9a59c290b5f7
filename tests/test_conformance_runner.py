"""The runner end to end, in-process: reports, contract checks on broken kernels, known failures, baseline, CLI."""

import json
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from opport.cli import main
from opport.conformance import Options, gate, run
from opport.conformance import report as rep
from opport.conformance.cases import Selection, items_for
from opport.conformance.runner import default_workers, plan
from opport.dispatch import (
    Backend,
    Capabilities,
    get_backend,
    impl,
    kernels,
    register_backend,
    remove_kernel,
    unregister_backend,
)
from opport.dtypes import FLOATS
from opport.errors import ArgumentError, ShapeError
from opport.ops import get_op
from opport.spec import ErrorCase

SOME = ("row-1", "row-127", "odd-3d", "row-127@*", "bad-*")  # small rmsnorm cases, one in all four layouts


def opts(**kw) -> Options:
    base = dict(backends=("cpu",), ops=("rmsnorm",), dtypes=("float32",), cases=SOME, workers=0)
    return Options(**{**base, **kw})


@pytest.fixture
def ctest():
    """A NumPy backend `ctest` whose rmsnorm kernel each test supplies: install(fn, **impl_kwargs)."""
    spec = get_op("rmsnorm")
    cpu = kernels(spec, get_backend("cpu"))[0].fn
    register_backend(Backend(name="ctest", package="opport.conformance", array_kind="numpy", device_types=(),
                             dtypes=FLOATS, probe=lambda: None, mode=lambda: "test"))

    def install(fn, **kw):
        remove_kernel(spec, "ctest", "ctest.rmsnorm")
        impl(spec, "ctest", name="ctest.rmsnorm", **kw)(fn)

    yield install, cpu
    unregister_backend("ctest")  # and its kernels


def statuses(report) -> dict:
    return {c["case"]: c["status"] for c in report.cases}


def test_cpu_run_reports_follow_design(tmp_path):
    report = run(opts())
    assert report.exit_code == 0, [c["message"] for c in report.failures()]
    names = statuses(report)
    assert {"row-127", "row-127@transposed", "row-127@sliced", "row-127@expanded", "row-127@offset"} <= set(names)
    assert any(n.startswith("bad-rmsnorm.") for n in names)
    data = rep.to_json(report)
    assert (data["backend"], data["mode"]) == ("cpu", "numpy") and "numpy" in data["versions"]
    assert set(data["summary"]) == set(gate.STATUSES) and data["summary"]["pass"] == len(report.cases)
    case = next(c for c in data["cases"] if c["case"] == "row-127")
    assert case["id"] == "rmsnorm/cpu/float32/row-127" and case["kernel"] == "cpu.rmsnorm"
    assert {"max_abs", "max_rel", "max_ulp", "rmse_ratio"} <= set(case["metrics"])
    assert case["repro"] == "opport conformance --backend cpu --op rmsnorm --dtype float32 --case row-127"
    json.dumps(data, allow_nan=False)

    rep.write_junit(report, tmp_path / "r.xml")
    cases = ET.parse(tmp_path / "r.xml").getroot().findall(".//testcase")
    assert len(cases) == len(report.cases)
    props = {p.get("name") for p in cases[0].find("properties")}
    assert {"max_abs", "repro", "kernel"} <= props
    md = rep.to_markdown(report)
    assert "PASS" in md and "| rmsnorm |" in md


def test_failure_names_worst_element_and_repro(ctest):
    install, cpu = ctest
    install(lambda x, w, eps, offset: cpu(x, w, eps, offset) * np.float32(1.01))
    report = run(opts(backends=("ctest",), cases=("row-127",), errors=False))
    res = next(c for c in report.cases if c["case"] == "row-127")
    assert res["status"] == "fail" and "out of tolerance" in res["message"]
    assert set(res["worst"]) >= {"index", "expected", "got", "inputs"} and "x" in res["worst"]["inputs"]
    assert res["repro"] == "opport conformance --backend ctest --op rmsnorm --dtype float32 --case row-127"
    text = "\n".join(rep.failure_lines(res))
    assert "worst element" in text and "repro: opport conformance" in text
    assert report.exit_code == 1


def test_input_mutation_is_caught(ctest):
    install, cpu = ctest

    def kernel(x, w, eps, offset):
        out = cpu(x, w, eps, offset)
        x[..., 0] = 0  # a kernel that uses its input as scratch
        return out

    install(kernel)
    report = run(opts(backends=("ctest",), cases=("row-127",), errors=False, layouts=False))
    assert "wrote into its input" in report.cases[0]["message"]


def test_shared_cases_are_built_once_and_no_kernel_writes_into_them():
    """--covered-by builds every backend's items of an op from one list of its declared cases; what a kernel
    gets (layout None included) is a copy, so a kernel writing into its input leaves the shared case as declared."""
    from opport.conformance.cases import declared_cases, lay_out, shared_cases

    spec = get_op("rmsnorm")
    with shared_cases():
        cases = declared_cases(spec, "float32")
        assert declared_cases(spec, "float32") is cases and declared_cases(spec, "float16") is not cases
        case = cases[0]
        before = case.args[0].copy()
        laid = lay_out(case, None, None)
        laid.args[0][...] = 7  # a kernel using its input as scratch
        assert laid.args[0] is not case.args[0] and np.array_equal(case.args[0], before)
        assert laid.ref_args[0] is case.args[0] and laid.buffers[0] is laid.args[0]
    assert declared_cases(spec, "float32") is not cases  # outside: built afresh, as before


def test_nondeterminism_is_caught_unless_declared(ctest):
    install, cpu = ctest
    rng = np.random.default_rng()
    noisy = lambda x, w, eps, offset: (cpu(x, w, eps, offset) * (1 + 1e-7 * rng.standard_normal(x.shape))).astype(x.dtype)
    install(noisy)
    res = run(opts(backends=("ctest",), cases=("odd-3d",), errors=False, layouts=False)).cases[0]
    assert res["status"] == "fail" and "nondeterministic" in res["message"]
    install(noisy, deterministic=False)
    assert run(opts(backends=("ctest",), cases=("odd-3d",), errors=False, layouts=False)).cases[0]["status"] == "pass"


def test_second_sentinel_finds_output_left_unwritten_under_nan(ctest):
    install, cpu = ctest

    def kernel(x, w, eps, offset):  # skips writing where the answer is NaN: the NaN poison hides it, the sentinel does not
        good = cpu(x, w, eps, offset)
        out = np.empty(x.shape, x.dtype)
        keep = ~np.isnan(good)
        out[keep] = good[keep]
        return out

    install(kernel)
    res = run(opts(backends=("ctest",), cases=("specials",), errors=False, layouts=False)).cases[0]
    assert res["status"] == "fail" and "unwritten" in res["message"]


def test_output_aliasing_an_input_is_caught(ctest):
    install, _ = ctest
    install(lambda x, w, eps, offset: x)
    res = run(opts(backends=("ctest",), cases=("row-1",), errors=False, layouts=False)).cases[0]
    assert res["status"] == "fail" and "aliases an input" in res["message"]


def test_declined_cases_skip_and_all_skipped_fails(ctest):
    install, cpu = ctest
    install(cpu, supports=lambda x, w, eps, offset: "rows above 100 elements" if x.shape[-1] > 100 else None)
    report = run(opts(backends=("ctest",), cases=SOME[:3]))
    got = statuses(report)
    assert got == {"row-1": "pass", "row-127": "skip", "odd-3d": "pass"}
    assert "rows above 100 elements" in next(c["message"] for c in report.cases if c["case"] == "row-127")
    assert report.exit_code == 0
    install(cpu, supports=lambda x, w, eps, offset: "declines everything")
    report = run(opts(backends=("ctest",), cases=SOME[:3]))
    assert set(statuses(report).values()) == {"skip"} and report.exit_code == 1


def test_dtype_without_a_kernel_is_one_skip(ctest):
    install, cpu = ctest
    install(cpu, dtypes=("float16",))
    report = run(opts(backends=("ctest",), errors=False))
    assert [(c["id"], c["status"]) for c in report.cases] == [("rmsnorm/ctest/float32/no-kernel", "skip")]


def test_known_failures_xfail_xpass_and_stale(ctest, tmp_path):
    install, cpu = ctest
    install(lambda x, w, eps, offset: cpu(x, w, eps, offset) * (np.float32(2) if x.shape == (5, 127) else np.float32(1)))
    known = tmp_path / "known.txt"
    known.write_text("# comment\n"
                     "rmsnorm/ctest/float32/row-127 | scaled on purpose (#1)\n"
                     "rmsnorm/ctest/*/row-1 | listed but passes\n"
                     "rmsnorm/ctest/float32/gone-case | stale\n"
                     "softmax/ctest/float32/other-op | not covered by this run\n")
    report = run(opts(backends=("ctest",), cases=SOME[:3], known_failures=(str(known),)))
    assert statuses(report) == {"row-1": "xpass", "row-127": "xfail", "odd-3d": "pass"}
    assert "scaled on purpose" in next(c["known_failure"] for c in report.cases if c["case"] == "row-127")
    assert report.exit_code == 1  # the xpass
    report = run(opts(backends=("ctest",), cases=(), dtypes=("float32",), examples=0, known_failures=(str(known),),
                      errors=False, layouts=False))
    assert [e["pattern"] for e in report.stale] == ["rmsnorm/ctest/float32/gone-case"]


def test_known_failure_file_needs_reasons(tmp_path):
    bad = tmp_path / "known.txt"
    bad.write_text("rmsnorm/cpu/float32/row-1\n")
    with pytest.raises(gate.KnownFailureFileError):
        gate.load_known(bad)
    bad.write_text("rmsnorm/row-1 | too few parts\n")
    with pytest.raises(gate.KnownFailureFileError):
        gate.load_known(bad)


def test_full_tier_entries_are_stale_in_full_runs_only(tmp_path):
    path = tmp_path / "known.txt"
    path.write_text("full: attention/cuda/float16/hyp-228 | a full-tier draw\nsoftmax/cuda/float16/gone | any tier\n")
    entries = gate.load_known(path)
    assert [(e.tier, e.pattern) for e in entries] == [("full", "attention/cuda/float16/hyp-228"),
                                                      (None, "softmax/cuda/float16/gone")]
    covered = {("attention", "cuda", "float16"), ("softmax", "cuda", "float16")}
    assert [e["pattern"] for e in gate.stale_known(entries, covered, "fast")] == ["softmax/cuda/float16/gone"]
    assert len(gate.stale_known(entries, covered, "full")) == 2


def test_backend_known_failures_file_is_valid():
    for name in ("cpu", "cuda", "neuron"):
        path = gate.known_failures_path(get_backend(name))
        assert path.name == "known_failures.txt"
        gate.load_known(path)  # parses (every entry has a reason)


def test_baseline_flags_new_failures_and_2x_metrics(tmp_path):
    case = lambda cid, status, ratio: {"id": cid, "status": status, "metrics": {"tol_ratio": ratio, "floor_ratio": 0.1}}
    base_path = tmp_path / "base.json"
    gate.write_baseline(base_path, [case("a", "pass", 0.2), case("b", "pass", 0.2), case("c", "fail", 2.0)])
    baseline = gate.load_baseline(base_path)
    now = [case("a", "pass", 0.5), case("b", "pass", 0.21), case("c", "fail", 2.0), case("d", "error", None)]
    found = {(r["id"], r["kind"]) for r in gate.regressions(now, baseline)}
    assert found == {("a", "metric regression"), ("d", "new failure")}
    assert gate.regressions([case("a", "pass", 0.01)], {"a": {"status": "pass", "metrics": {"tol_ratio": 0.0}}}) == []


def test_bad_inputs_are_checked_for_class_constraint_and_no_kernel(monkeypatch):
    spec = get_op("rmsnorm")
    x = np.ones((2, 8), np.float32)
    monkeypatch.setattr(spec, "_errors", lambda: [
        ErrorCase("rmsnorm.eps", ArgumentError, (x,), {"eps": 0.0}),  # right
        ErrorCase("rmsnorm.eps", ShapeError, (x,), {"eps": 0.0}),  # wrong class declared
        ErrorCase("rmsnorm.weight_shape", ArgumentError, (x,), {"eps": 0.0}),  # wrong constraint id
        ErrorCase("rmsnorm.eps", ArgumentError, (x,), {"eps": 0.5}),  # valid input: the kernel runs
    ])
    report = run(opts(cases=("bad-*",)))
    by = {c["case"]: c for c in report.cases}
    assert by["bad-rmsnorm.eps"]["status"] == "pass"
    assert "expected ShapeError" in by["bad-rmsnorm.eps~2"]["message"]
    assert "constraint 'rmsnorm.eps', expected 'rmsnorm.weight_shape'" in by["bad-rmsnorm.weight_shape"]["message"]
    assert "kernel cpu.rmsnorm ran" in by["bad-rmsnorm.eps~3"]["message"]
    # rmsnorm.dtype etc. lost their cases: the coverage check names them
    assert by["bad-coverage"]["status"] == "fail" and "rmsnorm.dtype_mismatch" in by["bad-coverage"]["message"]


def test_hypothesis_examples_are_reproducible_from_the_seed():
    spec = get_op("rmsnorm")
    names = lambda seed: [it.name for it in items_for(spec, "cpu", "float32", Selection(examples=6, seed=seed, layouts=False))
                          if it.source == "hypothesis"]
    first = names(0)
    assert len(first) == 6 and len(set(first)) == 6 and first == names(0) and first != names(1)


def test_fast_tier_leaves_out_large_cases_unless_named():
    spec = get_op("rmsnorm")
    tagged = [c.name for c in spec.get_cases("float32") if "large" in c.tags]
    fast = [it.name for it in items_for(spec, "cpu", "float32", Selection(examples=0))]
    assert not set(tagged) & set(fast)
    if tagged:
        named = items_for(spec, "cpu", "float32", Selection(examples=0, cases=(tagged[0],)))
        assert [it.name for it in named][:1] == [tagged[0]]


def test_cli_exit_codes(tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["conformance", "--op", "rmsnorm", "--dtype", "float32", "--case", "row-1*", "--workers", "0", "-q"]
    assert main([*argv, "--json", str(out), "--no-bad-inputs"]) == 0
    got = {c["case"] for c in json.loads(out.read_text())["cases"]}
    assert {"row-1", "row-127", "row-1@sliced", "row-127@expanded"} <= got
    assert main([*argv[:5], "--case", "no-such-case", "--workers", "0", "-q"]) == 1  # nothing ran
    assert main(["conformance", "--op", "nope", "-q"]) == 2
    assert main(["conformance", "--update-baseline", "-q"]) == 2
    base = tmp_path / "base.json"
    assert main([*argv, "--baseline", str(base), "--update-baseline"]) == 0
    assert "rmsnorm/cpu/float32/row-1" in json.loads(base.read_text())["cases"]
    assert main([*argv, "--baseline", str(base)]) == 0


@pytest.fixture
def ttest():
    """A torch-kind backend `ttest` (kernels get torch tensors, like cuda's): install(fn)."""
    torch = pytest.importorskip("torch")
    spec = get_op("rmsnorm")
    register_backend(Backend(name="ttest", package="opport.conformance", array_kind="torch", device_types=(),
                             dtypes=FLOATS, probe=lambda: None, mode=lambda: "test"))

    def install(fn):
        impl(spec, "ttest", name="ttest.rmsnorm")(fn)

    yield install, torch
    unregister_backend("ttest")  # and its kernels


def test_torch_kernels_get_strided_tensors_and_poisoned_allocations(ttest):
    install, torch = ttest
    seen = {}

    def kernel(x, w, eps, offset):
        seen[tuple(x.stride())] = x.is_contiguous()
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        return (y * w.float()).to(x.dtype) if w is not None else y.to(x.dtype)

    install(kernel)
    report = run(opts(backends=("ttest",), cases=("row-127", "row-127@*"), errors=False))
    assert set(statuses(report).values()) == {"pass"} and len(report.cases) == 5
    assert False in seen.values()  # the layout cases reached the kernel as non-contiguous tensors
    install(lambda x, w, eps, offset: torch.empty_like(x))  # never writes its output
    res = run(opts(backends=("ttest",), cases=("row-127",), errors=False, layouts=False)).cases[0]
    assert res["status"] == "fail" and "special value mismatch" in res["message"]


def test_named_backend_that_cannot_run_skips_and_fails():
    register_backend(Backend(name="absent", package="opport.conformance", array_kind="numpy", device_types=(),
                             dtypes=FLOATS, probe=lambda: "needs hardware that is not here", mode=lambda: "-"))
    try:
        report = run(opts(backends=("absent",)))
    finally:
        unregister_backend("absent")
    assert [(c["id"], c["status"]) for c in report.cases] == [("rmsnorm/absent/n/a/backend-unavailable", "skip")]
    assert "not here" in report.cases[0]["message"] and report.exit_code == 1
    assert rep.to_json(report)["backends"]["absent"]["unavailable"] == "needs hardware that is not here"


def test_progress_prints_a_plain_line_per_backend_and_op(capsys):
    """Not a terminal here (captured): the live bar may not render, the per-op lines must."""
    argv = ["conformance", "--op", "rmsnorm", "--op", "softmax", "--dtype", "float32", "--case", "row-1*",
            "--no-bad-inputs", "--no-layouts", "--workers", "0"]
    assert main(argv) == 0
    lines = [ln.split() for ln in capsys.readouterr().err.splitlines() if "backend x op" in ln]
    ops = [["cpu", "rmsnorm"], ["cpu", "rmsnorm_backward"], ["cpu", "softmax"], ["cpu", "softmax_backward"]]
    assert [ln[2:4] for ln in lines] == ops and lines[-1][-4] == "(4/4"  # each op, then its gradients
    assert lines[0][4] == "pass" and int(lines[0][5]) >= 2  # row-1, row-127, ...


def test_emulated_backends_get_the_tiers_emulated_knobs():
    """Capabilities.emulated() (not a mode string) picks the smaller caps: fewer, smaller cases."""
    spec = get_op("attention")
    host = items_for(spec, "x", "float32", Selection(examples=0, layouts=False))
    emulated = items_for(spec, "x", "float32", Selection(examples=0, layouts=False, emulated=True))
    assert {it.name for it in emulated} < {it.name for it in host}
    register_backend(Backend(name="emu", package="opport.conformance", array_kind="numpy", device_types=(),
                             dtypes=FLOATS, probe=lambda: None, mode=lambda: "anything",
                             capabilities=Capabilities(emulated=lambda: True, max_workers=lambda: 3)))
    try:
        p = plan(opts(backends=("emu",)))
    finally:
        unregister_backend("emu")
    assert p.selections["emu"].emulated and p.limits == {"emu": 3}


def test_workers_respect_every_backends_limit():
    assert default_workers(100, [None, 3]) == min(3, default_workers(100))
    assert default_workers(100, [1]) == 1 and default_workers(1) == 1


def test_smoke_tier_is_a_sample_of_fast():
    spec = get_op("softmax")
    for emulated in (False, True):
        smoke, fast = ({it.name for it in items_for(spec, "x", "float32", Selection(tier, emulated=emulated))}
                       for tier in ("smoke", "fast"))
        fixed = lambda names: {n for n in names if not n.startswith("hyp-") and "@" not in n}
        assert fixed(smoke) and smoke <= fast and len(smoke) < len(fast)  # every case, tests/test_conformance_tiers.py


def test_layout_cases_put_every_array_on_the_views_device():
    """A layout case hands a torch kernel torch tensors only: an array the layout leaves alone (rmsnorm's 1-D
    weight beside a transposed x) moves to the views' device too. Left as NumPy it passed under Triton's
    interpreter (CPU tensors) and was a device mismatch on a real GPU (the H200 run of 2026-12-04)."""
    torch = pytest.importorskip("torch")
    from opport.conformance.cases import LAYOUTS, applies, declared_cases, lay_out
    from opport.ops import all_ops, with_derived

    seen = 0
    for spec in with_derived(all_ops().values()):
        for case in declared_cases(spec, "float32")[:4]:
            for layout in [lay for lay in LAYOUTS if applies(lay, case)]:
                laid = lay_out(case, layout, "cpu")
                arrays = [a for a in (*laid.args, *laid.kwargs.values()) if hasattr(a, "shape")]
                assert all(isinstance(a, torch.Tensor) for a in arrays), (spec.name, case.name, layout)
                seen += len(laid.moved)
    assert seen  # some case left an array alone and it was moved
