"""The families beyond Llama, Mistral and Qwen2 through patch(), each built from a tiny config (nothing downloaded):
Qwen3 (q/k norms per head), Phi3 (fused qkv and gate_up projections, partial rotary), OLMo2 (post-norms, q/k norms
over the projection), Gemma2 (1 + weight norms, tanh-GELU gate, attention and final-logit soft caps, alternating
sliding-window layers), Gemma3 text (q/k norms, local layers with their own rope base) and GPT-NeoX (layernorm,
parallel residual, per-head interleaved qkv, partial rotary, ungated GELU MLP).

On every backend that has the kernels, under opport.strict() (nothing handed back, nothing falling back): float32
logits within 1e-5 (relative) of the unpatched model's, five AdamW steps tracking it (per-step loss within 1e-5
relative), greedy generate token-identical, and a padded batch equal to its rows run alone; every norm, MLP,
attention and loss call counted as run through opport.
"""

from __future__ import annotations

import importlib.util
import warnings

import pytest

import opport

torch = pytest.importorskip("torch")
if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers is not installed", allow_module_level=True)

from opport.integrations.transformers import FAMILIES, HandBackWarning, patch, stats  # noqa: E402
from tests.hf_tiny import VOCAB, backend_skip, transformers  # noqa: E402
from tests.hf_tiny import ids as _ids  # noqa: E402

TWO_LAYERS = {"gemma2", "gemma3_text", "qwen2"}  # a windowed layer and a global one; the others need one layer
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
            bos_token_id=2)
WINDOW = 3  # in reach of the 9-token rows: the window changes the result
CONFIGS = {  # model_type -> (config class, model class, overrides)
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=WINDOW)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1)),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(partial_rotary_factor=0.5)),
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM, {}),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               dict(sliding_window=WINDOW, query_pre_attn_scalar=16, attn_logit_softcapping=5.0,
                    final_logit_softcapping=3.0)),
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
                    dict(sliding_window=WINDOW, query_pre_attn_scalar=16, rope_local_base_freq=100.0)),
    "gpt_neox": (transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM,
                 dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                      use_parallel_residual=True, hidden_act="gelu")),
    "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel,
             dict(n_embd=32, n_head=4, n_positions=64, n_inner=48, activation_function="gelu_new",
                  attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)),  # its dropouts default to 0.1
}
BACKENDS = ("cpu", "cuda", "neuron")
# norm calls per forward (in pre-norm layers the post-attention norm is add_rmsnorm's)
NORMS = {"llama": 1, "mistral": 1, "qwen2": 1, "mixtral": 1, "qwen3_moe": 3, "qwen3": 3, "phi3": 1, "olmo2": 4,
         "gemma2": 4, "gemma3_text": 6, "gpt_neox": 2, "gpt2": 2}  # per layer; the final norm adds one
NORM_OP = {"gpt_neox": "layernorm", "gpt2": "layernorm"}
MLP_OP = {"gemma2": "gelu", "gemma3_text": "gelu", "gpt_neox": "gelu", "gpt2": "gelu", "mixtral": None, "qwen3_moe": None}
MOE = {"mixtral", "qwen3_moe"}  # their MLPs are routed experts: topk_router and moe_experts per layer
LEARNED_POSITIONS = {"gpt2"}  # position embeddings added at the input: no rope; padded rows need position_ids


def _model(family: str):
    cfg_cls, model_cls, extra = CONFIGS[family]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**{**TINY, "num_hidden_layers": _layers(family), **extra})).eval()
    with torch.no_grad():  # norm weights away from their init (zeros for Gemma's 1 + weight): the offset matters
        for name, p in model.named_parameters():
            if "norm" in name and p.ndim == 1 and not name.endswith("bias"):
                p.normal_(0.0 if "gemma" in family else 1.0, 0.3)
    return model


FORWARD_OPS = ("rmsnorm", "layernorm", "rope", "attention", "varlen_attention", "topk_router", "moe_experts")
BACKWARD_OPS = FORWARD_OPS + ("linear_cross_entropy", *(f"{op}_backward" for op in FORWARD_OPS + ("linear_cross_entropy",)))


