"""opport.losses against straightforward float64 torch implementations written here from the papers' formulas (and
TRL's aggregation rules), on NumPy, torch and JAX inputs; gradients through token_logps against torch's own
logits -> log_softmax -> gather, from arbitrary per-token upstream gradients (the reduction='none' gradient bug
class)."""

from __future__ import annotations

import numpy as np
import pytest

import opport
from opport import losses

torch = pytest.importorskip("torch")
F = torch.nn.functional
RNG = np.random.default_rng(0)
B, S = 4, 6


def _as(kind: str, x: np.ndarray):
    if kind == "numpy":
        return x
    if kind == "torch":
        return torch.from_numpy(x)
    jnp = pytest.importorskip("jax.numpy")
    import jax

    jax.config.update("jax_enable_x64", True)
    return jnp.asarray(x)


def _num(x) -> float:
    return float(np.asarray(x))


def _pairs():
    return [RNG.normal(-8, 2, B) for _ in range(4)]


# --------------------------------------------------------------------------- references (plain torch, float64)


def _dpo_ref(pc, pr, rc, rr, beta, eps):
    h = beta * ((pc - pr) - (rc - rr))
    return (-(1 - eps) * F.logsigmoid(h) - eps * F.logsigmoid(-h)).mean()


def _simpo_ref(c, r, beta, gamma):
    return (-F.logsigmoid(beta * (c - r) - gamma)).mean()


def _orpo_ref(c, r, nll, beta):
    odds_c, odds_r = c.exp() / (1 - c.exp()), r.exp() / (1 - r.exp())
    return (nll - beta * F.logsigmoid(torch.log(odds_c) - torch.log(odds_r))).mean()


def _policy_ref(logp, old, adv, mask, ref, beta, eps_lo, eps_hi, loss_type, max_len):
    total = torch.zeros((), dtype=torch.float64)
    per_seq, tokens = [], 0
    for b in range(logp.shape[0]):
        seq = torch.zeros((), dtype=torch.float64)
        for t in range(logp.shape[1]):
            if mask[b, t] == 0:
                continue
            r = torch.exp(logp[b, t] - old[b, t])
            term = -torch.min(r * adv[b], torch.clamp(r, 1 - eps_lo, 1 + eps_hi) * adv[b])
            if beta:
                term = term + beta * (torch.exp(ref[b, t] - logp[b, t]) - (ref[b, t] - logp[b, t]) - 1)
            seq, tokens = seq + term, tokens + 1
        per_seq.append(seq / mask[b].sum())
        total = total + seq
    if loss_type == "grpo":
        return torch.stack(per_seq).mean()
    return total / tokens if loss_type == "dapo" else total / (logp.shape[0] * max_len)


# --------------------------------------------------------------------------- the losses


