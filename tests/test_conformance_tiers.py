"""The tiers nest and cover every layout: `make run` (smoke) can never find what the CI gate (fast) does not run,
and the gate reads every input of every op through each strided layout on every backend (issue 26)."""

import functools
import sys

import numpy as np
import pytest

from opport.conformance import mutants
from opport.conformance.cases import LAYOUTS, Selection, _arg_applies, draw_examples, items_for
from opport.dispatch import get_backend, kernels
from opport.ops import all_ops, get_op, with_derived

SPECS = with_derived(all_ops().values())


def _dtypes(spec, b) -> list:
    """The dtypes the backend runs the op in (as the runner plans them)."""
    return [d for d in spec.dtypes if d in b.dtypes and any(d in k.dtypes for k in kernels(spec, b))]


def _ids(spec, backend, dtype, tier, emulated, examples=0):
    return [it.id for it in items_for(spec, backend, dtype, Selection(tier, examples, 0, emulated=emulated))]


def _tiers(backend: str) -> dict:
    """{(spec, dtype): (smoke items, fast items)} without Hypothesis examples, for every op the backend runs."""
    return _all_tiers()[backend]


def _built(get_cases, dtype, cases, d):
    return iter(cases) if d == dtype else get_cases(d)


@functools.cache
def _all_tiers() -> dict:
    """_tiers of cpu, cuda and neuron, each op's declared cases built once for all six selections."""
    found = {name: {} for name in ("cpu", "cuda", "neuron")}
    for spec in SPECS:
        for dtype in sorted({d for name in found for d in _dtypes(spec, get_backend(name))}):
            cases = tuple(spec.get_cases(dtype))
            spec.get_cases = functools.partial(_built, type(spec).get_cases.__get__(spec), dtype, cases)  # del below
            try:
                for name, tiers in found.items():
                    b = get_backend(name)
                    if kernels(spec, b) and dtype in _dtypes(spec, b):
                        tiers[spec, dtype] = tuple(items_for(spec, name, dtype, Selection(
                            tier, 0, 0, emulated=b.capabilities.emulated())) for tier in ("smoke", "fast"))
            finally:
                del spec.get_cases
    return found


@pytest.mark.parametrize("backend", ["cpu", "cuda", "neuron"])
def test_every_fixed_and_layout_case_smoke_runs_the_gate_runs(backend):
    """Fixed cases and their layout variants, every op (and derived op) and dtype, as each backend selects them."""
    missing = []
    for (spec, dtype), (smoke, fast) in _tiers(backend).items():
        assert smoke, f"{spec.name}/{dtype}: smoke runs nothing"
        ran = {it.id for it in fast}
        missing += [it.id for it in smoke if it.id not in ran]
    assert missing == []


@pytest.mark.parametrize("op", ["matmul", "cross_entropy_backward", "attention", "layernorm_backward"])
@pytest.mark.parametrize("emulated", [False, True])
def test_smoke_hypothesis_examples_are_among_the_gates(op, emulated):
    spec = get_op(op)
    for dtype in ("float32", "bfloat16"):
        smoke = [i for i in _ids(spec, "cpu", dtype, "smoke", emulated, None) if "/hyp-" in i]
        fast = set(_ids(spec, "cpu", dtype, "fast", emulated, None))
        assert smoke and set(smoke) <= fast


@pytest.mark.parametrize("op", ["rmsnorm", "rmsnorm_backward"])
def test_a_draw_over_the_cap_stops_before_its_arrays_and_keeps_the_others_names(op, monkeypatch):
    """The cap applied during a draw keeps the draws (and names, repeats included) the cap applied after it keeps,
    and never makes an array past it."""
    from opport import casegen
    from opport.conformance.cases import elements

    strategy, cap = get_op(op).get_strategy("float32"), 1 << 12
    after = [c for c in draw_examples(strategy, 60, 0) if elements(c) <= cap]
    made, array = [], casegen.array

    def spy(shape, *a, **k):
        out = array(shape, *a, **k)
        made.append(out.size)
        return out

    monkeypatch.setattr(casegen, "array", spy)
    during = draw_examples(strategy, 60, 0, keep=lambda c: elements(c) <= cap, budget=cap)
    assert [c.name for c in during] == [c.name for c in after] and len(after) >= 10
    assert made and max(made) <= cap
    assert any("~" in c.name for c in after) or op == "rmsnorm_backward"  # a repeated seed, renamed in both