def _layers(family: str) -> int:
    return 2 if family in TWO_LAYERS else 1


def _skip(backend: str, ops):
    why = backend_skip(backend, ops)
    if why:
        pytest.skip(why)


def _ran(model) -> dict:
    counts = stats(model, reset=True)
    assert not any(c["handed_back"] for c in counts.values()), counts
    return {op: c["opport"] for op, c in counts.items() if c["opport"]}


def test_every_family_has_a_tiny_model_here():
    assert set(CONFIGS) == set(FAMILIES)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", CONFIGS)
def test_logits_match_and_every_call_runs_opport(family, backend):
    _skip(backend, FORWARD_OPS)
    model, x = _model(family), _ids()
    with torch.no_grad():
        want = model(x).logits
    patch(model)
    with opport.use_backend(backend), opport.strict(), torch.no_grad():
        got = model(x).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    ran = _ran(model)
    fused = "add_rmsnorm" if FAMILIES[family].pre_norm_layer else None
    n = _layers(family)
    mlp = {"topk_router": n, "moe_experts": n} if family in MOE else {MLP_OP.get(family, "swiglu"): n}
    rope = {} if family in LEARNED_POSITIONS else {"rope": n}  # no gradients: q and k in one call
    want_ran = {NORM_OP.get(family, "rmsnorm"): NORMS[family] * n + 1, **mlp, **rope, "attention": n,
                **({fused: n} if fused else {})}
    assert ran == want_ran


def _train(model, x, steps: int = 5) -> list:
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", CONFIGS)
def test_five_adamw_steps_track_the_unpatched_model(family, backend):
    _skip(backend, BACKWARD_OPS)
    x = _ids(batch=1, seq=6)
    want = _train(_model(family), x)
    model = _model(family)
    patch(model)
    with opport.use_backend(backend), opport.strict():
        got = _train(model, x)
    assert want[-1] < want[0]
    rel = [abs(g - w) / abs(w) for g, w in zip(got, want)]
    assert max(rel) <= 1e-5, rel
    assert _ran(model)["linear_cross_entropy"] == 5  # the loss (Gemma2's with its final soft cap) through opport


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", CONFIGS)
def test_greedy_generate_is_token_identical(family, backend):
    _skip(backend, FORWARD_OPS)
    model, x = _model(family), _ids(batch=1, seq=4)
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = model.generate(x, **kw)
    patch(model)
    with opport.use_backend(backend), opport.strict():
        got = model.generate(x, **kw)
    assert torch.equal(got, want)
    new = got.shape[1] - x.shape[1]  # a forward per new token (the prefill, then decode steps); EOS may stop it early
    assert new >= 2 and _ran(model)["attention"] == new * _layers(family)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", CONFIGS)
