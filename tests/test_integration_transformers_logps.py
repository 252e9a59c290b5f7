"""completion_logps: a causal LM's per-token log-probabilities of its own tokens without the [B, S, V] logits, equal
to the logits path (log_softmax(logits / T) at the next tokens) in values and in the gradients a DPO step takes,
patched (strict) and unpatched, with Gemma2's final soft cap and a padded batch."""

from __future__ import annotations

import importlib.util
import warnings

import pytest

import opport

torch = pytest.importorskip("torch")
if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers is not installed", allow_module_level=True)

from opport import losses  # noqa: E402
from opport.integrations.transformers import patch  # noqa: E402
from opport.losses import completion_logps  # noqa: E402
from tests.test_integration_transformers_families import _ids, _model  # noqa: E402

T = 0.7


def _batch():
    x = _ids(batch=2, seq=7)
    mask = torch.ones_like(x)
    mask[1, 5:] = 0  # row 1 right-padded by 2
    return x.masked_fill(mask == 0, 0), mask


def _logits_path(model, x, mask):
    logits = model(x, attention_mask=mask).logits[:, :-1] / T
    logp = torch.log_softmax(logits.float(), -1).gather(2, x[:, 1:, None])[..., 0]
    return logp.masked_fill(mask[:, 1:] == 0, 0.0)


@pytest.mark.parametrize("patched", [False, True], ids=["unpatched", "patched"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_values_and_dpo_gradients_equal_the_logits_path(family, patched):
    x, mask = _batch()
    got, want = [], []
    for ours, out in ((True, got), (False, want)):
        model = _model(family).train()
        if patched:
            patch(model)
        with opport.strict() if patched and ours else torch.enable_grad():
            logp = completion_logps(model, x, mask, temperature=T) if ours else _logits_path(model, x, mask)
            seq = losses.sequence_logps(logp, mask[:, 1:].float())
            losses.dpo_loss(seq[:1], seq[1:], torch.zeros(1), torch.zeros(1), beta=0.5).backward()
        out += [logp.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}]
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        scale = want[1][name].abs().max().item() or 1.0
        torch.testing.assert_close(got[1][name], want[1][name], rtol=1e-4, atol=1e-5 * scale, msg=name)


def _tokenizer():
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(97)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="t0", eos_token="t1", bos_token="t2",
                                                unk_token="t0")


def _dpo_losses(patched: bool, tmp_path) -> tuple:
    datasets, trl = pytest.importorskip("datasets"), pytest.importorskip("trl")
    model, ref = _model("qwen3"), _model("qwen3")
    if patched:
        patch(model)
        patch(ref)
    text = lambda ids: " ".join(f"t{i}" for i in ids)  # noqa: E731
    rows = [{"prompt": text([3 + i, 5, 7]), "chosen": text([10 + i, 11, 1]), "rejected": text([20 + i, 1])}
            for i in range(4)]
    args = trl.DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, learning_rate=1e-3,
                         logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True,
                         bf16=False, fp16=False)
    trainer = trl.DPOTrainer(model=model, ref_model=ref, args=args,
                             train_dataset=datasets.Dataset.from_list(rows), processing_class=_tokenizer())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], model, ref, seen


def test_trl_dpo_trainer_gives_the_unpatched_losses(tmp_path):
    """TRL's DPOTrainer on patched Qwen3 policy and reference models: the unpatched models' losses; every layer's
    norms, MLP and (padded-batch) attention through opport, the reference model's log-probs through
    opport.linear_logprobs (TRL's fused head), and the policy's head handed back, counted and warned about: TRL asks
    it for no-gradient metrics (mean_logits, is_top1) linear_logprobs does not compute."""
    from opport.integrations.transformers import HandBackWarning, stats

    want, *_ = _dpo_losses(False, tmp_path / "a")
    got, model, ref, seen = _dpo_losses(True, tmp_path / "b")
    assert len(got) == 2 and got == pytest.approx(want, rel=1e-5)
    counts, ref_counts = stats(model), stats(ref)
    assert counts["varlen_attention"]["opport"] > 0 and ref_counts["linear_logprobs"]["opport"] > 0
    assert counts["linear_logprobs"]["reasons"] == {"head_metrics": counts["linear_logprobs"]["handed_back"]} != {}
    assert not any(c["handed_back"] for op, c in counts.items() if op != "linear_logprobs")
    assert not any(c["handed_back"] for c in ref_counts.values())
    assert sum("[transformers.linear_logprobs.head_metrics]" in str(w.message) for w in seen
               if issubclass(w.category, HandBackWarning)) == 1


