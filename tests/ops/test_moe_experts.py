"""moe_experts: the float64 reference and its VJP against transformers' own Qwen3MoeExperts loop (torch autograd)."""

from __future__ import annotations

import numpy as np
import pytest

from opport.ops.moe_experts import moe_experts as spec

CASES = ("small", "ragged-groups", "duplicates-signed-weights", "k-equals-e", "t-one", "all-to-one-expert")


def _transformers_experts(w1, w2):
    torch = pytest.importorskip("torch")
    modeling = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    from types import SimpleNamespace

    e, two_i, h = w1.shape
    config = SimpleNamespace(num_experts=e, hidden_size=h, moe_intermediate_size=two_i // 2, hidden_act="silu",
                             _experts_implementation="eager")
    module = modeling.Qwen3MoeExperts(config).to(torch.float64)
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.from_numpy(w1))
        module.down_proj.copy_(torch.from_numpy(w2))
    return module


@pytest.mark.parametrize("name", CASES)
def test_reference_and_vjp_are_transformers_loop(name):
    """Forward and every gradient of the reference equal transformers' eager loop in float64 (its autograd for the
    gradients): the layout, the gate/up split, the router weight and duplicate picks counted twice."""
    torch = pytest.importorskip("torch")
    case = next(c for c in spec.get_cases("float64") if c.name == name)
    x, w1, w2, idx, w = case.args
    module = _transformers_experts(w1, w2)
    xt = torch.from_numpy(x.copy()).requires_grad_()
    wt = torch.from_numpy(w.copy()).requires_grad_()
    out = module(xt, torch.from_numpy(idx.astype(np.int64)), wt)
    np.testing.assert_allclose(spec.run_reference(*case.args), out.detach().numpy(), rtol=1e-12, atol=1e-12)
    grad = np.random.default_rng(0).standard_normal(x.shape)
    out.backward(torch.from_numpy(grad))
    want = (xt.grad, module.gate_up_proj.grad, module.down_proj.grad, wt.grad)
    got = spec.backward_op.run_reference(grad, *case.args)
    for label, g, t in zip(("dx", "dgate_up_proj", "ddown_proj", "dtop_k_weights"), got, want):
        t = np.zeros(g.shape) if t is None else t.numpy()
        np.testing.assert_allclose(g, t, rtol=1e-10, atol=1e-12, err_msg=label)


def test_unpicked_experts_are_never_read():
    """NaN in an expert no token picks reaches neither the output nor any gradient; its gradients are exactly 0."""
    case = next(c for c in spec.get_cases("float32") if c.name == "ragged-groups")
    x, w1, w2, idx, w = case.args
    unused = sorted(set(range(w1.shape[0])) - set(np.unique(idx).tolist()))
    w1, w2 = w1.copy(), w2.copy()
    w1[unused], w2[unused] = np.nan, np.nan
    import opport

    out = opport.moe_experts(x, w1, w2, idx, w, backend="cpu")
    assert np.isfinite(out).all()
    dx, dw1, dw2, dw = spec.backward_op.run_reference(np.ones_like(x, np.float64), *(a.astype(np.float64)
                                                      if a.dtype.kind == "f" else a for a in (x, w1, w2, idx, w)))
    assert np.isfinite(dx).all() and np.isfinite(dw).all()
    assert not dw1[unused].any() and not dw2[unused].any()
