"""patch(model) / unpatch(model) on tiny random Llama, Mistral and Qwen2 models built from configs (no download).

Tolerances (docs/integration.md): float32 logits within rtol = atol = 1e-5 of the unpatched model;
bfloat16 logits at most 1.5x as far (norm-wise) from a float64 run of the model as HF's own bfloat16 logits.
"""

from __future__ import annotations

import importlib.util
import types

import pytest

import opport

torch = pytest.importorskip("torch")
if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers is not installed", allow_module_level=True)

from opport.integrations.transformers import is_patched, patch, stats, unpatch  # noqa: E402
from tests.hf_tiny import FAMILIES, LAYERS, backend_skip, transformers  # noqa: E402
from tests.hf_tiny import ids as _ids  # noqa: E402
from tests.hf_tiny import logits as _logits  # noqa: E402
from tests.hf_tiny import model as _model  # noqa: E402


def _ran(model) -> dict:
    """Calls of each op that ran through opport since the last look; asserts nothing was handed back."""
    counts = stats(model, reset=True)
    assert not any(c["handed_back"] for c in counts.values()), counts
    return {op: c["opport"] for op, c in counts.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_patch_swaps_every_block_and_unpatch_restores(family):
    model, ids = _model(family), _ids()
    before = _logits(model, ids)
    assert patch(model) == {"rmsnorm": 2 * LAYERS + 1, "layernorm": 0, "mlp": LAYERS, "attention": LAYERS, "add_rmsnorm": LAYERS,
                            "topk_router": 0, "moe_experts": 0, "linear_cross_entropy": 1, "inputs": 1}
    assert is_patched(model) and set(patch(model).values()) == {0}  # idempotent
    assert unpatch(model) == 5 * LAYERS + 3 and not is_patched(model)
    assert not any("forward" in vars(m) or "_opport_counts" in vars(m) for m in model.modules())
    assert torch.equal(_logits(model, ids), before)


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_logits_match_unpatched_and_run_opport(family):
    model, ids = _model(family), _ids()
    want = _logits(model, ids)
    patch(model)
    got = _logits(model, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # each layer's post-attention norm runs inside add_rmsnorm: one rmsnorm per layer plus the final norm
    assert _ran(model) == {"rmsnorm": LAYERS + 1, "layernorm": 0, "swiglu": LAYERS, "gelu": 0, "rope": LAYERS,
                           "attention": LAYERS, "varlen_attention": 0, "add_rmsnorm": LAYERS, "topk_router": 0, "moe_experts": 0,
                           "linear_cross_entropy": 0, "linear_logprobs": 0, "kv_cache_write": 0, "kv_cache_write_fp8": 0,
                           "paged_varlen_attention": 0}  # no labels: the logits as before


def test_patched_forward_keeps_the_original_signature():
    """generate() and Trainer read forward's parameter names (attention_mask, logits_to_keep, labels, ...)."""
    import inspect

    model = _model()
    want = {m: list(inspect.signature(m.forward).parameters) for m in model.modules()}
    patch(model)
    assert {m: list(inspect.signature(m.forward).parameters) for m in model.modules()} == want


@pytest.mark.parametrize("rotary", [16, 8])
@pytest.mark.parametrize("grad", [False, True])
def test_rope_of_q_and_k_gives_each_ones_own_bits(rotary, grad):
    """Without gradients the patched attention ropes q and k in one call on their heads side by side (with them, in
    two): either way each gets exactly opport.rope of itself alone; partial rotary leaves the rest as it was."""
    from opport.integrations.transformers import forwards

    model = _model()
    patch(model)
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 4, 5, 16, generator=g), torch.randn(2, 2, 5, 16, generator=g)
    angles = torch.randn(2, 5, rotary // 2, generator=g)
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1) for f in (torch.cos, torch.sin))  # HF's repeated half table
    q.requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        got = forwards._rope(attn, q, k, (cos, sin))
    calls = stats(model, reset=True)["rope"]["opport"]
    assert calls == (2 if grad else 1)
    for x, y in zip((q, k), got):
        x = x.detach()
        want = torch.cat([opport.rope(x[..., :rotary], cos[..., : rotary // 2], sin[..., : rotary // 2]),
                          x[..., rotary:]], dim=-1)
        assert torch.equal(y.detach(), want)


@pytest.mark.parametrize("family", FAMILIES)
def test_training_loss_with_labels_is_the_fused_linear_cross_entropy(family):
    """model.train() with labels: the loss from opport.linear_cross_entropy on the hidden states, logits None;
    HF's shift, ignore_index and num_items_in_batch kept; its gradients are the unpatched model's."""
    ids, labels = _ids(seq=9), _ids(seq=9, seed=4)
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
    assert _ran(model)["linear_cross_entropy"] == 2
    model.eval()
    assert model(ids, labels=labels).logits is not None  # evaluation keeps the logits (and HF's loss)


def test_decode_step_with_kv_cache_matches():
    model, ids = _model(), _ids(seq=6)
    results = []
    for patched in (False, True):
        if patched:
            patch(model)
        cache = transformers.DynamicCache()
        with torch.no_grad():
            model(ids[:, :3], past_key_values=cache, use_cache=True)
            model(ids[:, 3:5], past_key_values=cache, use_cache=True)  # chunked prefill: Sq = 2 < Sk = 5
            results.append(model(ids[:, 5:], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)
    assert _ran(model)["attention"] == 3 * LAYERS  # prefill, chunk and decode (Sq == 1) all ran opport


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
    other = types.SimpleNamespace(config=types.SimpleNamespace(model_type="bert"), modules=lambda: iter(()))
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
    assert _ran(model)["attention"] == LAYERS  # the counts are kept under torch.compile too


def test_patched_logits_match_on_cuda_backend():
    reason = backend_skip("cuda")
    if reason:
        pytest.skip(reason)
    model, ids = _model(hidden_size=32, intermediate_size=48), _ids(batch=1, seq=5)
    want = _logits(model, ids)
    patch(model)
    with opport.use_backend("cuda"), opport.strict():  # CPU tensors would pick cpu; strict: no silent fallback
        got = _logits(model, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
