"""Training through opport: `loss.backward()` and `jax.grad` give the gradients of torch's and JAX's own
functions in float64 (eager and compiled), and a tiny Llama trains with opport's ops as it does without.

The torch/JAX functions below are written from the op contract (docs/design.md section 1), independently of
opport's references; the comparison uses the op's own gradient tolerances (docs/numerics.md 3.6).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import opport
from opport.accuracy import compare
from opport.bench.workloads import grouped_matmul as grouped_matmul_workload
from opport.bench.workloads import linear_logprobs as linear_logprobs_workload
from opport.bench.workloads import moe_experts as moe_experts_workload
from opport.bench.workloads import moe_permute as moe_permute_workload
from opport.bench.workloads import moe_unpermute as moe_unpermute_workload
from opport.dispatch import backends, get_backend, impl, kernels
from opport.integrations import small_cases
from opport.ops import builtin_ops
from opport.public import function

torch = pytest.importorskip("torch")
F = torch.nn.functional
DIFFERENTIABLE = sorted(n for n, s in opport.all_ops().items() if s.backward_op is not None)


def _attention_torch(q, k, v, causal, scale, softcap=None, sliding_window=None):
    hq, hkv, sq, sk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:  # Gemma 2: on the scaled scores
        s = softcap * torch.tanh(s / softcap)
    if causal:  # bottom-right aligned: query i sees key j iff j <= i + sk - sq (and j > that - W in a window)
        last = torch.arange(sq)[:, None] + sk - sq
        seen = torch.arange(sk)[None, :] <= last
        if sliding_window is not None:
            seen &= torch.arange(sk)[None, :] > last - sliding_window
        s = s.masked_fill(~seen, float("-inf"))
    any_seen = torch.isfinite(s).any(-1, keepdim=True)
    p = torch.softmax(torch.where(any_seen, s, torch.zeros_like(s)), -1) * any_seen  # rows seeing no key: 0
    return p @ v


def _varlen_attention_torch(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, softcap=None, sliding_window=None):
    """Each packed sequence through `_attention_torch` alone ([T, H, D] slices as [1, H, T, D])."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    heads = lambda x: x.transpose(0, 1)[None]  # noqa: E731
    outs = [_attention_torch(heads(q[a:b]), heads(k[c:e]), heads(v[c:e]), causal, scale, softcap, sliding_window)[0]
            .transpose(0, 1) for a, b, c, e in zip(cq, cq[1:], ck, ck[1:])]
    return torch.cat(outs) if outs else q.new_zeros((0, q.shape[1], v.shape[2])) + 0 * v.sum()


def _linear_cross_entropy_torch(hidden, weight, target, bias, ii, red, ls, softcap):
    z = hidden @ weight.T if bias is None else hidden @ weight.T + bias
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return F.cross_entropy(z, target.long(), ignore_index=ii, reduction=red, label_smoothing=ls)


def _rope_torch(x, cos, sin, interleaved):
    c, s = (t[None, None] if t.ndim == 2 else t[:, None] for t in (cos, sin))
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), -1).flatten(-2)
    x1, x2 = x.chunk(2, -1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)


def _add_rmsnorm_torch(x, residual, w, eps):
    s = x + residual
    return F.rms_norm(s, s.shape[-1:], w, eps), s


def _topk_router_torch(logits, k, renormalize, scoring, bias):
    """The router with opport's stable order (torch.topk's order of ties is unspecified): descending rank key, ties to
    the lowest expert; the weights are the chosen scores (renormalised), differentiable in the logits."""
    s = torch.softmax(logits, -1) if scoring == "softmax" else torch.sigmoid(logits)
    key = logits if scoring == "softmax" or bias is None else s + bias
    index = torch.sort(key.detach(), dim=-1, descending=True, stable=True).indices[:, :k]
    w = s.gather(-1, index)
    return (w / w.sum(-1, keepdim=True) if renormalize else w), index.to(torch.int32)