def test_example_i_does_not_depend_on_how_many_are_drawn():
    strategy = get_op("softmax").get_strategy("float32")
    few, many = draw_examples(strategy, 5, 0), draw_examples(strategy, 40, 0)
    assert [c.name for c in few] == [c.name for c in many[:5]]
    for a, b in zip(few, many):
        assert all(np.array_equal(x, y, equal_nan=True) for x, y in zip(a.args, b.args) if isinstance(x, np.ndarray))
    assert draw_examples(strategy, 5, 1)[1].name != few[1].name  # the seed matters


def test_draws_do_not_depend_on_which_modules_are_imported(tmp_path, monkeypatch):
    """Hypothesis mixes constants of the importing code's modules into its draws; the gate's draws must not move
    when a module full of constants is imported (they did: CI and a laptop drew different examples)."""
    strategy = get_op("matmul").get_strategy("float32")
    before = draw_examples(strategy, 30, 0)
    (tmp_path / "lots_of_constants.py").write_text(
        "X = [" + ", ".join(str(v) for v in [3.25, -7.5, 1e30, 65504.0, 12345, -999, 0.1, 2**40]) + "]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import lots_of_constants  # noqa: F401

    try:
        after = draw_examples(strategy, 30, 0)
    finally:
        sys.modules.pop("lots_of_constants", None)
    assert [c.name for c in before] == [c.name for c in after]
    for a, b in zip(before, after):
        assert all(np.array_equal(x, y, equal_nan=True) for x, y in zip(a.args, b.args) if isinstance(x, np.ndarray))


@pytest.mark.parametrize("backend", ["cpu", "cuda", "neuron"])
def test_the_gate_runs_every_layout_on_every_strided_argument(backend):
    """For every op, dtype and array argument that some declared case can give a layout, the fast tier runs that
    layout on that argument at least once (among cases the backend's kernels take)."""
    gaps = []
    for (spec, dtype), (_, items) in _tiers(backend).items():
        fixed = [it.case for it in items if it.source == "fixed"]
        ran = {(it.layout, pos) for it in items if it.source == "layout"
               for pos, a in enumerate(spec.bind(*it.case.args, **it.case.kwargs))
               if isinstance(a, np.ndarray) and _arg_applies(it.layout, a)}
        for c in fixed:
            for pos, a in enumerate(spec.bind(*c.args, **c.kwargs)):
                for lay in LAYOUTS:
                    if (isinstance(a, np.ndarray) and a.size and _arg_applies(lay, a) and (lay, pos) not in ran
                            and not (spec.writes and lay == "expanded")):
                        gaps.append(f"{spec.name}/{dtype}: {spec.params[pos]}@{lay}")
    assert sorted(set(gaps)) == []


@pytest.mark.parametrize("backend", ["cpu", "cuda", "neuron"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_a_kernel_reading_any_input_with_contiguous_strides_is_caught(spec, backend):
    """The bug class of cuda cross_entropy_backward's sliced lse (NaN gradients): for every op, every kernel of the
    backend with one argument read as row-major from its data pointer fails a fast-tier case."""
    if not kernels(spec, get_backend(backend)):
        pytest.skip(f"no {backend} kernel for {spec.name}")
    kills = mutants.stride_kills(spec, backend)
    assert [arg for arg, case in kills.items() if case is None] == []


def test_the_stride_mutant_is_caught_on_a_strided_saved_statistic():
    """The mutant that made cuda cross_entropy_backward return NaN: lse read as contiguous."""
    kills = mutants.stride_kills(get_op("cross_entropy_backward"), "cpu")
    assert kills["lse"] and kills["lse"].endswith("@sliced")
    assert mutants.stride_kills(get_op("matmul_backward"), "cpu")["bias"] == mutants.UNREAD  # dbias needs no bias values


def test_covered_by_judges_the_smoke_tier_from_the_gates_report(tmp_path):
    """`make test`'s last step: smoke's cases judged from the fast run's report; one the report lacks is an error."""
    import json

    from opport.conformance.report import write_json
    from opport.conformance.runner import Options, covered, run

    fast = run(Options(backends=("cpu",), ops=("silu",), dtypes=("float32",), tier="fast", workers=0))
    path = tmp_path / "gate.json"
    write_json(fast, path)
    smoke = Options(backends=("cpu",), ops=("silu",), dtypes=("float32",), tier="smoke")
    judged = run(smoke, execute=covered(str(path)))
    assert judged.exit_code == 0 and judged.summary["pass"] > 10
    data = json.loads(path.read_text())
    data["cases"] = [c for c in data["cases"] if "@" not in c["id"]]  # a gate that ran no layouts
    path.write_text(json.dumps(data))
    judged = run(smoke, execute=covered(str(path)))
    lacking = [c for c in judged.cases if c["status"] == "error"]
    assert judged.exit_code == 1 and lacking and all("@" in c["id"] and "not run by" in c["message"] for c in lacking)