@pytest.mark.parametrize("kind", ["numpy", "torch", "jax"])
def test_dpo_simpo_orpo_match_the_formulas(kind):
    pc, pr, rc, rr = _pairs()
    t = [torch.from_numpy(a) for a in (pc, pr, rc, rr)]
    got = losses.dpo_loss(*(_as(kind, a) for a in (pc, pr, rc, rr)), beta=0.3, label_smoothing=0.1)
    assert _num(got) == pytest.approx(_dpo_ref(*t, 0.3, 0.1).item(), rel=1e-12)
    c, r = (np.log(RNG.uniform(0.05, 0.6, B)) for _ in range(2))  # length-averaged: p in (0, 1)
    nll = RNG.uniform(1, 3, B)
    got = losses.simpo_loss(_as(kind, c), _as(kind, r), beta=2.5, gamma=0.7)
    assert _num(got) == pytest.approx(_simpo_ref(torch.from_numpy(c), torch.from_numpy(r), 2.5, 0.7).item(), rel=1e-12)
    got = losses.orpo_loss(_as(kind, c), _as(kind, r), _as(kind, nll), beta=0.2)
    want = _orpo_ref(*(torch.from_numpy(a) for a in (c, r, nll)), 0.2).item()
    assert _num(got) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("kind", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("loss_type", losses.LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_policy_loss_matches_a_token_loop(kind, loss_type, beta):
    logp, old, ref = (RNG.normal(-2, 0.5, (B, S)) for _ in range(3))
    old = logp + RNG.normal(0, 0.3, (B, S))  # ratios on both sides of the clip range
    adv = RNG.normal(0, 1, B)
    mask = (RNG.uniform(size=(B, S)) < 0.7).astype(np.float64)
    mask[:, 0] = 1
    args = [logp, old, adv, mask, ref]
    got = losses.policy_loss(*(_as(kind, a) for a in args), beta=beta, epsilon=0.2, epsilon_high=0.28,
                             loss_type=loss_type, max_completion_length=8)
    want = _policy_ref(*(torch.from_numpy(a) for a in args), beta, 0.2, 0.28, loss_type, 8)
    assert _num(got) == pytest.approx(want.item(), rel=1e-12)


def test_dpo_gradients_are_torchs():
    pc, pr, rc, rr = (torch.from_numpy(a).requires_grad_() for a in _pairs())
    losses.dpo_loss(pc, pr, rc.detach(), rr.detach(), beta=0.5).backward()
    mine = (pc.grad.clone(), pr.grad.clone())
    pc.grad = pr.grad = None
    _dpo_ref(pc, pr, rc.detach(), rr.detach(), 0.5, 0.0).backward()
    torch.testing.assert_close(mine, (pc.grad, pr.grad), rtol=1e-12, atol=0)


# --------------------------------------------------------------------------- token_logps


def _lm(n=10, h=16, v=40, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(n, h, generator=g, dtype=dtype)
    weight = torch.randn(v, h, generator=g, dtype=dtype) * 0.5
    bias = torch.randn(v, generator=g, dtype=dtype)
    target = torch.randint(0, v, (n,), generator=g)
    target[3] = -100
    return hidden, weight, bias, target


def test_token_logps_are_log_softmax_at_the_target_under_the_temperature():
    hidden, weight, bias, target = _lm()
    got = losses.token_logps(hidden, weight, target, bias, temperature=0.7)
    logp = F.log_softmax((hidden @ weight.T + bias) / 0.7, -1)
    want = logp.gather(1, target.clamp(min=0)[:, None])[:, 0].masked_fill(target == -100, 0.0)
    assert got.dtype == torch.float32  # linear_cross_entropy's loss dtype: float64 math, a float32 result
    torch.testing.assert_close(got.double(), want, rtol=2e-7, atol=2e-7)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_per_token_weighted_gradients_match_torchs_logits_path(dtype):
    """Arbitrary per-token weights on the log-probabilities (an advantage per token): dhidden and dweight equal
    torch's through the full logits, so neither an upstream gradient broadcast to every token nor a dropped
    per-token weight can pass."""
    hidden, weight, bias, target = _lm(dtype=dtype)
    w = torch.linspace(-2, 3, len(target), dtype=dtype)
    grads = []
    for ours in (True, False):
        h, wt = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if ours:
            logp = losses.token_logps(h, wt, target, bias, temperature=1.3)
        else:
            full = F.log_softmax((h @ wt.T + bias) / 1.3, -1)
            logp = full.gather(1, target.clamp(min=0)[:, None])[:, 0].masked_fill(target == -100, 0.0)
        (w * logp).sum().backward()
        grads.append((h.grad, wt.grad))
    tol = 1e-6 if dtype == torch.float64 else 2e-5  # float64 gradients from the op's float32 log-probabilities
    torch.testing.assert_close(grads[0], grads[1], rtol=tol, atol=tol)


def test_dpo_through_token_logps_trains_like_torch():
    """A DPO step end to end: chosen and rejected completions' sequence log-probabilities from token_logps (no
    logits held), the loss, its gradient w.r.t. the policy's hidden states and head: as torch's."""
    hidden, weight, bias, target = _lm(n=2 * B * 3, h=8, v=24)
    mask = torch.ones(2 * B, 3, dtype=torch.float64)
    ref = torch.randn(2 * B, dtype=torch.float64)
    grads = []
    for ours in (True, False):
        h, wt = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if ours:
            logp = losses.token_logps(h, wt, target, bias)
        else:
            full = F.log_softmax(h @ wt.T + bias, -1)
            logp = full.gather(1, target.clamp(min=0)[:, None])[:, 0].masked_fill(target == -100, 0.0)
        seq = losses.sequence_logps(logp.view(2 * B, 3), mask)
        losses.dpo_loss(seq[:B], seq[B:], ref[:B], ref[B:], beta=0.2).backward()
        grads.append((h.grad, wt.grad))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-6, atol=1e-8)  # through float32 log-probabilities


# --------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize("call, constraint", [
    (lambda: losses.dpo_loss(*_pairs(), beta=0.0), "dpo_loss.beta"),
    (lambda: losses.dpo_loss(*_pairs(), label_smoothing=0.7), "dpo_loss.label_smoothing"),
    (lambda: losses.dpo_loss(*_pairs(), reduction="avg"), "dpo_loss.reduction"),
    (lambda: losses.simpo_loss(*_pairs()[:2], beta=True), "simpo_loss.beta"),
    (lambda: losses.policy_loss(*[np.zeros((B, S))] * 2, np.zeros(B), np.ones((B, S)), loss_type="ppo"),
     "policy_loss.loss_type"),
    (lambda: losses.policy_loss(*[np.zeros((B, S))] * 2, np.zeros(B), np.ones((B, S)), beta=0.1),
     "policy_loss.ref_logps"),
    (lambda: losses.token_logps(np.zeros((2, 4), np.float32), np.zeros((3, 4), np.float32), np.zeros(2, np.int64),
                                temperature=0.0), "token_logps.temperature"),
])
def test_bad_arguments_are_typed_errors(call, constraint):
    with pytest.raises(opport.ArgumentError) as info:
        call()
    assert info.value.constraint == constraint


