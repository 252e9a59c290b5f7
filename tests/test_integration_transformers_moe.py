"""Mixture-of-experts models through opport: Qwen3-MoE and Mixtral built from tiny configs (no download).

Their routers run opport.topk_router and their experts opport.moe_experts (transformers 5's layout: gate_up_proj
[E, 2I, H], down_proj [E, H, I]). The sparse MoE block, transformers' own class, gives the same outputs and
gradients patched as unpatched (float32 within 1e-5 relative) on every backend that has the kernels, under
opport.strict() (nothing handed back, nothing falling back); whole tiny models give the same logits and training
gradients; the load-balancing loss, which the model's own head adds, is handed back (counted, raised in strict
mode), never dropped.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest

import opport

torch = pytest.importorskip("torch")
if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers is not installed", allow_module_level=True)

from opport.integrations.transformers import patch, stats  # noqa: E402
from tests.hf_tiny import LAYERS, VOCAB, backend_skip, transformers  # noqa: E402
from tests.hf_tiny import ids as _ids  # noqa: E402

MOE_OPS = ("topk_router", "moe_experts")
TINY = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=64, num_experts_per_tok=2)
CONFIGS = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(intermediate_size=48, moe_intermediate_size=16, num_experts=8, norm_topk_prob=True,
                       decoder_sparse_step=1)),
    "qwen3_moe_unnormalised": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                               dict(intermediate_size=48, moe_intermediate_size=16, num_experts=8,
                                    norm_topk_prob=False)),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(intermediate_size=16, num_local_experts=8)),
}
BACKENDS = ("cpu", "cuda", "neuron")


def _model(name: str, **extra):
    cfg_cls, model_cls, config = CONFIGS[name]
    torch.manual_seed(0)
    return model_cls(cfg_cls(**{**TINY, **config, **extra})).eval()


def _blocks(model) -> list:
    return [m for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock")]


def _grads(module, x) -> dict:
    """Output and the gradients of a fixed projection of it w.r.t. the input and every parameter."""
    x = x.detach().clone().requires_grad_()
    module.zero_grad()
    out = module(x)
    (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    return {"out": out.detach(), "dx": x.grad, **{n: p.grad.clone() for n, p in module.named_parameters()}}


def _close(got: dict, want: dict, rtol: float = 1e-5):
    assert got.keys() == want.keys()
    for name in want:
        scale = want[name].abs().max().item() or 1.0
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=rtol * scale, msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", CONFIGS)
def test_moe_block_matches_transformers_loop_forward_and_backward(name, backend):
    why = backend_skip(backend, MOE_OPS)
    if why:
        pytest.skip(why)
    model = _model(name)
    block = _blocks(model)[0]
    x = torch.randn(2, 5, TINY["hidden_size"], generator=torch.Generator().manual_seed(1))
    x[0, 1] = x[0, 0]  # two tokens routed alike
    want = _grads(block, x)
    patch(model)
    with opport.strict(), opport.use_backend(backend):
        got = _grads(block, x)
    _close(got, want)
    counts = stats(model)
    assert counts["topk_router"]["opport"] == 1 and counts["moe_experts"]["opport"] == 1, counts


@pytest.mark.parametrize("name", ("qwen3_moe", "mixtral"))
def test_tiny_moe_model_logits_and_training_gradients_match(name):
    model = _model(name).train()
    x = _ids(2, 7)
    ref = copy.deepcopy(model)
    want_loss = ref(x, labels=x).loss
    want_loss.backward()
    patch(model)
    with opport.strict():
        loss = model(x, labels=x).loss
        loss.backward()
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=n)
    counts = stats(model)
    assert counts["topk_router"]["opport"] == LAYERS and counts["moe_experts"]["opport"] == LAYERS, counts
    assert counts["linear_cross_entropy"]["opport"] == 1 and counts["attention"]["opport"] == LAYERS, counts
    model.eval()
    ref.eval()
    with torch.no_grad(), opport.strict():
        torch.testing.assert_close(model(x).logits, ref(x).logits, rtol=1e-5, atol=1e-5)


def test_the_load_balancing_loss_is_handed_back_not_dropped():
    model = _model("mixtral", output_router_logits=True, router_aux_loss_coef=0.5).train()
    x = _ids(2, 7)
    want = copy.deepcopy(model)(x, labels=x)
    patch(model)
    with pytest.warns(opport.FallbackWarning, match="load-balancing"):
        got = model(x, labels=x)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    assert got.aux_loss is not None
    assert stats(model)["linear_cross_entropy"]["reasons"] == {"router_aux_loss": 1}
    with opport.strict(), pytest.raises(opport.UnsupportedError, match="router_aux_loss"):
        model(x, labels=x)