def _grpo_log(patched: bool, tmp_path) -> tuple:
    datasets, trl = pytest.importorskip("datasets"), pytest.importorskip("trl")
    model = _model("qwen3")
    if patched:
        patch(model)
    rows = [{"prompt": " ".join(f"t{3 + i + j}" for j in range(2 + i % 3))} for i in range(4)]  # 2-4 tokens
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                          max_completion_length=4, max_steps=2, learning_rate=1e-3, logging_steps=1, report_to=[],
                          use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True, bf16=False, fp16=False,
                          beta=0.0)
    trainer = trl.GRPOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                              processing_class=_tokenizer(),
                              reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions])
    with opport.strict() if patched else torch.enable_grad():
        trainer.train()
    keys = ("loss", "grad_norm", "reward")
    return [tuple(h[k] for k in keys) for h in trainer.state.log_history if "loss" in h], model


def test_trl_grpo_trainer_samples_and_steps_like_the_unpatched_model(tmp_path):
    """TRL's GRPOTrainer (sampling with the model's generate from left-padded prompts of 2-4 tokens, then the clipped
    policy loss) on a patched Qwen3 in strict mode: the same rewards (the same samples), losses and gradient norms
    as the unpatched model's."""
    from opport.integrations.transformers import stats

    want, _ = _grpo_log(False, tmp_path / "a")
    got, model = _grpo_log(True, tmp_path / "b")
    assert len(got) == 2
    for g, w in zip(got, want):
        assert g == pytest.approx(w, rel=1e-4, abs=1e-6)
    assert any(w[1] > 0 for w in want)  # a step that moved the weights
    counts = stats(model)
    assert counts["varlen_attention"]["opport"] > 0 and not any(c["handed_back"] for c in counts.values())
    assert counts["linear_logprobs"]["opport"] > 0  # TRL's fused head: log-probs and entropies without logits


@pytest.mark.parametrize("backend", ["cpu", "cuda", "neuron"])
@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_trl_fused_head_runs_linear_logprobs_with_the_same_values_and_gradients(family, backend):
    """TRL's fused LM head on a patched model (strict): opport.linear_logprobs on each backend gives TRL's own head's
    log-probs and entropies (Gemma2: with its final soft cap) and the same gradients for a GRPO-like loss that weights
    every token and adds an entropy bonus; the model's head never forms [B, S, V] logits."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    from opport.integrations.transformers import stats

    x, mask = _batch()
    labels = x.masked_fill(mask == 0, -100)
    weights = torch.linspace(-1.0, 2.0, x.shape[1] - 1)

    def run(patched):
        model = _model(family).train()
        if patched:
            patch(model)
        trl_utils.add_fused_lm_head(model, temperature=T, outputs=("log_probs", "entropy"))
        with opport.use_backend(backend), opport.strict() if patched else torch.enable_grad():
            out = model(x, attention_mask=mask, labels=labels, fused_lm_head=True)
            loss = (out.log_probs * weights).sum() + 0.1 * out.entropy.sum()
            loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        return out.log_probs.detach(), out.entropy.detach(), grads, model

    lp0, ent0, g0, _ = run(False)
    lp1, ent1, g1, model = run(True)
    torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent1, ent0, rtol=1e-5, atol=1e-5)
    assert g1.keys() == g0.keys()
    for name in g0:
        scale = g0[name].abs().max().item() or 1.0
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-5 * scale, msg=name)
    assert stats(model)["linear_logprobs"]["opport"] == 1