TORCH = {
    "softmax": lambda x, axis: torch.softmax(x, axis),
    "rmsnorm": lambda x, w, eps, offset: F.rms_norm(x, x.shape[-1:], w if w is None else offset + w, eps),
    "add_rmsnorm": _add_rmsnorm_torch,
    "layernorm": lambda x, w, b, eps: F.layer_norm(x, x.shape[-1:], w, b, eps),
    "gelu": lambda x, approximate: F.gelu(x, approximate=approximate),
    "silu": lambda x: F.silu(x),
    "swiglu": lambda gate, up: F.silu(gate) * up,
    "rope": _rope_torch,
    "matmul": lambda a, b, bias: a @ b if bias is None else a @ b + bias,
    "attention": _attention_torch,
    "varlen_attention": _varlen_attention_torch,
    "cross_entropy": lambda logits, target, ii, red, ls: F.cross_entropy(logits, target, ignore_index=ii,
                                                                          reduction=red, label_smoothing=ls),
    "linear_cross_entropy": _linear_cross_entropy_torch,
    "linear_logprobs": linear_logprobs_workload.torch_eager,  # log_softmax of the logits, gathered; entropy from it
    # the MoE ops: the torch code of their bench baselines (transformers' loops and compositions)
    "topk_router": _topk_router_torch,
    "moe_permute": moe_permute_workload.torch_eager,
    "moe_unpermute": moe_unpermute_workload.torch_eager,
    "grouped_matmul": grouped_matmul_workload.per_expert_linear,
    "moe_experts": moe_experts_workload.transformers_loop,
}


def test_every_differentiable_op_has_a_torch_function():
    """opport's own ops, that is: an op another package declares has no function here to be compared with."""
    assert set(TORCH) == {n for n, s in builtin_ops().items() if s.backward_op is not None}


def _float_inputs(spec, bound) -> list:
    """Positions of the arrays gradients are taken for: the op's differentiable inputs that are given."""
    return [spec.params.index(n) for n in spec.backward_op.wrt if bound[spec.params.index(n)] is not None]


def _torch_bound(case, requires_grad: list) -> tuple:
    out = []
    for i, a in enumerate(case):
        if isinstance(a, np.ndarray):
            t = torch.from_numpy(a.copy())
            out.append(t.requires_grad_() if i in requires_grad else t)
        else:
            out.append(a)
    return tuple(out)


def _judge(spec, grads, want, what: str):
    __tracebackhide__ = True
    bwd = spec.backward_op
    for name, g, w in zip([n for n in bwd.wrt], grads, want):
        i = bwd.wrt.index(name)
        verdict = compare(g.detach().numpy(), w.detach().numpy(), bwd.tolerance_for("float64", i), "float64")
        assert verdict.ok, f"{spec.name} {what}: d{name}: {verdict.message}"


def _outs(out) -> tuple:
    """An op's floating outputs as a tuple (add_rmsnorm returns two; topk_router's indices take no gradient)."""
    return tuple(o for o in (out if isinstance(out, tuple) else (out,))
                 if (o.is_floating_point() if isinstance(o, torch.Tensor) else np.dtype(o.dtype).kind in "fV"))


def _cases(spec, limit: int = 3):
    return [spec.bind(*c.args, **c.kwargs) for c in small_cases(spec, "float64", limit=limit)]


@pytest.mark.parametrize("name", sorted(TORCH))
def test_torch_backward_matches_torch_functions(name):
    spec, fn = opport.get_op(name), function(opport.get_op(name))
    for bound in _cases(spec):
        slots = _float_inputs(spec, bound)
        ours, theirs = _torch_bound(bound, slots), _torch_bound(bound, slots)
        out = _outs(fn(*ours, backend="cpu"))
        assert all(o.grad_fn is not None for o in out), f"{name}: no grad_fn"
        rng = np.random.default_rng(0)
        grad_out = [torch.from_numpy(rng.standard_normal(tuple(o.shape))) for o in out]
        got = torch.autograd.grad(out, [ours[i] for i in slots], grad_out)
        want = torch.autograd.grad(_outs(TORCH[name](*theirs)), [theirs[i] for i in slots], grad_out)
        _judge(spec, got, want, "eager")


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_torch_compiled_backward_matches_eager(name):
    spec, fn = opport.get_op(name), function(opport.get_op(name))
    bound = _cases(spec, limit=1)[0]
    slots = _float_inputs(spec, bound)
    arrays = _torch_bound(bound, slots)

    def loss(*tensors):
        full = list(bound)
        for i, t in zip(slots, tensors):
            full[i] = t
        for i, a in enumerate(arrays):
            if i not in slots and isinstance(a, torch.Tensor):
                full[i] = a
        return sum((o * 0.5).sum() for o in _outs(fn(*full)))

    leaves = [arrays[i] for i in slots]
    torch._dynamo.reset()  # `loss` is one code object for every op: a fresh cache per op, not recompiles
    eager = torch.autograd.grad(loss(*leaves), leaves)
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(*leaves), leaves)
    for c, e in zip(compiled, eager):
        assert torch.equal(c, e), f"{name}: compiled gradient differs from eager"


