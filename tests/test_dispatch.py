"""Backend precedence, strict mode, fallback, explain, the selection cache and thread safety."""

from __future__ import annotations

import os
import threading
import warnings

import numpy as np
import pytest

import opport
from opport.dispatch import impl
from opport.errors import BackendUnavailableError, UnsupportedError
from tests.conftest import fake_backend

X = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
W = np.linspace(0.5, 2.0, 4, dtype=np.float32)


def _tagging_kernel(tag, calls=None):
    def kernel(x, weight, eps, offset):
        if calls is not None:
            calls.append(tag)
        return np.full(x.shape, tag, x.dtype)

    return kernel


def test_keyword_beats_context_beats_env_beats_device(monkeypatch):
    with fake_backend("ta"), fake_backend("tb"), fake_backend("tc"):
        impl(opport.rmsnorm.spec, "ta")(_tagging_kernel(1))
        impl(opport.rmsnorm.spec, "tb")(_tagging_kernel(2))
        impl(opport.rmsnorm.spec, "tc")(_tagging_kernel(3))
        assert opport.rmsnorm(X, W)[0, 0] != 3  # device cpu -> cpu backend
        monkeypatch.setenv("OPPORT_BACKEND", "tc")
        assert opport.rmsnorm(X, W)[0, 0] == 3
        with opport.use_backend("tb"):
            assert opport.rmsnorm(X, W)[0, 0] == 2
            assert opport.rmsnorm(X, W, backend="ta")[0, 0] == 1
        assert opport.rmsnorm(X, W)[0, 0] == 3
        monkeypatch.delenv("OPPORT_BACKEND")
        np.testing.assert_allclose(opport.rmsnorm(X, W), opport.rmsnorm.spec.run_reference(X, W), rtol=1e-6)


def test_unknown_backend_lists_valid_names():
    with pytest.raises(BackendUnavailableError) as info:
        opport.rmsnorm(X, backend="tpu")
    assert "cpu" in str(info.value) and info.value.constraint == "rmsnorm.backend" and info.value.arg == "backend"
    with pytest.raises(BackendUnavailableError):
        with opport.use_backend("tpu"):
            pass


def test_unavailable_backend_named_explicitly_raises_with_reason():
    with fake_backend("gone", probe=lambda: "toolchain missing"):
        impl(opport.rmsnorm.spec, "gone")(_tagging_kernel(1))
        with pytest.raises(BackendUnavailableError, match="toolchain missing"):
            opport.rmsnorm(X, backend="gone")


def test_declining_kernel_falls_back_once_with_warning_and_strict_raises():
    calls = []
    with fake_backend("picky"):
        impl(opport.rmsnorm.spec, "picky",
             supports=lambda x, w, eps, offset: "rows must be a multiple of 128")(_tagging_kernel(9, calls))
        with pytest.warns(opport.FallbackWarning, match="multiple of 128"):
            out = opport.rmsnorm(X, W, backend="picky")
        np.testing.assert_allclose(out, opport.rmsnorm.spec.run_reference(X, W), rtol=1e-6)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opport.rmsnorm(X, W, backend="picky")  # warned once per (op, backend, reason)
            opport.clear_cache()
            opport.rmsnorm(X, W, backend="picky")
        with opport.strict(), pytest.raises(UnsupportedError, match="multiple of 128") as info:
            opport.rmsnorm(X, W, backend="picky")
        assert info.value.op == "rmsnorm"
        assert calls == []


def test_strict_from_environment(monkeypatch):
    with fake_backend("picky2"):
        impl(opport.rmsnorm.spec, "picky2", dtypes=("float16",))(_tagging_kernel(9))
        monkeypatch.setenv("OPPORT_STRICT", "1")
        with pytest.raises(UnsupportedError, match="float32"):
            opport.rmsnorm(X, W, backend="picky2")
        with opport.strict(False), pytest.warns(opport.FallbackWarning):
            opport.rmsnorm(X, W, backend="picky2")


def test_explain_names_kernel_and_every_rejection():
    with fake_backend("picky3"):
        impl(opport.rmsnorm.spec, "picky3", name="picky3.fast", priority=2,
             supports=lambda *a: "needs D % 64 == 0")(_tagging_kernel(1))
        impl(opport.rmsnorm.spec, "picky3", name="picky3.slow", priority=1)(_tagging_kernel(2))
        d = opport.explain("rmsnorm", X, W, backend="picky3")
        assert (d.backend, d.kernel, d.mode) == ("picky3", "picky3.slow", "test")
        assert ("picky3", "picky3.fast", "needs D % 64 == 0") in d.candidates
        assert "needs D % 64 == 0" in str(d)
    d = opport.explain(opport.rmsnorm, X, W)
    assert (d.backend, d.kernel, d.requested) == ("cpu", "cpu.rmsnorm", "input device cpu")


def test_selection_is_cached_per_signature():
    checks = []

    def supports(x, w, eps, offset):
        checks.append(x.shape)

    with fake_backend("counted"):
        impl(opport.rmsnorm.spec, "counted", supports=supports)(_tagging_kernel(1))
        for _ in range(5):
            opport.rmsnorm(X, W, backend="counted")
        assert checks == [(3, 4)]
        opport.rmsnorm(X[:2], W, backend="counted")
        opport.rmsnorm(X.copy(), W, backend="counted")  # same shape and strides: cached
        assert checks == [(3, 4), (2, 4)]
        opport.rmsnorm(np.asfortranarray(X), W, backend="counted")  # another layout: selected again
        assert checks == [(3, 4), (2, 4), (3, 4)]


