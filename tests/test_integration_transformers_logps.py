"""completion_logps: a causal LM's per-token log-probabilities of its own tokens without the [B, S, V] logits, equal
to the logits path (log_softmax(logits / T) at the next tokens) in values and in the gradients a DPO step takes,
patched (strict) and unpatched, with Gemma2's final soft cap and a padded batch."""

from __future__ import annotations

import importlib.util

import pytest

import opport

torch = pytest.importorskip("torch")
if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers is not installed", allow_module_level=True)

from opport import losses  # noqa: E402
from opport.integrations.transformers import completion_logps, patch  # noqa: E402
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