def test_double_backward_and_constant_gradients_are_refused():
    x, w = torch.randn(3, 8, requires_grad=True), torch.rand(8, requires_grad=True)
    (gx,) = torch.autograd.grad(opport.rmsnorm(x, w).sum(), x, create_graph=True)
    with pytest.raises(opport.UnsupportedError, match="double backward"):
        gx.sum().backward()
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    cos = torch.rand(4, 4, requires_grad=True)
    with pytest.raises(opport.UnsupportedError, match="no gradient for 'cos'") as info:
        opport.rope(q, cos, torch.rand(4, 4))
    assert info.value.arg == "cos"


def test_numpy_vjp_matches_torch():
    rng = np.random.default_rng(0)
    x, w, dy = rng.standard_normal((4, 16)), rng.random(16), rng.standard_normal((4, 16))
    out, pullback = opport.vjp("rmsnorm", x, w)
    dx, dw = pullback(dy)
    xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    want = torch.autograd.grad(F.rms_norm(xt, (16,), wt, 1e-6), (xt, wt), torch.tensor(dy))
    np.testing.assert_allclose(dx, want[0].numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dw, want[1].numpy(), rtol=1e-10, atol=1e-12)
    with pytest.raises(opport.ShapeError) as info:
        pullback(dy[:, :15])
    assert info.value.arg == "grad"


# --------------------------------------------------------------------------- JAX


jax = pytest.importorskip("jax")
jnp = jax.numpy
jax.config.update("jax_enable_x64", True)


@pytest.mark.parametrize("name", sorted(TORCH))
def test_jax_grad_matches_torch_functions(name):
    """jax.grad (eager and under jax.jit) through opport ops against torch's own functions' gradients."""
    spec, fn = opport.get_op(name), function(opport.get_op(name))
    bound = _cases(spec, limit=1)[0]
    slots = _float_inputs(spec, bound)
    theirs = _torch_bound(bound, slots)
    out = _outs(TORCH[name](*theirs))
    rng = np.random.default_rng(1)
    weights = [rng.standard_normal(tuple(o.shape)) for o in out]
    want = torch.autograd.grad(out, [theirs[i] for i in slots], [torch.from_numpy(w) for w in weights])

    def loss(*arrays):
        full = [jnp.asarray(a) if isinstance(a, np.ndarray) else a for a in bound]
        for i, a in zip(slots, arrays):
            full[i] = a
        return sum(jnp.sum(o * w) for o, w in zip(_outs(fn(*full, backend="cpu")), weights))

    leaves = [jnp.asarray(bound[i]) for i in slots]
    grad = jax.grad(loss, tuple(range(len(slots))))
    for how, g in (("eager", grad), ("jit", jax.jit(grad))):
        got = [torch.from_numpy(np.asarray(x)) for x in g(*leaves)]
        _judge(spec, got, want, f"jax {how}")


# --------------------------------------------------------------------------- a tiny Llama trains


transformers = pytest.importorskip("transformers")
TRAINED_OPS = ("rmsnorm", "add_rmsnorm", "swiglu", "rope", "attention", "cross_entropy")
TRAINING_BACKENDS = [b for b in backends() if all(kernels(opport.get_op(n).backward_op, get_backend(b))
                                                   for n in TRAINED_OPS if opport.get_op(n).backward_op)]


