"""Batch invariance (docs/conformance.md): the conformance suite's batch items say whether a row's outputs are
bitwise the same alone, in its batch and at another position; under opport.batch_invariant() (or
OPPORT_BATCH_INVARIANT=1) every cpu kernel makes them so, and the report's table says which kernels are."""

from __future__ import annotations

import numpy as np
import pytest

import opport
from opport.conformance.report import batch_invariance, batch_table
from opport.conformance.runner import Options, run

GEMM_OPS = ("matmul", "linear_cross_entropy", "linear_logprobs", "moe_experts")  # the cpu kernels the mode changes


def _batch_run(ops, **kw):
    return run(Options(backends=("cpu",), ops=ops, cases=("*@batch",), workers=0, errors=False, **kw))


def test_every_cpu_op_with_a_batch_is_invariant_under_the_mode(monkeypatch):
    """OPPORT_BATCH_INVARIANT=1: every batch item of the ops whose cpu kernels use BLAS passes and is invariant in
    every dtype (without the mode their rows vary: OpenBLAS's bits depend on a row's neighbours)."""
    monkeypatch.setenv("OPPORT_BATCH_INVARIANT", "1")
    report = _batch_run(GEMM_OPS)
    items = [c for c in report.cases if c["source"] == "batch"]
    assert {c["op"] for c in items} == set(GEMM_OPS)
    assert all(c["status"] == "pass" and c["batch_invariant"] for c in items), \
        [c["id"] + ": " + c["message"] for c in items if not c.get("batch_invariant")]
    assert all(all(per["cpu"].values()) for per in batch_invariance(report).values())


def test_a_row_that_varies_fails_only_where_the_mode_is_promised(monkeypatch):
    """The check itself: a cpu matmul that adds a batch-dependent ulp is reported as varying (a pass without the
    mode: a property, not a failure), and fails under the mode, which the cpu backend promises."""
    import opport.backends.cpu.matmul as cpu_matmul
    from opport.dispatch import kernels
    from opport.dispatch.registry import get_backend

    kernel = kernels(opport.get_op("matmul"), get_backend("cpu"))[0]
    real = kernel.fn

    def drifting(a, b, bias):  # the last row of a batch of more than one is nudged by one ulp
        out = real(a, b, bias)
        if a.ndim == 2 and a.shape[0] > 1:
            out[-1] = np.nextafter(out[-1], np.inf)
        return out

    monkeypatch.setattr(kernel, "fn", drifting)
    opport.clear_cache()  # dispatch decisions made by earlier tests hold the real kernel
    assert cpu_matmul is not None
    report = _batch_run(("matmul",), dtypes=("float32",))
    items = [c for c in report.cases if c["source"] == "batch"]
    assert items and all(c["status"] == "pass" and c["batch_invariant"] is False for c in items), items
    assert "not batch-invariant" in items[0]["message"]
    monkeypatch.setenv("OPPORT_BATCH_INVARIANT", "1")
    report = _batch_run(("matmul",), dtypes=("float32",))
    assert all(c["status"] == "fail" for c in report.cases if c["source"] == "batch")
    monkeypatch.undo()
    opport.clear_cache()


def test_the_context_manager_makes_cpu_rows_invariant():
    """opport.batch_invariant(): a token's log-prob and a row of a product are the same bits computed alone or in a
    batch of 40 (as an RL trainer's rollout and training passes need), and as accurate as BLAS's."""
    rng = np.random.default_rng(0)
    h, w = rng.standard_normal((40, 256)).astype(np.float32), rng.standard_normal((3000, 256)).astype(np.float32) / 16
    t = rng.integers(0, 3000, 40)
    with opport.batch_invariant():
        whole, ent = opport.linear_logprobs(h, w, t, temperature=0.8)
        for i in (0, 17, 39):
            alone, ent_alone = opport.linear_logprobs(h[i:i + 1], w, t[i:i + 1], temperature=0.8)
            assert alone.tobytes() == whole[i:i + 1].tobytes() and ent_alone.tobytes() == ent[i:i + 1].tobytes()
        prod = opport.matmul(h, w.T)
        assert opport.matmul(h[::-1], w.T)[::-1].tobytes() == prod.tobytes()
    exact = h.astype(np.float64) @ w.T.astype(np.float64)
    blas = opport.matmul(h, w.T)
    assert np.abs(prod - exact).max() <= 2 * np.abs(blas - exact).max() + 1e-6


def test_the_report_has_a_batch_invariance_column_for_every_op():
    """Every public op run is a row: ✓ / varies per backend where it declares a batch, n/a where it does not."""
    from rich.console import Console

    report = run(Options(backends=("cpu",), ops=("rmsnorm", "kv_cache_write"), dtypes=("float32",), workers=0,
                         errors=False, cases=("*@batch", "decode-*")))
    console = Console(record=True, width=120)
    console.print(batch_table(report))
    text = console.export_text()
    assert "rmsnorm" in text and "✓" in text
    assert "kv_cache_write" in text and "n/a" in text


def test_a_backend_that_does_not_keep_the_mode_warns_once_and_strict_refuses():
    """Under the mode, an op with a batch on a backend without Capabilities.batch_invariant (cuda here) runs its usual
    kernels: never silently (one FallbackWarning per op and backend; UnsupportedError under strict()); ops without a
    batch and cpu say nothing."""
    import warnings

    x = np.ones((4, 8), np.float32)
    opport.clear_cache()
    with opport.batch_invariant(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            opport.rmsnorm(x, backend="cuda")
        opport.rmsnorm(x, backend="cpu")
    said = [str(w.message) for w in seen if issubclass(w.category, opport.FallbackWarning)]
    assert len(said) == 1 and "cuda backend does not make its kernels batch-invariant" in said[0]
    with opport.batch_invariant(), opport.strict(), pytest.raises(opport.UnsupportedError) as info:
        opport.rmsnorm(x, backend="cuda")
    assert info.value.constraint == "rmsnorm.batch_invariant"
    opport.rmsnorm(x, backend="cuda")  # outside the mode the cached plans run as before
