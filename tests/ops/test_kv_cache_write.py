"""kv_cache_write: in-place writes on every backend, the conformance suite's write checks, bad input writes nothing."""

import numpy as np
import pytest

import opport
from opport.conformance.cases import Item
from opport.conformance.execute import run_item
from opport.dispatch import clear_cache
from opport.dispatch.registry import get_backend, kernels
from opport.errors import ArgumentError, ShapeError
from opport.ops.kv_cache_write import PAD, make_case
from opport.ops.kv_cache_write import kv_cache_write as spec

DTYPES = ("float32", "float16", "bfloat16", "float64")


def expected(case):
    """The caches after the write, built token by token (independent of the op's region rule)."""
    key, value, kc, vc, slots = (np.array(a, copy=True) for a in case.args)
    bs = kc.shape[1]
    for t, s in enumerate(slots):
        if s != PAD:
            kc[s // bs, s % bs], vc[s // bs, s % bs] = key[t], value[t]
    return kc, vc


def call(case, backend="cpu"):
    key, value, kc, vc, slots = (np.array(a, copy=True) for a in case.args)
    ret = opport.kv_cache_write(key, value, kc, vc, slots, backend=backend)
    return ret, kc, vc


@pytest.mark.parametrize("dtype", DTYPES)
def test_fixed_cases_write_exactly_the_slots_bitwise(dtype):
    for case in spec.get_cases(dtype):
        ret, kc, vc = call(case)
        want_k, want_v = expected(case)
        assert ret is None
        assert kc.tobytes() == want_k.tobytes() and vc.tobytes() == want_v.tobytes(), case.name


@pytest.mark.parametrize("backend", ["cuda", "neuron"])
def test_other_backends_write_the_callers_numpy_arrays(backend):
    """The cuda backend takes torch tensors (converted here): the dispatcher copies the written caches back."""
    b = get_backend(backend)
    if b.unavailable():
        pytest.skip(b.unavailable())
    case = make_case("t", "float32", 20, 2, 16, 4, 16, pad=3)
    ret, kc, vc = call(case, backend)
    want_k, want_v = expected(case)
    assert ret is None and kc.tobytes() == want_k.tobytes() and vc.tobytes() == want_v.tobytes()


@pytest.mark.parametrize("backend", ["cpu", "cuda", "neuron"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_torch_tensors_are_written_in_place(backend, layout):
    """cpu and neuron take NumPy: torch caches (strided ones through a copy) still end up written in place."""
    torch = pytest.importorskip("torch")
    if get_backend(backend).unavailable():
        pytest.skip(get_backend(backend).unavailable())
    case = make_case("t", "float32", 9, 2, 8, 3, 16, pad=2)
    key, value, kc, vc, slots = (torch.from_numpy(np.array(a, copy=True)) for a in case.args)
    if layout == "transposed":  # a [num_blocks, bs, D, Hkv] buffer viewed as [num_blocks, bs, Hkv, D]
        kc, vc = kc.transpose(2, 3).contiguous().transpose(2, 3), vc.transpose(2, 3).contiguous().transpose(2, 3)
    kc_ptr = kc.data_ptr()
    assert opport.kv_cache_write(key, value, kc, vc, slots, backend=backend) is None
    want_k, want_v = expected(case)
    assert kc.data_ptr() == kc_ptr
    assert kc.contiguous().numpy().tobytes() == want_k.tobytes() and vc.contiguous().numpy().tobytes() == want_v.tobytes()


@pytest.mark.parametrize("slots,constraint", [([0, 1, 48, 2], "kv_cache_write.slot_range"),
                                              ([0, -2, 3, 2], "kv_cache_write.slot_range"),
                                              ([5, -1, 5, 2], "kv_cache_write.slot_unique")])
@pytest.mark.parametrize("backend", ["cpu", "cuda", "neuron"])
def test_bad_slots_raise_before_anything_is_written(slots, constraint, backend):
    if get_backend(backend).unavailable():
        pytest.skip(get_backend(backend).unavailable())
    rng = np.random.default_rng(0)
    key, value = rng.standard_normal((4, 2, 8)).astype(np.float32), rng.standard_normal((4, 2, 8)).astype(np.float32)
    kc, vc = rng.standard_normal((3, 16, 2, 8)).astype(np.float32), rng.standard_normal((3, 16, 2, 8)).astype(np.float32)
    before = kc.tobytes() + vc.tobytes()
    with pytest.raises(ArgumentError) as e:
        opport.kv_cache_write(key, value, kc, vc, np.array(slots), backend=backend)
    assert e.value.constraint == constraint and e.value.op == "kv_cache_write" and e.value.arg == "slot_mapping"
    assert kc.tobytes() + vc.tobytes() == before


def test_shape_errors_name_the_constraint():
    z = np.zeros
    with pytest.raises(ShapeError) as e:
        opport.kv_cache_write(z((4, 2, 8)), z((4, 2, 8)), z((3, 16, 1, 8)), z((3, 16, 2, 8)), np.arange(4))
    assert e.value.constraint == "kv_cache_write.heads"


def _conformance(case, dtype, fn, layout=None):
    """Run one conformance item with the cpu kernel replaced by `fn`."""
    k = kernels(spec, get_backend("cpu"))[0]
    saved = k.fn
    k.fn = fn
    clear_cache()
    try:
        return run_item(Item(spec.name, "cpu", dtype, case.name, case, layout, "layout" if layout else "fixed"))
    finally:
        k.fn = saved
        clear_cache()


def test_conformance_passes_the_real_kernel_on_every_layout():
    case = next(c for c in spec.get_cases("float16") if c.name == "padded")
    k = kernels(spec, get_backend("cpu"))[0]
    for layout in (None, "transposed", "sliced", "offset"):
        res = _conformance(case, "float16", k.fn, layout)
        assert res["status"] == "pass", (layout, res["message"])


def _extra_row(key, value, kc, vc, slots):  # writes one more slot than asked
    _real(key, value, kc, vc, slots)
    free = sorted(set(range(kc.shape[0] * kc.shape[1])) - set(int(s) for s in slots))[0]
    kc[free // kc.shape[1], free % kc.shape[1]] = 0


def _drops_last(key, value, kc, vc, slots):
    s = np.array(slots, copy=True)
    s[np.flatnonzero(s != PAD)[-1]] = PAD
    _real(key, value, kc, vc, s)


def _rounds(key, value, kc, vc, slots):  # goes through float32: NaN payloads and float64 digits change
    _real(key.astype(np.float32).astype(key.dtype) * 1.0000001, value, kc, vc, slots)


def _returns_cache(key, value, kc, vc, slots):
    _real(key, value, kc, vc, slots)
    return kc


def _writes_the_gap(key, value, kc, vc, slots):  # a strided view's neighbours: writes through the base buffer
    _real(key, value, kc, vc, slots)
    if kc.base is not None:
        np.asarray(kc.base).reshape(-1)[:1] = 7


def _real(*args):
    from opport.backends.cpu.kv_cache_write import kv_cache_write

    return kv_cache_write(*args)


@pytest.mark.parametrize("bad,why", [(_extra_row, "outside the written region changed"),
                                     (_drops_last, "written region"),
                                     (_returns_cache, "expected None")])
def test_conformance_catches_wrong_writes(bad, why):
    case = next(c for c in spec.get_cases("float64") if c.name == "padded")
    res = _conformance(case, "float64", bad)
    assert res["status"] == "fail" and why in res["message"], res["message"]


def test_conformance_catches_a_rounded_copy():
    case = next(c for c in spec.get_cases("float64") if c.name == "prefill-b16")
    res = _conformance(case, "float64", _rounds)
    assert res["status"] == "fail" and "written region" in res["message"], res["message"]


def test_conformance_catches_writes_outside_a_strided_view():
    case = next(c for c in spec.get_cases("float32") if c.name == "padded")
    res = _conformance(case, "float32", _writes_the_gap, "offset")
    assert res["status"] == "fail" and "outside" in res["message"], res["message"]


def test_neuron_dma_traffic_is_the_rows_written():
    b = get_backend("neuron")
    if b.unavailable():
        pytest.skip(b.unavailable())
    from opport.backends.neuron import nki_compat

    case = make_case("t", "bfloat16", 40, 2, 64, 8, 16)
    key, value, kc, vc, slots = (np.array(a, copy=True) for a in case.args)
    with nki_compat.collect_stats() as st, opport.strict():
        opport.kv_cache_write(key, value, kc, vc, slots, backend="neuron")
    rows = key.nbytes + value.nbytes
    assert st.dma_bytes == rows + 4 * len(slots)  # the rows, HBM to HBM, plus the int32 slot indices
    assert st.hbm_write_bytes == rows