def _tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg).float()


def _train(model, steps: int, loss_fn, backend=None) -> list:
    from opport.integrations.transformers import patch

    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(5))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if backend is not None:
        patch(model)
    losses = []
    # strict: every forward and backward runs on `backend`'s own kernels (a fallback to cpu raises)
    ctx = opport.use_backend(backend) if backend else contextlib.nullcontext()
    strict = opport.strict() if backend else contextlib.nullcontext()
    with ctx, strict:
        for _ in range(steps):
            if loss_fn is None:  # the model's loss from labels (patched: opport.linear_cross_entropy)
                loss = model(ids, labels=ids).loss
            else:
                loss = loss_fn(model(ids).logits[:, :-1].reshape(-1, 101), ids[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss))
    return losses


def _opport_loss(logits, target):
    return opport.cross_entropy(logits, target)


@pytest.mark.parametrize("backend", TRAINING_BACKENDS)
def test_patched_tiny_llama_trains_like_the_unpatched_model(backend):
    """float32, six AdamW steps: every step's loss within 1e-3 (relative) of the unpatched model's."""
    want = _train(_tiny_llama(), 6, F.cross_entropy)
    got = _train(_tiny_llama(), 6, _opport_loss, backend)
    assert want[-1] < want[0]  # it does train
    rel = [abs(g - w) / abs(w) for g, w in zip(got, want)]
    assert max(rel) <= 1e-3, f"per-step relative loss differences {rel}"


LCE_BACKENDS = [b for b in TRAINING_BACKENDS if kernels(opport.get_op("linear_cross_entropy").backward_op, get_backend(b))]


@pytest.mark.parametrize("backend", LCE_BACKENDS)
def test_patched_tiny_llama_trains_with_the_fused_linear_cross_entropy_loss(backend):
    """With labels, the patched model's loss is opport.linear_cross_entropy (no logits): every step's loss within
    1e-3 (relative) of the unpatched model's own loss on its logits."""
    want = _train(_tiny_llama(), 6, None)
    got = _train(_tiny_llama(), 6, None, backend)
    assert want[-1] < want[0]
    rel = [abs(g - w) / abs(w) for g, w in zip(got, want)]
    assert max(rel) <= 1e-3, f"per-step relative loss differences {rel}"


def test_dropping_a_norm_weight_gradient_breaks_the_convergence_check(monkeypatch):
    """The check above can fail: with rmsnorm's weight gradient dropped, the losses part within six steps."""
    spec = opport.get_op("rmsnorm").backward_op
    kernel = kernels(spec, get_backend("cpu"))[0]
    real = kernel.fn
    monkeypatch.setattr(kernel, "fn", lambda *a: (real(*a)[0], np.zeros_like(real(*a)[1]) if a[2] is not None else None))
    opport.clear_cache()
    try:
        want = _train(_tiny_llama(), 6, F.cross_entropy)
        got = _train(_tiny_llama(), 6, _opport_loss, "cpu")
    finally:
        opport.clear_cache()
    assert max(abs(g - w) / abs(w) for g, w in zip(got, want)) > 1e-3


def test_a_backend_without_backward_kernels_falls_back_once_or_refuses_in_strict_mode():
    """The backward is dispatched like any op: a backend with a forward kernel only falls back to cpu for the
    backward, with one warning, and strict mode refuses."""
    from tests.conftest import fake_backend

    x, w, dy = (np.random.default_rng(2).standard_normal((4, 16)).astype(np.float32),
                np.ones(16, np.float32), np.ones((4, 16), np.float32))
    cpu_forward = kernels(opport.get_op("rmsnorm"), get_backend("cpu"))[0].fn
    with fake_backend("fwdonly"):
        impl(opport.get_op("rmsnorm"), "fwdonly")(cpu_forward)
        with pytest.warns(opport.FallbackWarning, match="rmsnorm_backward: falling back from fwdonly to cpu"):
            out, pullback = opport.vjp("rmsnorm", x, w, backend="fwdonly")
            dx, dw = pullback(dy)
        want = opport.vjp("rmsnorm", x, w, backend="cpu")[1](dy)
        np.testing.assert_array_equal(dx, want[0])
        assert "fwdonly" in str(opport.explain(opport.get_op("rmsnorm_backward"), dy, x, w, backend="fwdonly"))
        with opport.strict(), pytest.raises(opport.UnsupportedError) as info:
            opport.vjp("rmsnorm", x, w, backend="fwdonly")[1](dy)
    assert info.value.op == "rmsnorm_backward"