def test_padded_batch_equals_its_rows_alone(family, backend):
    _skip(backend, FORWARD_OPS)
    model = _model(family)
    patch(model)
    x = _ids(batch=2, seq=7)
    mask = torch.ones_like(x)
    mask[0, :3] = 0  # row 0 left-padded by 3
    with opport.use_backend(backend), opport.strict(), torch.no_grad():
        # learned positions count from each row's first token, as generate passes them; rope families need none
        pos = dict(position_ids=(mask.cumsum(-1) - 1).clamp(min=0)) if family in LEARNED_POSITIONS else {}
        batch = model(x.masked_fill(mask == 0, 0), attention_mask=mask, **pos).logits
        alone = [model(x[:1, 3:]).logits[0], model(x[1:]).logits[0]]
    torch.testing.assert_close(batch[0, 3:], alone[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batch[1], alone[1], rtol=1e-5, atol=1e-5)
    assert _ran(model)["varlen_attention"] == _layers(family)  # the padded batch ran varlen_attention, nothing handed back


def test_the_docs_print_the_family_table():
    from pathlib import Path

    from opport.integrations.transformers.families import table_rows

    doc = (Path(__file__).resolve().parents[1] / "docs" / "integration.md").read_text()
    for model_type, prefix, norm, layer, head in table_rows():
        assert f"| `{model_type}` | `{prefix}*` | {norm} | {layer} | {head} |" in doc, model_type


def _sft_losses(patched: bool, padding_free: bool, tmp_path) -> tuple:
    datasets, trl = pytest.importorskip("datasets"), pytest.importorskip("trl")
    from tokenizers import Tokenizer, models

    model = _model("qwen3")
    if patched:
        patch(model)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                               pad_token="t0", eos_token="t1", bos_token="t2", unk_token="t0")
    rows = [{"input_ids": _ids(batch=1, seq=n, seed=n)[0].tolist()} for n in (5, 7, 4, 6)]
    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3, learning_rate=1e-3,
                         logging_steps=1, report_to=[], padding_free=padding_free, use_cpu=True, save_strategy="no",
                         seed=0, max_length=None if padding_free else 64, disable_tqdm=True, bf16=False, fp16=False)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=tok)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HandBackWarning)  # the head's, counted below
        trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], model


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "padding_free"])
def test_trl_sft_trainer_gives_the_unpatched_losses(padding_free, tmp_path):
    """TRL's SFTTrainer, padded batches and padding-free (packed rows with position_ids): the same logged losses;
    its batches run varlen_attention and every layer through opport. TRL scores tokens with its fused LM head and
    asks it for `is_top1` (token accuracy), a field linear_logprobs does not compute: the head is handed back to
    TRL's own kernel, counted under its cause (and refused under strict(), as every hand-back)."""
    from opport.integrations.transformers import stats

    want, _ = _sft_losses(False, padding_free, tmp_path / "a")
    got, model = _sft_losses(True, padding_free, tmp_path / "b")
    assert len(got) == 3 and got == pytest.approx(want, rel=1e-5)
    counts = stats(model)
    assert counts["varlen_attention"]["opport"] >= 3 * _layers("qwen3")  # every step: padded or packed batches
    assert counts["linear_logprobs"]["reasons"] == {"head_metrics": counts["linear_logprobs"]["handed_back"]} != {}
    assert not any(c["handed_back"] for op, c in counts.items() if op != "linear_logprobs")


def test_lora_gradient_checkpointing_and_torch_compile(tmp_path):
    """PEFT LoRA adapters on the projections of a patched model, with gradient checkpointing: five AdamW steps
    track the unpatched model's; the patched model compiles with fullgraph=True (no graph break from opport)."""
    peft = pytest.importorskip("peft")

    def lora(patched: bool):
        model = _model("gemma2")
        if patched:
            patch(model)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)
        return peft.get_peft_model(model, config)

    x = _ids(batch=1, seq=6)
    want = _train(lora(False), x)
    model = lora(True)
    with opport.strict():
        got = _train(model, x)
    assert max(abs(g - w) / abs(w) for g, w in zip(got, want)) <= 1e-5
    assert _ran(model)["linear_cross_entropy"] == 5
    model.eval()
    with torch.no_grad():
        eager = model(x).logits
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(x).logits
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_gemma_bfloat16_runs_every_norm_and_is_as_accurate_as_its_own(family):
    """bfloat16 Gemma: the (1 + weight) norms run opport.rmsnorm's offset (1 + w in float32, as the model forms
    it), nothing handed back, and the logits are at most 1.5x as far (norm-wise) from a float64 run of the model
    as its own bfloat16 logits."""
    x = _ids()
    with torch.no_grad():
        exact = _model(family).double()(x).logits
        model = _model(family).to(torch.bfloat16)
        hf_err = ((model(x).logits.double() - exact).norm() / exact.norm()).item()
        patch(model)
        with opport.strict():
            got = model(x).logits
    assert ((got.double() - exact).norm() / exact.norm()).item() <= 1.5 * hf_err
    assert _ran(model)["rmsnorm"] == NORMS[family] * _layers(family) + 1
