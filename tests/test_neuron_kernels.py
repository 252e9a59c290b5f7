"""The neuron backend's NKI kernels, run in the active nki_compat mode (opport's emulator where no SDK is installed).

Every op's fixed conformance cases go through `spec(..., backend="neuron")` under `opport.strict()` (so a
cpu fallback cannot pass) and are judged against the float64 reference by the conformance comparator
(dtype and shape first, NaN/inf positions exactly, then the op's tolerance for the dtype). The emulator
runs in its strict mode here, so a kernel whose live SBUF/PSUM tiles exceed the target's capacity fails.
"""

from __future__ import annotations

import ast
import contextlib
import fnmatch
import importlib
from pathlib import Path

import numpy as np
import pytest

import opport
from opport import accuracy as cmp
from opport.backends.neuron import nki_compat
from opport.conformance import cases, gate
from opport.dispatch.adapters import metas_of
from opport.dispatch.registry import get_backend, kernels
from opport.dtypes import acc_dtype
from opport.ops import all_ops, get_op
from opport.public import function
from opport.spec import Meta

# the ops whose fixed cases run here with SBUF/PSUM capacity checked; the serving ops' and fp8 ops' run in tests/ops
OPS = ("softmax", "rmsnorm", "add_rmsnorm", "layernorm", "gelu", "silu", "swiglu", "rope", "matmul", "attention",
       "cross_entropy")
DTYPES = ("float32", "float16", "bfloat16")
KERNEL_DIR = Path(nki_compat.__file__).parent


def _neuron_kernels() -> dict:
    """Every op and derived op with a neuron kernel -> that kernel, from the registry (which imports the kernel
    files): the kernel-file checks below cover a new op's files without a list to edit."""
    b = get_backend("neuron")
    return {s: ks[0] for spec in all_ops().values() for s in spec.family() if (ks := kernels(s, b))}


# the files that register neuron kernels (<op>.py, <op>_backward.py), and those plus the private modules of the
# folder: the helpers the kernels share (_tiles, _softmax_steps, _two_float, _loss_rows, _host, ...)
NEURON_KERNELS = _neuron_kernels()
KERNEL_FILES = sorted({k.fn.__module__.rsplit(".", 1)[1] for k in NEURON_KERNELS.values()
                       if k.fn.__module__.startswith("opport.backends.neuron.")})
MODULES = KERNEL_FILES + sorted(p.stem for p in KERNEL_DIR.glob("_*.py") if p.stem != "__init__")
DOC_SECTIONS = ("Dimensions:", "Args:", "Returns:", "Notes:", "Pseudocode:")
rng = np.random.default_rng(0)


@contextlib.contextmanager
def capacity_checked():
    """Over-subscribed SBUF/PSUM is an error (the emulator only warns by default); a no-op on the real SDK."""
    if nki_compat.EMULATED:
        with nki_compat.nki.strict():
            yield
    else:
        yield


def known_failures() -> list:
    return gate.load_known(gate.known_failures_path(get_backend("neuron")))


GATE = cases.Selection("fast", emulated=True)  # what the CI gate runs on the emulated neuron backend


def in_the_gate(case) -> bool:
    """The gate runs this fixed case on neuron with SBUF/PSUM capacity checked (Capabilities.checked): judged
    there, so the fixed-case tests below run only the cases the gate leaves out (larger than its emulated cap,
    or tagged large/slow), the multi-tile shapes."""
    return cases.elements(case) <= GATE.knob("case_max") and not set(case.tags) & set(GATE.knob("skip_tags"))


def declined(spec, case, dtype: str) -> str | None:
    """Why the neuron kernel's supports() declines the case (conformance counts it as skipped), else None."""
    (kernel,) = kernels(spec, get_backend("neuron"))
    return kernel.check(dtype, metas_of(spec, spec.bind(*case.args, **case.kwargs)))


def judge(spec, case, dtype: str) -> str | None:
    """None if the neuron kernel's output matches the reference for this case, else why not."""
    __tracebackhide__ = True
    with opport.strict(), capacity_checked():
        outs = function(spec)(*case.args, backend="neuron", **case.kwargs)
    refs = spec.run_reference(*case.args, **case.kwargs)
    out_dtype = spec.out_dtype(metas_of(spec, spec.bind(*case.args, **case.kwargs)))
    several = isinstance(refs, tuple)  # add_rmsnorm: each output against its own tolerance
    for i, (out, ref) in enumerate(zip(outs, refs) if several else [(outs, refs)]):
        ref = np.asarray(ref)
        why = cmp.contract(np.asarray(out), ref, out_dtype)
        if why:
            return why
        verdict = cmp.compare(out, ref, spec.tolerance_for(dtype, i, case), out_dtype)
        if not verdict.ok:
            return (f"output {spec.output_names[i]}: " if several else "") + verdict.message
    return None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", OPS)
def test_fixed_cases(name, dtype):
    spec = get_op(name)
    known = [k for k in known_failures() if k.pattern.startswith(f"{name}/neuron/")]
    problems = []
    for case in spec.get_cases(dtype):
        if in_the_gate(case) or declined(spec, case, dtype):
            continue
        case_id = f"{name}/neuron/{dtype}/{case.name}"
        listed = [k for k in known if fnmatch.fnmatchcase(case_id, k.pattern)]
        why = judge(spec, case, dtype)
        if why and not listed:
            problems.append(f"{case_id}: {why}")
        elif not why and listed:
            problems.append(f"{case_id}: passes but is listed in known_failures.txt ({listed[0].reason})")
    assert not problems, "\n".join(problems)