# --------------------------------------------------------------------------- cross_entropy's fused value-and-grad

CE = opport.get_op("cross_entropy")


@contextlib.contextmanager
def _counted(backend: str):
    """Counts of calls of `backend`'s cross_entropy kernels (training forward, backward, value-and-grad)."""
    counts = {}
    patched = []
    for spec in (CE.train_forward, CE.backward_op, CE.value_and_grad_op):
        for k in kernels(spec, get_backend(backend)):
            real = k.fn

            def fn(*a, _real=real, _name=spec.name):
                counts[_name] = counts.get(_name, 0) + 1
                return _real(*a)

            patched.append((k, real))
            k.fn = fn
    opport.clear_cache()
    try:
        yield counts
    finally:
        for k, real in patched:
            k.fn = real
        opport.clear_cache()


def _ce_problem(n=6, v=300, dtype="float32", seed=0):
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal((n, v)).astype(np.float32) * 3).to(getattr(torch, dtype))
    t = torch.from_numpy(rng.integers(0, v, n))
    t[2] = -100
    return x, t


def _lse_path_grad(x, t, g, reduction, smoothing, backend):
    """dlogits through cross_entropy_forward + cross_entropy_backward, called directly."""
    from opport import autodiff

    bound = CE.bind(x, t, -100, reduction, smoothing)
    out, stats = autodiff.training_forward(CE, bound, backend)
    return autodiff.backward(CE, g, autodiff.saved_values(CE, bound, out, stats), backend)[0]


def _upstream(reduction, kind, n):
    shape = (n,) if reduction == "none" else ()
    if kind == "one":
        return torch.ones(shape)
    return torch.from_numpy(np.random.default_rng(3).uniform(-2, 2, shape).astype(np.float32))


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("upstream", ["one", "random"])
def test_cross_entropy_backward_is_the_fused_value_and_grad(backend, dtype, reduction, upstream):
    """loss.backward() runs cross_entropy_value_and_grad (never the lse backward kernel), leaves the logits as they
    were, and meets the float64 VJP within the backward's tolerance (one more rounding of a 16-bit
    dlogits where the upstream is not 1: docs/numerics.md 3.6)."""
    if get_backend(backend).unavailable():
        pytest.skip(get_backend(backend).unavailable())
    from opport.spec import Case

    x, t = _ce_problem(dtype=dtype)
    g = _upstream(reduction, upstream, x.shape[0])
    case = CE.backward_op.from_forward(Case("fused", (x.double().numpy(), t.numpy()),
                                            {"reduction": reduction, "label_smoothing": 0.1}), dtype, grad=g.numpy())
    want = CE.backward_op.run_reference(*case.args)[0]  # the float64 VJP, as the backward's conformance judges it
    before = x.clone()
    leaf = x.clone().requires_grad_()
    with _counted(backend) as counts, opport.strict():
        loss = opport.cross_entropy(leaf, t, reduction=reduction, label_smoothing=0.1, backend=backend)
        loss.backward(g)
    assert counts == {"cross_entropy_value_and_grad": 1}, counts
    assert torch.equal(x, before)
    tol = CE.backward_op.tolerance_for(dtype, 0)
    verdict = compare(leaf.grad.double().numpy(), want, tol, dtype)
    assert verdict.ok, verdict.message
    if upstream == "one":  # the unit skip: dlogits as the fused kernel wrote it
        assert torch.equal(leaf.grad, opport.dispatch.call(CE.value_and_grad_op, CE.bind(x, t, -100, reduction, 0.1),
                                                  backend)[1])