# --------------------------------------------------------------------------- linear_logprobs against torch


@pytest.mark.parametrize("backend", ["cpu", "cuda", "neuron"])
def test_linear_logprobs_values_and_gradients_equal_torch_logits_path(backend):
    """opport.linear_logprobs on each backend against log_softmax of torch's logits (Gemma-style cap, T = 0.8, an
    ignored token): both outputs, and the gradients of per-token weighted log-probs plus an entropy bonus (the
    three gradient bugs reported in fused losses each change these: per-token weights, the entropy term, and a
    broadcast upstream gradient)."""
    torch.manual_seed(0)
    n, h, v, t, cap = 12, 24, 300, 0.8, 5.0
    hidden = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(v, h, dtype=torch.float64) / h**0.5).requires_grad_()
    target = torch.randint(0, v, (n,))
    target[4] = -100
    adv, bonus = torch.randn(n), 0.05

    def torch_path():
        z = cap * torch.tanh((hidden @ weight.T) / cap) / t
        lp = torch.log_softmax(z, -1)
        kept = target != -100
        logp = torch.where(kept, lp.gather(1, target.clamp(min=0)[:, None])[:, 0], 0.0)
        ent = torch.where(kept, -(lp.exp() * lp).sum(-1), 0.0)
        return logp, ent

    def opport_path():
        with opport.use_backend(backend), opport.strict():
            logp, ent = opport.linear_logprobs(hidden.float(), weight.float(), target, temperature=t, softcap=cap)
        return logp.double(), ent.double()

    got, want = [], []
    for path, out in ((opport_path, got), (torch_path, want)):
        logp, ent = path()
        (dh, dw) = torch.autograd.grad((logp * adv.double()).sum() + bonus * ent.sum(), (hidden, weight))
        out.extend([logp.detach(), ent.detach(), dh, dw])
    for g, w, name in zip(got, want, ("logps", "entropy", "dhidden", "dweight")):
        torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-5 * (w.abs().max().item() or 1.0), msg=name)
    assert got[0][4] == 0 and got[1][4] == 0


def test_the_three_reported_gradient_bugs_are_caught_by_the_gate():
    """The mutants standing for the bugs users reported in fused log-prob losses (per-token upstream gradients lost
    under reduction='none', a dropped entropy gradient, one upstream gradient broadcast to every token) and a
    temperature left out of the chain rule: each fails some linear_logprobs_backward case."""
    from opport.conformance import mutants

    kills = mutants.self_test(ops=["linear_logprobs"], examples=0)
    for name in ("per-token-grads-as-ones", "entropy-grad-dropped", "first-grad-broadcast",
                 "temperature-left-out-of-grad"):
        assert kills[("linear_logprobs_backward", name)] is not None, name
