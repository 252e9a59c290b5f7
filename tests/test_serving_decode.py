"""The serving example's decode loop (examples/paged_llama.py: kv_cache_write + paged_attention over a paged
cache) generates transformers' own greedy tokens on cpu, cuda and neuron in strict mode.

The example's prefill calls `opport.varlen_attention`, which another branch adds; until it lands, a stand-in
built from `opport.attention` (one causal call per packed prompt) takes its place here, so this test checks
the two serving ops of this branch in the full loop. tests/test_serving_example.py (with varlen_attention)
runs the example as it is.
"""

import importlib.util
from pathlib import Path

import pytest

import opport
from opport.dispatch.registry import get_backend

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "paged_llama.py"


def _example():
    spec = importlib.util.spec_from_file_location("paged_llama", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _varlen_standin(q, k, v, cu_q, cu_k, causal=False, scale=None):
    """Packed [T, H, D] prompts attended one at a time with opport.attention on [1, H, S, D] views."""
    outs = []
    for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        qq, kk, vv = (t[s:e].transpose(0, 1)[None] for t in (q, k, v))
        outs.append(opport.attention(qq, kk, vv, causal=causal, scale=scale)[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("backend", ["cpu", "cuda", "neuron"])
def test_paged_decode_generates_transformers_tokens(backend, monkeypatch):
    if get_backend(backend).unavailable():
        pytest.skip(get_backend(backend).unavailable())
    if not hasattr(opport, "varlen_attention"):
        monkeypatch.setattr(opport, "varlen_attention", _varlen_standin, raising=False)
    ex = _example()
    model = ex.tiny_llama()
    prompts = [[5, 17, 42], list(range(1, 20)), [7] * 33]  # 3, 19, 33 tokens: blocks of 16 fill and spill
    engine = ex.PagedLlama(model, block_size=16)
    with opport.use_backend(backend), opport.strict():
        got = engine.generate(prompts, 6)
    assert got == ex.reference_generate(model, prompts, 6)