def test_cross_entropy_fused_path_under_torch_compile_numpy_vjp_and_jax():
    """torch.compile (the custom op's registered formula), opport.vjp and jax.grad all run the fused op."""
    x, t = _ce_problem(dtype="float32")
    g = torch.tensor(0.37)
    want = _lse_path_grad(x, t, g, "mean", 0.0, "cpu")

    def loss_fn(leaf):
        return opport.cross_entropy(leaf, t) * 0.37

    for dynamic in (False, True):  # sizes and int scalars symbolic: the choice is still made at trace time
        torch._dynamo.reset()
        with _counted("cpu") as counts:
            leaf = x.clone().requires_grad_()
            torch.compile(loss_fn, fullgraph=True, backend="aot_eager", dynamic=dynamic)(leaf).backward()
        assert counts == {"cross_entropy_value_and_grad": 1}, counts
        np.testing.assert_allclose(leaf.grad.numpy(), want.numpy(), rtol=1e-6, atol=1e-9)

    with _counted("cpu") as counts:
        out, pullback = opport.vjp("cross_entropy", x.numpy(), t.numpy())
        up = np.asarray(0.37, np.float32)
        (d1,), (d2,) = pullback(up), pullback(up)  # callable again: not in place
    assert counts == {"cross_entropy_value_and_grad": 1}, counts
    np.testing.assert_array_equal(d1, d2)
    np.testing.assert_allclose(d1, want.numpy(), rtol=1e-6, atol=1e-9)
    with pytest.raises(opport.ShapeError) as info:
        pullback(np.ones(6, np.float32))
    assert info.value.constraint == "cross_entropy_backward.grad_shape"

    with _counted("cpu") as counts:
        d = jax.grad(lambda a: opport.cross_entropy(a, jnp.asarray(t.numpy())) * 0.37)(jnp.asarray(x.numpy()))
    assert counts == {"cross_entropy_value_and_grad": 1}, counts
    np.testing.assert_allclose(np.asarray(d), want.numpy(), rtol=1e-6, atol=1e-9)


def test_a_second_backward_through_a_scaled_fused_gradient_is_refused():
    """The scale is in place on the saved dlogits: torch's saved-tensor version check refuses a second backward
    (retain_graph=True) after a non-unit upstream, rather than scaling twice; after a unit upstream it is fine."""
    x, t = _ce_problem()
    leaf = x.clone().requires_grad_()
    loss = opport.cross_entropy(leaf, t)
    loss.backward(torch.tensor(1.0), retain_graph=True)
    loss.backward(torch.tensor(1.0), retain_graph=True)
    (loss * 2).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_backend_without_a_fused_kernel_keeps_the_lse_path_without_falling_back():
    """Kernel presence decides: a backend with the forward, training forward and backward kernels but no
    value-and-grad one trains through the lse path on its own kernels, in strict mode, with no fallback."""
    from tests.conftest import fake_backend

    x, t = _ce_problem()
    with fake_backend("nofused", device_types=()) as b:
        for spec in (CE, CE.train_forward, CE.backward_op):
            impl(spec, b.name)(kernels(spec, get_backend("cpu"))[0].fn)
        assert not opport.dispatch.takes(CE.value_and_grad_op, CE.bind(x, t), "nofused")
        assert opport.dispatch.takes(CE.value_and_grad_op, CE.bind(x, t), "cpu")
        leaf = x.clone().requires_grad_()
        with opport.strict(), _counted("cpu") as counts:
            opport.cross_entropy(leaf, t, backend="nofused").backward()
        assert counts == {}, counts  # nothing ran on cpu: the fake backend's own (wrapped cpu) kernels did
        impl(CE.value_and_grad_op, b.name)(kernels(CE.value_and_grad_op, get_backend("cpu"))[0].fn)
        assert opport.dispatch.takes(CE.value_and_grad_op, CE.bind(x, t), "nofused")  # the cache saw the kernel
    np.testing.assert_allclose(leaf.grad.numpy(), _lse_path_grad(x, t, torch.tensor(1.0), "mean", 0.0, "cpu").numpy(),
                               rtol=0, atol=0)
