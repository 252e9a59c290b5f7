"""The MoE dispatch ops beyond their conformance cases: the paths the fast tier's small cases do not reach on the
emulated backends (several cuda programs and count blocks, several 128-token neuron tiles and column chunks), and
topk_router -> moe_permute -> moe_unpermute against the dense mixture formula."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

import opport
from opport.ops import get_op
from opport.public import function

rng = np.random.default_rng(7)


def _routing(t: int, e: int, k: int) -> np.ndarray:
    return np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32)


def _exact(got, want):
    got = np.asarray(got)
    assert got.shape == np.shape(want) and np.array_equal(got, np.asarray(want), equal_nan=True)


def _torch_args(args):
    torch = pytest.importorskip("torch")
    return [torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in args]


def _numpy(out):
    return tuple(np.asarray(o.cpu()) if hasattr(o, "cpu") else np.asarray(o) for o in out)


def _run(spec, args, backend):
    with opport.strict():
        out = function(spec)(*(_torch_args(args) if backend == "cuda" else args), backend=backend)
    return _numpy(out if isinstance(out, tuple) else (out,))


@pytest.mark.parametrize("backend", ["cuda", "neuron"])
def test_permute_over_several_blocks_matches_the_reference(backend, monkeypatch):
    """cuda: 8-slot programs in 4-slot chunks (count, scan and placement launches); neuron: 300 tokens, three
    128-token tiles carrying each expert's running base from tile to tile."""
    if backend == "cuda":
        pytest.importorskip("triton")
        mod = importlib.import_module("opport.backends.cuda.moe_permute")
        monkeypatch.setattr(mod, "_config", lambda n, e, h: (8, 4, mod.next_pow2(e), 16))
    spec = get_op("moe_permute")
    t = 300 if backend == "neuron" else 37
    x = rng.standard_normal((t, 24)).astype(np.float32)
    idx = _routing(t, 12, 3)
    idx[::7] = idx[0]  # a run of tokens with the same experts: long same-expert runs across blocks
    got = _run(spec, (x, idx, 12), backend)
    for g, w in zip(got, spec.run_reference(x, idx, 12)):
        _exact(g, w)


@pytest.mark.parametrize("backend", ["cuda", "neuron"])
def test_unpermute_and_permute_backward_over_tiles_and_chunks(backend, monkeypatch):
    """Several token tiles (neuron: 300 tokens) and column chunks (FMAX 16 over 40 columns), forward and backward."""
    if backend == "neuron":
        mod = importlib.import_module("opport.backends.neuron.moe_unpermute")
        monkeypatch.setattr(mod, "FMAX", 16)
        monkeypatch.setattr(importlib.import_module("opport.backends.neuron.moe_permute"), "FMAX", 16)
    else:
        pytest.importorskip("triton")
        mod = importlib.import_module("opport.backends.cuda.moe_unpermute")
        monkeypatch.setattr(mod, "_tile", lambda rows, cols: (4, 16))
    t, k, n = (300, 2, 40) if backend == "neuron" else (37, 3, 40)
    source = np.argsort(_routing(t, 8, k).reshape(-1), kind="stable").astype(np.int32)
    y = rng.standard_normal((t * k, n)).astype(np.float32)
    w = rng.random((t, k)).astype(np.float32)
    g = rng.standard_normal((t, n)).astype(np.float32)
    unpermute = get_op("moe_unpermute")
    for spec, args in ((unpermute, (y, source, w)), (unpermute.backward_op, (g, y, source, w)),
                       (get_op("moe_permute").backward_op, (y, g, _routing(t, 8, k), source, 8))):
        got = _run(spec, args, backend)
        want = spec.run_reference(*args)
        for o, r in zip(got, want if isinstance(want, tuple) else (want,)):
            np.testing.assert_allclose(o, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["cuda", "neuron"])
def test_router_over_several_programs(backend, monkeypatch):
    """cuda: 4 rows per program; neuron: three 128-token tiles. Exact indices, weights to float32's tolerance."""
    if backend == "cuda":
        pytest.importorskip("triton")
        mod = importlib.import_module("opport.backends.cuda.topk_router")
        monkeypatch.setattr(mod, "_config", lambda rows, e: (4, mod.next_pow2(e)))
    spec = get_op("topk_router")
    logits = rng.standard_normal((300 if backend == "neuron" else 37, 24)).astype(np.float32)
    logits[::5, 3] = logits[::5, 9]  # ties
    w, idx = _run(spec, (logits, 4, True), backend)
    ref_w, ref_idx = spec.run_reference(logits, 4, True)
    _exact(idx, ref_idx)
    np.testing.assert_allclose(w, ref_w, rtol=2e-6, atol=1e-6)


def test_route_dispatch_combine_is_the_dense_mixture():
    """topk_router, moe_permute, a per-expert transform and moe_unpermute on cpu give sum_j w_tj f_e(x_t), the dense
    formula (transformers' MoE block with each expert as a scale)."""
    t, e, k, h = 50, 8, 2, 16
    x = rng.standard_normal((t, h))
    logits = rng.standard_normal((t, e))
    scale = rng.standard_normal(e)
    w, idx = opport.topk_router(logits, k, renormalize=True)
    permuted, source, offsets = opport.moe_permute(x, idx, e)
    for ex in range(e):
        permuted[offsets[ex]:offsets[ex + 1]] *= scale[ex]
    out = opport.moe_unpermute(permuted, source, w)
    dense = np.einsum("tj,tj,th->th", w, scale[idx], x)
    np.testing.assert_allclose(out, dense, rtol=1e-12, atol=1e-12)
    assert np.array_equal(np.diff(offsets), np.bincount(idx.reshape(-1), minlength=e))
