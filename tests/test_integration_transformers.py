"""patch(model) / unpatch(model) on tiny random Llama, Mistral and Qwen2 models built from configs (no download).

Tolerances (docs/integration.md): float32 logits within rtol = atol = 1e-5 of the unpatched model;
bfloat16 logits at most 1.5x as far (norm-wise) from a float64 run of the model as HF's own bfloat16 logits.
"""

from __future__ import annotations

import types

import pytest

import opport
from opport.dispatch import backends, kernels

torch = pytest.importorskip("torch")
# Probe cuda before transformers imports triton: without a GPU, Triton's interpreter must be switched on first.
CUDA_UNAVAILABLE = backends()["cuda"].unavailable() if "cuda" in backends() else "no cuda backend installed"
transformers = pytest.importorskip("transformers")

from opport.integrations.transformers import is_patched, patch, unpatch  # noqa: E402

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
}
LAYERS = 2
TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
PATCHED_OPS = ("rmsnorm", "swiglu", "rope", "attention", "add_rmsnorm", "linear_cross_entropy")


def _model(family="llama", dtype=torch.float32, **config):
    cfg_cls, model_cls = FAMILIES[family]
    torch.manual_seed(0)
    return model_cls(cfg_cls(**{**TINY, **config})).eval().to(dtype)


def _ids(batch=2, seq=7):
    return torch.randint(0, TINY["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(3))


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls the patched forwards make to each opport op."""
    import opport.integrations.transformers as patcher

    counts = dict.fromkeys(PATCHED_OPS, 0)
    real = patcher._op

    def spy(name, *args, **kwargs):
        counts[name] += 1
        return real(name, *args, **kwargs)

    monkeypatch.setattr(patcher, "_op", spy)
    return counts


def _logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids, **kwargs).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_patch_swaps_every_block_and_unpatch_restores(family):
    model, ids = _model(family), _ids()
    before = _logits(model, ids)
    assert patch(model) == {"rmsnorm": 2 * LAYERS + 1, "swiglu": LAYERS, "attention": LAYERS, "add_rmsnorm": LAYERS,
                            "linear_cross_entropy": 1}
    assert is_patched(model) and set(patch(model).values()) == {0}  # idempotent
    assert unpatch(model) == 5 * LAYERS + 2 and not is_patched(model)
    assert not any("forward" in vars(m) for m in model.modules())
    assert torch.equal(_logits(model, ids), before)


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_logits_match_unpatched_and_run_opport(family, calls):
    model, ids = _model(family), _ids()
    want = _logits(model, ids)
    patch(model)
    got = _logits(model, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # each layer's post-attention norm runs inside add_rmsnorm: one rmsnorm per layer plus the final norm
    assert calls == {"rmsnorm": LAYERS + 1, "swiglu": LAYERS, "rope": 2 * LAYERS, "attention": LAYERS,
                     "add_rmsnorm": LAYERS, "linear_cross_entropy": 0}  # no labels: the logits as before


@pytest.mark.parametrize("family", FAMILIES)
def test_training_loss_with_labels_is_the_fused_linear_cross_entropy(family, calls):
    """model.train() with labels: the loss from opport.linear_cross_entropy on the hidden states, logits None;
    HF's shift, ignore_index and num_items_in_batch kept; its gradients are the unpatched model's."""
    ids, labels = _ids(seq=9), _ids(seq=9)
    labels[0, :3] = -100  # prompt tokens masked out, as a fine-tuning collator does
    model = _model(family).train()
    results = []
    for patched in (False, True):
        if patched:
            patch(model)
        model.zero_grad()
        plain = model(ids, labels=labels)
        summed = model(ids, labels=labels, num_items_in_batch=torch.tensor(11))
        (plain.loss + summed.loss).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        results.append((plain, summed, grads))
    (want, want_sum, want_g), (got, got_sum, got_g) = results
    assert got.logits is None and want.logits is not None
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_sum.loss, want_sum.loss, rtol=1e-5, atol=1e-6)
    for g, w in zip(got_g, want_g):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    assert calls["linear_cross_entropy"] == 2
    model.eval()
    assert model(ids, labels=labels).logits is not None  # evaluation keeps the logits (and HF's loss)


def test_decode_step_with_kv_cache_matches(calls):
    model, ids = _model(), _ids(seq=6)
    results = []
    for patched in (False, True):
        if patched:
            patch(model)
        cache = transformers.DynamicCache()
        with torch.no_grad():
            model(ids[:, :5], past_key_values=cache, use_cache=True)
            results.append(model(ids[:, 5:], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)
    assert calls["attention"] == 2 * LAYERS  # prefill (Sq == Sk) and decode (Sq == 1) both ran opport


def test_padding_mask_hands_attention_back_to_the_model(calls):
    model, ids = _model(), _ids()
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding: a mask opport.attention does not take
    want = _logits(model, ids, attention_mask=mask)
    patch(model)
    torch.testing.assert_close(_logits(model, ids, attention_mask=mask), want, rtol=1e-5, atol=1e-5)
    assert calls["attention"] == 0 and calls["rope"] == 2 * LAYERS


def test_bfloat16_is_as_accurate_as_the_models_own_bfloat16():
    ids = _ids()
    exact = _logits(_model(dtype=torch.float64), ids)
    model = _model(dtype=torch.bfloat16)

    def error():  # relative norm-wise error of the bfloat16 logits against the float64 model
        return ((_logits(model, ids).double() - exact).norm() / exact.norm()).item()

    hf_err = error()
    patch(model)
    opport_err = error()
    assert opport_err <= 1.5 * hf_err, (opport_err, hf_err)


def test_other_model_types_are_refused():
    other = types.SimpleNamespace(config=types.SimpleNamespace(model_type="gpt2"), modules=lambda: iter(()))
    with pytest.raises(opport.UnsupportedError) as info:
        patch(other)
    assert info.value.constraint == "transformers.model_type"


def test_patched_model_compiles_fullgraph():
    model, ids = _model(), _ids()
    want = _logits(model, ids)
    patch(model)
    with torch.no_grad():
        got = torch.compile(model, fullgraph=True, backend="aot_eager")(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _cuda_skip_reason() -> str | None:
    if CUDA_UNAVAILABLE:
        return f"cuda backend unavailable: {CUDA_UNAVAILABLE}"
    missing = [name for name in PATCHED_OPS if not kernels(opport.get_op(name), backends()["cuda"])]
    return f"cuda backend has no kernel for {', '.join(missing)}" if missing else None


def test_patched_logits_match_on_cuda_backend():
    reason = _cuda_skip_reason()
    if reason:
        pytest.skip(reason)
    model, ids = _model(hidden_size=32, intermediate_size=48), _ids(batch=1, seq=5)
    want = _logits(model, ids)
    patch(model)
    with opport.use_backend("cuda"), opport.strict():  # CPU tensors would pick cpu; strict: no silent fallback
        got = _logits(model, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
