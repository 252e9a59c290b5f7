"""examples/paged_llama.py: a paged-KV-cache generation loop on opport ops equals transformers' greedy generate.

Three prompts of 3, 19 and 33 tokens (blocks of 16: the last block partly filled, the 33-token prompt's
third block opened by its first decode step) and 6 new tokens each, float32, on every backend that has
kernels for every op the loop calls, in strict mode (no cpu fallback).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import opport
from opport.dispatch import backends, kernels
from opport.dispatch.registry import get_backend

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "paged_llama.py"
LOOP_OPS = ("rmsnorm", "add_rmsnorm", "matmul", "rope", "swiglu", "kv_cache_write", "varlen_attention",
            "paged_attention")
PROMPTS = [[5, 17, 42], list(range(1, 20)), [7, 3] * 16 + [9]]


def _example():
    spec = importlib.util.spec_from_file_location("paged_llama", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _serving_backends() -> list:
    return [b for b in backends() if not backends()[b].unavailable()
            and all(kernels(opport.get_op(n), get_backend(b)) for n in LOOP_OPS)]


@pytest.fixture(scope="module")
def example():
    ex = _example()
    model = ex.tiny_llama()
    return ex, model, ex.reference_generate(model, PROMPTS, 6)


def test_every_backend_runs_the_loop():
    assert set(_serving_backends()) >= {"cpu", "cuda", "neuron"} - {b for b in backends() if backends()[b].unavailable()}


@pytest.mark.parametrize("backend", _serving_backends())
def test_paged_generation_matches_transformers_token_for_token(example, backend):
    ex, model, want = example
    engine = ex.PagedLlama(model, block_size=16, num_blocks=16)
    with opport.use_backend(backend), opport.strict():
        got = engine.generate(PROMPTS, 6)
    assert got == want
    assert len(set(map(tuple, want))) > 1  # the prompts lead to different continuations


def test_the_check_fails_when_the_cache_write_is_wrong(example, monkeypatch):
    """Writing each decode token's K and V one slot too far: the generated tokens part from transformers'."""
    ex, model, want = example
    engine = ex.PagedLlama(model, block_size=16, num_blocks=16)
    real = ex.PagedCache.slots

    def shifted(self, seq, start, n):
        slots = real(self, seq, start, n)
        return slots if start == 0 else [s + 1 for s in slots]  # prefill right, every decode write misplaced

    monkeypatch.setattr(ex.PagedCache, "slots", shifted)
    with opport.use_backend("cpu"):
        got = engine.generate(PROMPTS, 6)
    assert got != want


def test_the_example_runs_as_a_script():
    assert _example().main(["--backend", "cpu", "--new-tokens", "3"]) == 0


@pytest.mark.parametrize("family", ["mistral", "qwen3", "gemma2", "qwen2-windowed"])
def test_models_the_loop_would_compute_wrongly_are_refused(family):
    """A window, q/k norms, soft caps or another layout: the loop refuses (it would generate other tokens)."""
    import transformers

    ex = _example()
    tiny = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8)
    config = {"mistral": lambda: transformers.MistralConfig(**tiny, sliding_window=8),
              "qwen3": lambda: transformers.Qwen3Config(**tiny),
              "gemma2": lambda: transformers.Gemma2Config(**tiny),
              "qwen2-windowed": lambda: transformers.Qwen2Config(**tiny, sliding_window=8, use_sliding_window=True)}
    model = transformers.AutoModelForCausalLM.from_config(config[family]())
    with pytest.raises(opport.UnsupportedError, match="paged_llama.model"):
        ex.PagedLlama(model)