def test_the_gate_checks_capacity_on_the_emulator():
    """Conformance runs neuron's cases with over-subscribed SBUF/PSUM as an error (what the fixed-case tests below
    leave to it)."""
    from opport.backends.neuron.emulator import runtime

    if not nki_compat.EMULATED:
        pytest.skip("the real SDK's compiler checks capacity itself")
    assert not runtime.strict_enabled()
    with get_backend("neuron").capabilities.checked():
        assert runtime.strict_enabled()


def test_every_op_has_a_neuron_kernel_for_the_nki_dtypes():
    b = get_backend("neuron")
    for name in OPS:
        ks = kernels(get_op(name), b)
        assert [k.name for k in ks] == [f"neuron.{name}"], name
        assert ks[0].dtypes == ("float32", "float16", "bfloat16"), name


@pytest.mark.parametrize("target", ["trn1", "trn3"])
def test_other_generations(target):
    """One case per op on NeuronCore-v2 and -v4 (the fixed cases above run on the default, trn2)."""
    if not nki_compat.EMULATED:
        pytest.skip("target selection is an emulator feature")
    firsts = {name: next(iter(get_op(name).get_cases("bfloat16"))) for name in OPS}
    with nki_compat.nki.use_target(target):
        bad = {name: why for name, case in firsts.items() if (why := judge(get_op(name), case, "bfloat16"))}
    assert not bad


def test_strided_inputs_match_contiguous_copies():
    """The host wrappers copy strided views to contiguous HBM buffers; results are bitwise the same."""
    x = rng.standard_normal((64, 200)).astype(np.float32)
    cases = [
        ("softmax", (x.T,), {"axis": 0}),
        ("rmsnorm", (x[::2, ::3], x[0, ::3].copy()), {}),
        ("add_rmsnorm", (x[::2, ::3], x[1::2, ::3], x[0, ::3].copy()), {}),
        ("layernorm", (x[:, ::-1], None, None), {}),
        ("silu", (x.T,), {}),
        ("matmul", (x.T[:100], x[:, :50]), {}),
        ("rope", (x.reshape(2, 4, 8, 200)[..., ::2], *np.split(x[:8, :100], 2, axis=1)), {}),
    ]
    for name, args, kwargs in cases:
        spec = get_op(name)
        with opport.strict():
            strided = function(spec)(*args, backend="neuron", **kwargs)
            dense = function(spec)(*[np.ascontiguousarray(a) if isinstance(a, np.ndarray) else a for a in args],
                         backend="neuron", **kwargs)
        pairs = zip(strided, dense) if isinstance(strided, tuple) else [(strided, dense)]
        assert all(s.tobytes() == d.tobytes() for s, d in pairs), name


@pytest.mark.parametrize("q_d, v_d, why", [(256, 64, "head dim 256 > 128"), (64, 1024, "value dim 1024 > 512")])
def test_attention_declines_what_one_tile_cannot_hold(q_d, v_d, why):
    q = np.zeros((1, 1, 4, q_d), np.float32)
    k, v = np.zeros((1, 1, 4, q_d), np.float32), np.zeros((1, 1, 4, v_d), np.float32)
    with opport.strict():
        with pytest.raises(opport.UnsupportedError, match=why):
            opport.attention(q, k, v, backend="neuron")
        d = opport.explain("attention", q, k, v, backend="neuron")
    assert d.kernel is None and why in d.error


def test_cross_entropy_declines_vocabularies_beyond_float32_integers():
    spec = get_op("cross_entropy")
    (kernel,) = kernels(spec, get_backend("neuron"))
    logits = Meta("numpy", "float32", (2, 2**24 + 1), None, "cpu")
    target = Meta("numpy", "int64", (2,), None, "cpu")
    assert "2^24" in kernel.check("float32", (logits, target, -100, "mean", 0.0))
    assert "2^24" in kernel.check("float32", (Meta("numpy", "float32", (2, 10), None, "cpu"), target, -2**25, "mean", 0.0))
    assert kernel.check("float32", (Meta("numpy", "float32", (2, 10), None, "cpu"), target, -100, "mean", 0.0)) is None


def test_attention_nonfinite_v_under_the_causal_mask_never_leaks():
    """inf/NaN in v at keys a row may not see: the kernel cuts each row's keys exactly (one-row query tiles)."""
    q, k = rng.standard_normal((2, 1, 2, 300, 16)).astype(np.float32)
    v = rng.standard_normal((1, 2, 300, 16)).astype(np.float32)
    v[:, :, 200:, :3] = np.inf
    v[:, :, 250:, 5] = np.nan
    with opport.strict():
        out = opport.attention(q, k, v, causal=True, backend="neuron")
    ref = get_op("attention").run_reference(q, k, v, True, None)
    assert np.isfinite(out[:, :, :200]).all()
    assert np.array_equal(np.isnan(out), np.isnan(ref)) and np.array_equal(np.isinf(out), np.isinf(ref))