def test_threads_with_cold_cache_agree_with_serial():
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((n, 16)).astype(np.float32) for n in (1, 2, 3, 5, 8)]
    serial = [opport.rmsnorm(x) for x in inputs]
    opport.clear_cache()
    errors, results = [], {}
    barrier = threading.Barrier(8)

    def worker(t):
        try:
            barrier.wait()
            for i in range(50):
                j = (t + i) % len(inputs)
                np.testing.assert_array_equal(opport.rmsnorm(inputs[j]), serial[j])
            results[t] = True
        except Exception as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 8


def test_cached_valid_call_does_not_let_an_equal_but_invalid_scalar_through():
    q = np.ones((1, 2, 4, 8), np.float32)
    opport.attention(q, q, q, causal=True)
    with pytest.raises(opport.ArgumentError) as info:
        opport.attention(q, q, q, causal=1)  # 1 == True, but causal must be a bool
    assert info.value.constraint == "attention.causal"


def test_torch_inputs_are_selected_again_for_a_new_dtype_shape_layout_or_class():
    torch = pytest.importorskip("torch")
    checks = []

    def supports(x, w, eps, offset):
        checks.append((x.dtype, x.shape, x.strides))

    xt, wt = torch.from_numpy(X.copy()), torch.from_numpy(W.copy())
    with fake_backend("counted_torch"):
        impl(opport.rmsnorm.spec, "counted_torch", supports=supports)(_tagging_kernel(1))
        for _ in range(3):
            opport.rmsnorm(xt, wt, backend="counted_torch")
        opport.rmsnorm(xt.clone(), wt, backend="counted_torch")  # same signature: cached
        assert len(checks) == 1
        opport.rmsnorm(xt.t().contiguous().t(), wt, backend="counted_torch")  # column-major layout
        opport.rmsnorm(xt.double(), wt.double(), backend="counted_torch")
        opport.rmsnorm(xt[:2], wt, backend="counted_torch")
        assert [c[1:] for c in checks[1:]] == [((3, 4), (1, 3)), ((3, 4), (4, 1)), ((2, 4), (4, 1))]
        out = opport.rmsnorm(xt, torch.nn.Parameter(wt), backend="counted_torch")  # a tensor subclass
        assert len(checks) == 5 and isinstance(out, torch.Tensor) and out[0, 0] == 1
        opport.rmsnorm(X, W, backend="counted_torch")  # NumPy arrays of the same signature: their own entry
        assert len(checks) == 6


def test_unknown_array_type_is_a_typed_error_on_the_cached_path_too():
    opport.rmsnorm(X, W)
    with pytest.raises(opport.DTypeError) as info:
        opport.rmsnorm(X, W.tolist())
    assert (info.value.arg, info.value.constraint) == ("weight", "rmsnorm.array_type")


def test_selection_key_contract():
    """Two calls share a selection key only if they would plan alike: any change in an array's class, dtype,
    shape, strides or device, a scalar's value or type, or the backend/strict settings gives another key."""
    from opport.dispatch.context import env_reader
    from opport.dispatch.core import key_function

    spec = opport.rmsnorm.spec
    for get, keyname in (env_reader(fast=True), env_reader(fast=False)):  # the fast reader and its fallback
        key = key_function(spec, get, keyname)
        base = key((X, W, 1e-6, 0.0), None)
        assert key((X.copy(), W.copy(), 1e-6, 0.0), None) == base
        others = [(X.astype(np.float64), W, 1e-6, 0.0), (X[:2], W, 1e-6, 0.0), (np.asfortranarray(X), W, 1e-6, 0.0),
                  (X, None, 1e-6, 0.0), (X, W, 1e-5, 0.0), (X, W, np.float32(1e-6), 0.0), (X, W, 1e-6, 1.0)]
        assert all(key(b, None) != base for b in others)
        assert key((X, W, 1e-6, 0.0), "cpu") != base
        with opport.use_backend("cpu"):
            assert key((X, W, 1e-6, 0.0), None) != base
        with opport.strict():
            assert key((X, W, 1e-6, 0.0), None) != base
        os.environ["OPPORT_STRICT"] = "1"
        try:
            assert key((X, W, 1e-6, 0.0), None) != base  # the environment is read on every call
        finally:
            del os.environ["OPPORT_STRICT"]
        torch = pytest.importorskip("torch")
        xt, wt = torch.from_numpy(X), torch.from_numpy(W)
        opport.rmsnorm(xt, wt)  # from now on plain tensors are keyed inline
        tkey = key((xt, wt, 1e-6, 0.0), None)
        assert tkey != base and key((xt.clone(), wt.clone(), 1e-6, 0.0), None) == tkey
        assert key((xt.t().contiguous().t(), wt, 1e-6, 0.0), None) != tkey


def test_env_reader_fallback_runs_the_dispatcher(monkeypatch):
    """Where os.environ has no `_data` mapping (another Python), the portable reader is used and works."""
    from opport.dispatch import context

    monkeypatch.setattr(os, "environ", _PlainEnviron(os.environ))
    get, keyname = context.env_reader()
    assert get == os.environ.get and keyname("A") == "A"
    os.environ["OPPORT_BACKEND"] = "cpu"
    assert context.text(get(keyname("OPPORT_BACKEND"))) == "cpu"


class _PlainEnviron(dict):
    """A mapping like os.environ on a Python without its private `_data` attribute."""