# --------------------------------------------------------------------------- DMA traffic


def _traffic(name, *args, **kwargs):
    spec = get_op(name)
    with nki_compat.collect_stats() as stats, opport.strict():
        function(spec)(*args, backend="neuron", **kwargs)
    return stats, spec.get_cost(*metas_of(spec, spec.bind(*args, **kwargs))).bytes


def test_dma_bytes_against_the_minimum(capsys):
    """The emulator's HBM byte counts against each op's minimum bytes (read inputs and write outputs once)."""
    if not nki_compat.EMULATED:
        pytest.skip("DMA counters are collected by the emulator")
    import ml_dtypes

    # softmax, rows that fit SBUF: read once, written once -> exactly the minimum
    x = rng.standard_normal((300, 4096)).astype(ml_dtypes.bfloat16)
    s, least = _traffic("softmax", x)
    assert s.hbm_read_bytes == x.nbytes and s.hbm_write_bytes == x.nbytes and s.hbm_bytes == least

    # rmsnorm: x once, out once, the weight once (replicated across the partitions on TensorE, not by DMA)
    w = rng.standard_normal(4096).astype(ml_dtypes.bfloat16)
    r, least_r = _traffic("rmsnorm", x, w)
    assert r.hbm_read_bytes == x.nbytes + w.nbytes and r.hbm_write_bytes == x.nbytes and r.hbm_bytes == least_r

    # add_rmsnorm: x and the residual once, normed and the sum once each, the weight once
    a, least_a = _traffic("add_rmsnorm", x, x[::-1].copy(), w)
    assert a.hbm_read_bytes == 2 * x.nbytes + w.nbytes and a.hbm_write_bytes == 2 * x.nbytes and a.hbm_bytes == least_a

    # matmul: b (and the bias) read once per block of rows_per_block 128-row tiles of a: 300 rows are one
    # block (3 tiles), so every byte is read once; 1000 rows at ACC_BANKS = 6 tiles per block are two blocks
    from opport.backends.neuron.matmul import ACC_BANKS, TILE_M, rows_per_block

    a, b, c = (rng.standard_normal(s_).astype(np.float32) for s_ in ((300, 256), (256, 384), (384,)))
    m, least_m = _traffic("matmul", a, b, c)
    assert m.hbm_read_bytes == a.nbytes + b.nbytes + c.nbytes and m.hbm_write_bytes == 300 * 384 * 4
    assert m.hbm_bytes == least_m and m.peak_psum_bytes <= (ACC_BANKS + 1) * 2048
    a2 = rng.standard_normal((1000, 256)).astype(np.float32)
    assert rows_per_block(256, 4) == ACC_BANKS and -(-1000 // (ACC_BANKS * TILE_M)) == 2
    m2, _ = _traffic("matmul", a2, b, c)
    assert m2.hbm_read_bytes == a2.nbytes + 2 * (b.nbytes + c.nbytes)
    with capsys.disabled():
        for name, st, low in (("softmax", s, least), ("rmsnorm", r, least_r), ("matmul", m, least_m)):
            print(f"\n  {name}: DMA {st.hbm_bytes} B from/to HBM vs minimum {low} B ({st.hbm_bytes / low:.3f}x), "
                  f"{st.dma_transfers} transfers, instructions {st.instructions}", end="")


# --------------------------------------------------------------------------- the kernel files themselves


def _jitted(tree) -> list:
    return [n for n in tree.body if isinstance(n, ast.FunctionDef) and any(ast.unparse(d) == "nki.jit"
                                                                          for d in n.decorator_list)]


def _template_docstring(fn) -> bool:
    doc = ast.get_docstring(fn) or ""
    positions = [doc.find(s) for s in DOC_SECTIONS]
    return all(p > 0 for p in positions) and positions == sorted(positions)


def test_kernel_files_are_derived():
    """The lists below come from the registry and the folder: every op's kernel files, then the shared helpers."""
    assert {"softmax", "attention", "attention_backward", "scaled_matmul", "varlen_attention"} <= set(KERNEL_FILES)
    assert {"_host", "_tiles", "_softmax_steps", "_two_float", "_loss_rows"} <= set(MODULES) - set(KERNEL_FILES)
    assert not {"nki_compat", "bench", "__init__"} & set(MODULES)  # the backend's plumbing, not kernel code


@pytest.mark.parametrize("name", KERNEL_FILES)
def test_kernel_file_layout(name):
    """docs/style.md 7/8: private @nki.jit kernels `_<file>..._kernel` with the template docstring, a public wrapper
    named like the file, and imports only through nki_compat (no emulator internals, so the same source runs on the
    SDK). A file without kernels of its own (varlen_attention) launches a sibling file's."""
    tree = ast.parse((KERNEL_DIR / f"{name}.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any("emulator" in m for m in imported), imported
    assert not any(m == "nki" or m.startswith("nki.") for m in imported), imported
    jitted = _jitted(tree)
    if jitted:
        assert "opport.backends.neuron.nki_compat" in imported
    else:
        assert any(m.rsplit(".", 1)[1] in KERNEL_FILES for m in imported if m.startswith("opport.backends.neuron."))
    for fn in jitted:
        assert fn.name.startswith(f"_{name}") and fn.name.endswith("_kernel"), fn.name
        assert _template_docstring(fn), fn.name
    assert callable(getattr(importlib.import_module(f"opport.backends.neuron.{name}"), name))


def test_each_derived_op_has_its_kernel():
    """docs/style.md 7: a training forward, backward or fused op's neuron kernel is `_<its name>_kernel`, in the file
    that registers it. A file without kernels of its own (varlen_attention's, which launches attention's per
    sequence; test_kernel_file_layout checks it imports its sibling) is the one exception."""
    missing = []
    for spec, kernel in NEURON_KERNELS.items():
        if spec.name in all_ops():
            continue
        tree = ast.parse(Path(importlib.import_module(kernel.fn.__module__).__file__).read_text())
        jitted = {fn.name for fn in _jitted(tree)}
        if jitted and f"_{spec.name}_kernel" not in jitted:
            missing.append(f"{kernel.fn.__module__}: _{spec.name}_kernel")
    assert not missing, missing


def test_buffers_are_named_by_memory_space():
    """docs/style.md 8: every on-chip allocation is bound to a name ending in _sb or _psum, HBM tensors in _hbm."""
    bad = []
    for name in MODULES:
        tree = ast.parse((KERNEL_DIR / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "nl.ndarray":
                buf = next((ast.unparse(k.value) for k in node.value.keywords if k.arg == "buffer"), "nl.sbuf")
                suffix = {"nl.sbuf": "_sb", "nl.psum": "_psum", "nl.shared_hbm": "_hbm"}[buf]
                target = ast.unparse(node.targets[0])
                if not target.endswith(suffix):
                    bad.append(f"{name}.py:{node.lineno}: {target} in {buf}")
    assert not bad, bad


def test_constants_say_why():
    """Every module-level constant of a kernel file or shared helper carries a one-line reason (docs/style.md 8)."""
    missing = []
    for name in MODULES:
        lines = (KERNEL_DIR / f"{name}.py").read_text().splitlines()
        for i, line in enumerate(lines):
            if line and line[0].isupper() and " = " in line:
                if "#" not in line and not (i and lines[i - 1].lstrip().startswith("#")):
                    missing.append(f"{name}.py:{i + 1}: {line}")
    assert not missing, missing


# --------------------------------------------------------------------------- training kernels: rope, matmul,
# cross_entropy, attention (their training forwards and backwards; issue 17 part 1)

# TRAINED: every op with a neuron backward kernel but NORM_ACT_BACKWARD's, whose backwards have tests of their own
# further down (norms, softmax, activations)
NORM_ACT_BACKWARD = ("softmax", "rmsnorm", "layernorm", "gelu", "silu", "swiglu")
TRAINED = tuple(name for name, spec in all_ops().items()
                if spec.backward_op in NEURON_KERNELS and name not in NORM_ACT_BACKWARD)


def _derived(name: str) -> list:
    """The op's derived specs with neuron kernels: its training forward (if it saves statistics), its backward and
    its fused value-and-grad where neuron has one (cross_entropy's; linear_cross_entropy's is cpu's only: autograd
    takes a value-and-grad only where the backend has it, never through a fallback, so neuron trains without it)."""
    spec = get_op(name)
    vag = spec.value_and_grad_op
    vag = vag if vag is not None and kernels(vag, get_backend("neuron")) else None
    return [s for s in (spec.train_forward, spec.backward_op, vag) if s is not None]


def _judge_outputs(spec, case, dtype: str) -> list:
    """Each output of a derived op (training forward or backward) on neuron against the float64 reference,
    capacity-checked, with the conformance suite's per-output tolerance; the problems found."""

    with opport.strict(), capacity_checked():
        outs = _on_neuron(spec, case.args, case.kwargs)
    refs = spec.run_reference(*case.args, **case.kwargs)
    bound = spec.bind(*case.args, **case.kwargs)
    metas = spec.out_metas(metas_of(spec, bound))
    # the declared sum |terms| (docs/numerics.md 3.10), as the conformance comparator allows it
    mags = spec.get_magnitude(tuple(a.astype(np.float64) if isinstance(a, np.ndarray) and a.dtype.kind in "fV" else a
                                    for a in bound)) or ()
    problems = []
    for i, (out, ref, meta) in enumerate(zip(outs, refs, metas)):
        if meta is None:
            continue
        ref = np.asarray(ref)
        why = cmp.contract(np.asarray(out), ref, meta[1])
        cancel = cmp.sum_allowance(mags[i], acc_dtype(dtype).name) if i < len(mags) else None
        verdict = None if why else cmp.compare(out, ref, spec.tolerance_for(dtype, i, case), meta[1], cancel=cancel)
        if why or not verdict.ok:
            problems.append(f"{spec.name}/{dtype}/{case.name} output {i}: {why or verdict.message}")
    return problems


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", TRAINED)
def test_training_kernels_fixed_cases(name, dtype):
    """Every fixed case of the training forward and the backward, on the neuron kernels with SBUF/PSUM capacity
    enforced (conformance runs them without): a kernel over capacity or off the reference fails here."""
    problems = []
    for spec in _derived(name):
        for case in spec.get_cases(dtype):
            if not in_the_gate(case) and not declined(spec, case, dtype):
                problems += _judge_outputs(spec, case, dtype)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("target", ["trn1", "trn3"])
def test_training_kernels_other_generations(target):
    """The first bfloat16 case of each training forward and backward on NeuronCore-v2 and -v4 (the fixed cases
    above run on the default, trn2)."""
    if not nki_compat.EMULATED:
        pytest.skip("target selection is an emulator feature")
    problems = []
    with nki_compat.nki.use_target(target):
        for name in TRAINED:
            for spec in _derived(name):
                problems += _judge_outputs(spec, next(iter(spec.get_cases("bfloat16"))), "bfloat16")
    assert not problems, "\n".join(problems)


def test_training_kernels_are_neuron_kernels():
    """The trained ops' training forwards and backwards have neuron kernels for the NKI dtypes (no cpu fallback)."""
    backend = get_backend("neuron")
    for name in TRAINED:
        for spec in _derived(name):
            found = kernels(spec, backend)
            assert found and set(DTYPES) <= set(found[0].dtypes), (spec.name, found)


def _on_neuron(spec, args: tuple, kwargs: dict | None = None):
    """A derived op's outputs from its neuron kernel, called as autograd calls it (through the dispatcher)."""
    from opport.dispatch import call

    return call(spec, spec.bind(*args, **(kwargs or {})), "neuron")


def _backward_case(name: str, case_name: str, dtype: str = "float32"):
    return next(c for c in get_op(name).backward_op.get_cases(dtype) if c.name == case_name)


@pytest.mark.parametrize("name, module, knobs", [
    ("attention", "attention_backward", ("BWD_KEYS_RESIDENT", "BWD_ROWS_RESIDENT")),
    ("matmul", "matmul", ("ROWS_BUDGET",))])
def test_streamed_backward_matches_resident(name, module, knobs, monkeypatch):
    """With the SBUF residency budgets at 0 the backward kernels re-read their inputs where they use them
    (the path for shapes too large to keep): the same gradients as the resident path, bit for bit."""
    mod = importlib.import_module(f"opport.backends.neuron.{module}")
    names = {"attention": ("gqa-8-2-causal", "dead-rows-nonfinite", "one-key-large-v", "strided-grad",
                           "window-chunked-prefill", "window-nan-outside", "softcap-noncausal-gqa"),
             "matmul": ("zero-grad", "strided-grad")}[name]
    spec = get_op(name).backward_op
    for case_name in names:
        case = _backward_case(name, case_name, "bfloat16")
        with opport.strict():
            resident = _on_neuron(spec, case.args, case.kwargs)
            for knob in knobs:
                monkeypatch.setattr(mod, knob, 0)
            streamed = _on_neuron(spec, case.args, case.kwargs)
            monkeypatch.undo()
        for r, s in zip(resident, streamed):
            assert (r is None and s is None) or np.array_equal(np.asarray(r), np.asarray(s), equal_nan=True), case_name


def test_attention_backward_one_visible_key_is_exactly_zero():
    """dq and dk are exactly 0 where every row sees one key (P = 1, O = v): D is formed as dP[:, key 0] +
    rowsum(dO (O - v_0)), so dP - D cancels exactly; two float32 dot products of |dO| |v| ~ 4e4 would leave
    ~1e-3 there, 100x the norm-wise bound of a zero reference."""
    spec = get_op("attention").backward_op
    case = _backward_case("attention", "one-key-large-v")
    dq, dk, _ = _on_neuron(spec, case.args, case.kwargs)
    assert not np.asarray(dq).any() and not np.asarray(dk).any()


def test_attention_declines_only_what_one_tile_cannot_hold():
    """The soft cap and window cases run on the NKI kernels: of attention's cases (forward, training forward,
    backward) exactly those with head dim > 128 (Gemma 2's 256) are declined."""
    for spec in (get_op("attention"), *_derived("attention")):
        for case in spec.get_cases("float32"):
            q = case.args[1] if spec is get_op("attention").backward_op else case.args[0]
            assert bool(declined(spec, case, "float32")) == (np.asarray(q).shape[3] > 128), (spec.name, case.name)

def test_attention_window_one_backward_is_exactly_zero():
    """Window 1 (every live row sees only its diagonal key, key 0 outside most windows): D is taken from dP at
    the row's diagonal key (the same TensorE value _block forms), so dq and dk are exactly 0, not eps |dO| |v|."""
    spec = get_op("attention").backward_op
    q = rng.standard_normal((1, 2, 140, 16)).astype(np.float32)
    k = rng.standard_normal((1, 1, 140, 16)).astype(np.float32)
    v = (rng.standard_normal((1, 1, 140, 16)) * 1e4).astype(np.float32)
    grad = rng.standard_normal((1, 2, 140, 16)).astype(np.float32)
    with opport.strict():
        out, lse = _on_neuron(get_op("attention").train_forward, (q, k, v, True, None), {"sliding_window": 1})
        dq, dk, dv = _on_neuron(spec, (grad, q, k, v, out, lse, True, None), {"sliding_window": 1})
    assert not np.asarray(dq).any() and not np.asarray(dk).any()
    assert np.allclose(np.asarray(dv)[0, 0], grad[0].sum(0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["resident", "streamed"])
def test_attention_window_skips_key_tiles_no_row_sees(mode, monkeypatch):
    """A window keeps the forward (512-key tiles) and the backward (128-key blocks) from reading keys no query
    row sees: decode with W = 64 over 1000 keys reads keys 512.. (forward, resident; 936.. streamed) and 896..
    (backward) only; the unseen keys' dk and dv are written 0."""
    if not nki_compat.EMULATED:
        pytest.skip("DMA counters are collected by the emulator")
    if mode == "streamed":
        for module, knob in (("attention", "KV_RESIDENT"), ("attention_backward", "BWD_KEYS_RESIDENT"),
                             ("attention_backward", "BWD_ROWS_RESIDENT")):
            monkeypatch.setattr(importlib.import_module(f"opport.backends.neuron.{module}"), knob, 0)
    q = rng.standard_normal((1, 2, 1, 32)).astype(np.float32)
    k, v = rng.standard_normal((2, 1, 1, 1000, 32)).astype(np.float32)
    grad = rng.standard_normal((1, 2, 1, 32)).astype(np.float32)
    with nki_compat.collect_stats() as fwd, opport.strict():
        out, lse = _on_neuron(get_op("attention").train_forward, (q, k, v, True, None), {"sliding_window": 64})
    # q read, out and lse written, k and v of keys 512..999 read once (streamed: keys 936.. per query head)
    keys_fwd = 488 if mode == "resident" else 2 * 64
    assert fwd.hbm_bytes == 4 * (2 * 32 + 2 * keys_fwd * 32 + 2 * 32 + 2), fwd.hbm_bytes
    reads = {}
    for w in (None, 64):
        with nki_compat.collect_stats() as bwd, opport.strict():
            dq, dk, dv = _on_neuron(get_op("attention").backward_op, (grad, q, k, v, out, lse, True, None),
                                    {"sliding_window": w})
        reads[w] = bwd.hbm_read_bytes
    if mode == "resident":  # k, v of keys 896..999; q, dO, O and each row's diagonal v row; lse
        assert reads[64] == 4 * (2 * 104 * 32 + 4 * 2 * 32 + 2), reads
    else:
        assert reads[64] < reads[None] / 4, reads
    assert not np.asarray(dk)[:, :, :936].any() and not np.asarray(dv)[:, :, :936].any()
    ref = get_op("attention").backward_op.run_reference(grad, q, k, v, out, lse, True, None, sliding_window=64)
    for got, want in zip((dq, dk, dv), ref):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_attention_window_nonfinite_v_outside_it_never_leaks():
    """inf/NaN in v before a row's window (and after its diagonal): the forward's one-row tiles start each row's
    keys at its window, so masked keys never meet p = 0 in P @ V; in the backward, NaN k before a row's window
    and a NaN q row reach no gradient of a key outside the windows that see them."""
    q, k = rng.standard_normal((2, 1, 2, 300, 16)).astype(np.float32)
    v = rng.standard_normal((1, 2, 300, 16)).astype(np.float32)
    v[:, :, 10:20, :3] = np.inf
    v[:, :, 250:, 5] = np.nan
    with opport.strict():
        out = opport.attention(q, k, v, causal=True, sliding_window=40, softcap=5.0, backend="neuron")
    ref = get_op("attention").run_reference(q, k, v, True, None, 5.0, 40)
    assert np.isfinite(out[:, :, 60:250]).all()
    assert np.array_equal(np.isnan(out), np.isnan(ref)) and np.array_equal(np.isinf(out), np.isinf(ref))
    fin = np.isfinite(ref)
    assert np.allclose(out[fin], ref[fin], rtol=1e-5, atol=1e-5)
    spec = get_op("attention").backward_op
    v = rng.standard_normal((1, 2, 300, 16)).astype(np.float32)
    k[:, :, 5, 2] = np.nan  # seen by rows 5..44
    q[:, :, 150, 1] = np.nan  # sees keys 111..150
    fwd = get_op("attention").train_forward.run_reference(q, k, v, True, None, 5.0, 40)
    out, lse = (np.asarray(a, np.float32) for a in fwd)
    grad = rng.standard_normal(out.shape).astype(np.float32)
    with opport.strict():
        got = _on_neuron(spec, (grad, q, k, v, out, lse, True, None), {"softcap": 5.0, "sliding_window": 40})
    for g, r in zip(got, spec.run_reference(grad, q, k, v, out, lse, True, None, 5.0, 40)):
        g, r = np.asarray(g), np.asarray(r)
        assert np.array_equal(np.isnan(g), np.isnan(r))
        fin = np.isfinite(r)
        assert np.allclose(g[fin], r[fin], rtol=1e-4, atol=1e-5)


def test_training_kernels_move_the_minimum_bytes(capsys):
    """The backward kernels read each input once and write each output once on shapes whose working set fits
    SBUF (the bench rows of docs/performance.md): HBM bytes == the backward's cost model minimum."""
    if not nki_compat.EMULATED:
        pytest.skip("DMA counters are collected by the emulator")
    f32 = np.float32
    g = rng.standard_normal
    problems = {
        "rope": (g((2, 4, 64, 64)).astype(f32), g((64, 32)).astype(f32), g((64, 32)).astype(f32), False),
        "matmul": (g((300, 384)).astype(f32), g((300, 256)).astype(f32), g((256, 384)).astype(f32),
                   g(384).astype(f32)),
        "cross_entropy": (np.ones((), f32), g((200, 1000)).astype(f32), rng.integers(0, 1000, 200), g(200).astype(f32),
                          -100, "mean", 0.1),
        "attention": (g((1, 4, 200, 32)).astype(f32), g((1, 4, 200, 32)).astype(f32), g((1, 2, 150, 32)).astype(f32),
                      g((1, 2, 150, 32)).astype(f32), g((1, 4, 200, 32)).astype(f32), g((1, 4, 200)).astype(f32), True,
                      None),
    }
    lines = []
    for name, args in problems.items():
        spec = get_op(name).backward_op
        with nki_compat.collect_stats() as st, opport.strict():
            _on_neuron(spec, args)
        least = spec.get_cost(*metas_of(spec, spec.bind(*args))).bytes
        if name == "cross_entropy":  # targets travel as int32, the cost model counts the caller's int64
            least -= 4 * args[2].size
        assert st.hbm_bytes == least, (name, st.hbm_bytes, least)
        lines.append(f"{name}_backward: {st.hbm_bytes} B = minimum, {st.dma_transfers} transfers, {st.instructions}")
    with capsys.disabled():
        print("\n  " + "\n  ".join(lines), end="")


# --------------------------------------------------------------------------- backward kernels: norms, softmax, activations
# The NKI backward kernels of softmax, rmsnorm, layernorm, gelu, silu and swiglu (docs/neuron.md, "Backward kernels:
# norms, softmax, activations"); the conformance suite checks them on every derived case, these pin what it cannot.


def _grads(name, *args, **kwargs):
    """The neuron backward kernel's gradients (strict: no cpu fallback; SBUF/PSUM capacity checked)."""
    with opport.strict(), capacity_checked():
        return function(get_op(name).backward_op)(*args, backend="neuron", **kwargs)


def _judge_grads(name, dtype, args, kwargs=None) -> list:
    """[why not] per gradient of the neuron kernel against the float64 VJP, judged as the conformance suite does."""
    bwd = get_op(name).backward_op
    kwargs = kwargs or {}
    outs = _grads(name, *args, **kwargs)
    refs = bwd.run_reference(*args, **kwargs)
    problems = []
    for i, (o, r) in enumerate(zip(outs, refs)):
        if r is None:
            assert o is None
            continue
        verdict = cmp.compare(o, np.asarray(r, np.float64), bwd.tolerance_for(dtype, i), dtype)
        if not verdict.ok:
            problems.append(f"{name} d{bwd.wrt[i]} {dtype} {args[0].shape}: {verdict.message}")
    return problems


def test_backward_kernels_are_registered_for_the_nki_dtypes():
    b = get_backend("neuron")
    for name in NORM_ACT_BACKWARD:
        ks = kernels(get_op(name).backward_op, b)
        assert [k.name for k in ks] == [f"neuron.{name}_backward"], name
        assert ks[0].dtypes == ("float32", "float16", "bfloat16"), name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NORM_ACT_BACKWARD)
def test_backward_fixed_cases(name, dtype):
    """Every fixed backward case (derived from the forward's, plus the backward-only edges) with SBUF/PSUM
    capacity checked, each gradient judged like a conformance output."""
    from tests.ops._grad import check_backward_kernel

    spec = get_op(name)
    with capacity_checked():
        for case in spec.backward_op.get_cases(dtype):
            if "large" not in case.tags and not in_the_gate(case):
                check_backward_kernel(spec, case, dtype, "neuron")


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_long_rows_and_many_row_tiles(dtype):
    """Paths the conformance cases do not reach: softmax rows longer than GRAD_RESIDENT spread over the partitions
    (with and without an N % 128 rest), norm rows streamed from HBM, row tiles past the first (PSUM accumulation of
    dweight / dbias over tiles), a constant grad (softmax's dx is then only the rounding of y: the two-float sum)."""
    import ml_dtypes

    dt = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    r = np.random.default_rng(7)
    problems = []
    for shape in ((2, 9001), (1, 128 * 70)):
        y = get_op("softmax").run_reference(r.standard_normal(shape) * 3, -1).astype(dt)
        for g in (r.standard_normal(shape).astype(dt), np.full(shape, -7.0).astype(dt)):
            problems += _judge_grads("softmax", dtype, (g, y), {"axis": -1})
    for shape in ((130, 700), (2, 9000)):
        x, g = (r.standard_normal(shape) + 0.3).astype(dt), r.standard_normal(shape).astype(dt)
        w, b = r.uniform(-2, 2, shape[1]).astype(dt), r.standard_normal(shape[1]).astype(dt)
        problems += _judge_grads("rmsnorm", dtype, (g, x, w), {"eps": 1e-5})
        problems += _judge_grads("layernorm", dtype, (g, x, w, b), {"eps": 1e-5})
    assert not problems, "\n".join(problems)


def test_backward_dma_bytes_at_the_minimum():
    """Every tensor read once and every gradient written once (rows kept in SBUF between the passes, the weight
    replicated on TensorE), and the norms' parameter gradients summed on TensorE, not on the host."""
    if not nki_compat.EMULATED:
        pytest.skip("DMA counters are collected by the emulator")
    import ml_dtypes

    r = np.random.default_rng(3)
    x = r.standard_normal((300, 1024)).astype(ml_dtypes.bfloat16)
    g = r.standard_normal((300, 1024)).astype(ml_dtypes.bfloat16)
    w, b = x[0].copy(), x[1].copy()
    y = get_op("softmax").run_reference(x, -1).astype(ml_dtypes.bfloat16)
    long_y = get_op("softmax").run_reference(r.standard_normal((1, 128256)), -1).astype(np.float32)
    calls = [("softmax", (g, y, -1)), ("softmax", (np.ones_like(long_y), long_y, -1)), ("rmsnorm", (g, x, w, 1e-6)),
             ("layernorm", (g, x, w, b, 1e-5)), ("gelu", (g, x, "none")), ("gelu", (g, x, "tanh")), ("silu", (g, x)),
             ("swiglu", (g, x, y))]
    for name, args in calls:
        bwd = get_op(name).backward_op
        with nki_compat.collect_stats() as stats, opport.strict():
            function(bwd)(*args, backend="neuron")
        least = bwd.get_cost(*metas_of(bwd, bwd.bind(*args))).bytes
        assert stats.hbm_bytes == least, (name, stats.hbm_bytes, least)
        if name in ("rmsnorm", "layernorm"):
            assert stats.instructions.get("tensor", 0) > 0, name


def _fails(bwd, outs, case) -> bool:
    """Whether some gradient in `outs` fails case's float32 tolerance against the float64 VJP."""
    refs = bwd.run_reference(*case.args, **case.kwargs)
    return any(r is not None and not cmp.compare(o, np.asarray(r, np.float64), bwd.tolerance_for("float32", i, case),
                                                 "float32").ok for i, (o, r) in enumerate(zip(outs, refs)))


def test_backward_declared_mutants_are_caught_on_neuron():
    """Each backward's declared mutant (a dropped term, a gradient not summed over rows) fails a fixed float32 case
    that the neuron kernel passes."""
    from opport.conformance.mutants import _as_kernel

    survivors = []
    for name in NORM_ACT_BACKWARD:
        bwd = get_op(name).backward_op
        cases = [c for c in bwd.get_cases("float32") if "large" not in c.tags]
        for mutant, fn in bwd.mutants.items():
            kernel = _as_kernel(bwd, fn)
            if not any(_fails(bwd, kernel(*bwd.bind(*c.args, **c.kwargs)), c)
                       and not _fails(bwd, _grads(name, *c.args, **c.kwargs), c) for c in cases):
                survivors.append(f"{name}: {mutant}")
    assert not survivors, survivors


@pytest.mark.parametrize("target", ["trn1", "trn3"])
def test_backward_other_generations(target):
    """One bfloat16 backward case per op on NeuronCore-v2 and -v4 (the fixed cases run on trn2)."""
    if not nki_compat.EMULATED:
        pytest.skip("target selection is an emulator feature")
    from tests.ops._grad import check_backward_kernel

    with nki_compat.nki.use_target(target):
        for name in NORM_ACT_BACKWARD:
            spec = get_op(name)
            check_backward_kernel(spec, next(iter(spec.backward_op.get_cases("bfloat16"))), "bfloat16", "neuron")
        if target == "trn1":  # the smallest SBUF: float32 norm rows of GRAD_RESIDENT (8192) kept, two-float scratch
            r = np.random.default_rng(5)
            x, g = (r.standard_normal((2, 8192)).astype(np.float32) for _ in range(2))
            w = r.uniform(-2, 2, 8192).astype(np.float32)
            problems = _judge_grads("rmsnorm", "float32", (g, x, w)) + _judge_grads("layernorm", "float32", (g, x, w, w))
            assert not problems, problems


def test_activation_backward_limits_and_precision():
    """Infinite grads against a derivative float32 rounds to 0 but float64 does not give the reference's
    infinity (not inf * 0 = NaN); silu' stays within a few float32 ulps through its root x0 = -1.27846."""
    from opport.ops.silu import silu_grad64

    x = np.array([-200.0, -30.0, -21.0, -800.0, -np.inf, np.inf], np.float32)
    g = np.full_like(x, np.inf)
    (dx,) = _grads("silu", g, x)
    assert dx[:2].tolist() == [-np.inf, -np.inf] and np.isnan(dx[3:5]).all() and dx[5] == np.inf
    for form in ("none", "tanh"):
        (dx,) = _grads("gelu", g, x, approximate=form)
        ref = get_op("gelu").backward_op.run_reference(g, x, form)[0]
        assert np.array_equal(np.isnan(dx), np.isnan(ref)) and np.array_equal(dx[~np.isnan(dx)], ref[~np.isnan(ref)])
    xs = (-1.2784645 + np.linspace(-2e-3, 2e-3, 4001)).astype(np.float32)
    (d,) = _grads("silu", np.ones_like(xs), xs)
    want = silu_grad64(xs.astype(np.float64))
    assert (np.abs(d - want) / np.spacing(np.abs(want).astype(np.float32))).max() < 4
