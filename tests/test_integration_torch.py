"""torch.ops.opport.<op>: registration, opcheck, torch.compile(fullgraph=True) against eager, dispatch at run time."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import opport
from tests.conftest import fake_backend

torch = pytest.importorskip("torch")
ot = pytest.importorskip("opport.integrations.torch")

from opport.dispatch import impl  # noqa: E402
from opport.integrations import small_cases  # noqa: E402
from opport.public import function  # noqa: E402

OPS = sorted(opport.all_ops())


def _graph_recorder(graphs: list):
    """A torch.compile backend that keeps Dynamo's FX graph and runs it as is."""

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend


def _opport_nodes(graphs) -> list:
    return [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function" and "opport" in str(n.target)]


def _assert_same(got, want):
    __tracebackhide__ = True
    if isinstance(want, tuple):  # ops with several outputs (quantize_fp8, add_rmsnorm)
        assert isinstance(got, tuple) and len(got) == len(want)
        for g, w in zip(got, want):
            _assert_same(g, w)
        return
    if got.element_size() == 1 and got.is_floating_point():  # fp8: torch has no comparison kernels for it on CPU
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    assert got.dtype == want.dtype and got.shape == want.shape and got.device == want.device
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # the same kernel ran


@pytest.mark.parametrize("name", OPS)
def test_every_op_is_a_custom_op_with_the_declared_signature(name):
    spec = opport.get_op(name)
    assert name not in ot.NOT_REGISTERED, ot.NOT_REGISTERED.get(name)
    args = [a.name for a in getattr(torch.ops.opport, name).default._schema.arguments]
    assert args == [*spec.params, "backend"]


def test_schema_types_come_from_the_declaration():
    assert ot.schema(opport.rmsnorm.spec) == ("(Tensor x, Tensor? weight=None, float eps=1e-06, float offset=0.0, *, "
                                              "str? backend=None) -> Tensor")


@pytest.mark.parametrize("name", OPS)
def test_opcheck_passes_on_cpu(name):
    if name in ot.NOT_REGISTERED:
        pytest.fail(f"not registered: {ot.NOT_REGISTERED[name]}")
    results = ot.opcheck(opport.get_op(name))
    assert results, f"{name} has no conformance case to check"
    failures = {case: r for case, r in results.items() if set(r.values()) != {"SUCCESS"}}
    assert not failures, failures


@pytest.mark.parametrize("name", OPS)
def test_compiled_call_is_one_graph_node_and_matches_eager(name):
    spec = opport.get_op(name)
    case = small_cases(spec)[0]
    args, kw = ot.to_torch(case), ot.torch_kwargs(case)
    torch._dynamo.reset()  # every parametrization compiles the same lambda
    graphs = []
    compiled = torch.compile(lambda *a: function(spec)(*a, **kw), fullgraph=True, backend=_graph_recorder(graphs))
    if spec.writes:  # returns None: compare what the compiled and the eager call wrote (each into its own copies)
        again = ot.to_torch(case)
        assert compiled(*args) is None and function(spec)(*again, **kw) is None
        for i in spec.write_pos:
            _assert_same(args[i], again[i])
    else:
        _assert_same(compiled(*args), function(spec)(*args, **kw))
    assert _opport_nodes(graphs) == [getattr(torch.ops.opport, name).default]


class _Block(torch.nn.Module):
    """A pre-norm transformer block written against opport only."""

    def __init__(self, d=32, heads=4, kv_heads=2, hidden=48):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.w_norm = torch.nn.Parameter(torch.rand(d, generator=g) + 0.5)
        self.w_qkv = torch.nn.Parameter(torch.randn(d, (heads + 2 * kv_heads) * self.hd, generator=g) / d**0.5)
        self.w_o = torch.nn.Parameter(torch.randn(d, d, generator=g) / d**0.5)
        self.w_gate = torch.nn.Parameter(torch.randn(d, hidden, generator=g) / d**0.5)
        self.w_up = torch.nn.Parameter(torch.randn(d, hidden, generator=g) / d**0.5)
        self.w_down = torch.nn.Parameter(torch.randn(hidden, d, generator=g) / hidden**0.5)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        h = opport.rmsnorm(x, self.w_norm)
        qkv = opport.matmul(h, self.w_qkv).view(b, s, self.heads + 2 * self.kv_heads, self.hd).transpose(1, 2)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=1)
        q, k = opport.rope(q, cos, sin), opport.rope(k, cos, sin)
        a = opport.attention(q, k, v, causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + opport.matmul(a, self.w_o)
        h = opport.layernorm(x)
        x = x + opport.matmul(opport.swiglu(opport.matmul(h, self.w_gate), opport.matmul(h, self.w_up)), self.w_down)
        return opport.softmax(opport.gelu(x, approximate="tanh") + opport.silu(x))


def _block_inputs(b=2, s=5, d=32, heads=4):
    x = torch.randn(b, s, d, generator=torch.Generator().manual_seed(1))
    angles = torch.arange(s, dtype=torch.float32)[:, None] / 10000 ** (torch.arange(d // heads // 2) / (d // heads // 2))
    return x, angles.cos(), angles.sin()


def test_model_compiles_fullgraph_and_matches_eager():
    block, inputs = _Block(), _block_inputs()
    with torch.no_grad():
        want = block(*inputs)
        got = torch.compile(block, fullgraph=True, backend="aot_eager")(*inputs)
    _assert_same(got, want)


def test_inductor_compiles_opport_calls_and_matches_eager():
    # opport ops and views only: inductor then has no C++ kernel of its own to build (seconds, not a minute)
    def chain(x, w, wg, wu):
        h = opport.rmsnorm(x, w)
        return opport.softmax(opport.swiglu(opport.matmul(h, wg), opport.matmul(h, wu))).transpose(0, 1)

    g = torch.Generator().manual_seed(2)
    args = (torch.randn(3, 4, 16, generator=g), torch.rand(16, generator=g), torch.randn(16, 24, generator=g),
            torch.randn(16, 24, generator=g))
    _assert_same(torch.compile(chain, fullgraph=True)(*args), chain(*args))


def test_dynamic_shapes_compile_once_for_several_lengths():
    graphs = []
    f = torch.compile(lambda x, w: opport.rmsnorm(x, w) * 2, fullgraph=True, dynamic=True, backend=_graph_recorder(graphs))
    w = torch.rand(16)
    for rows in (3, 5, 9):
        x = torch.randn(rows, 16)
        _assert_same(f(x, w), opport.rmsnorm(x, w) * 2)
    assert len(graphs) == 1


def test_gradients_flow_compiled_as_eager():
    x, w = torch.randn(3, 8, requires_grad=True), torch.rand(8, requires_grad=True)
    loss = lambda x, w: (opport.rmsnorm(x * 2, w) * torch.arange(8.0)).sum()
    eager = torch.autograd.grad(loss(x, w), (x, w))
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(x, w), (x, w))
    for c, e in zip(compiled, eager):
        _assert_same(c, e)


def test_bad_input_fails_at_trace_time_with_the_constraint_id():
    x = torch.randn(3, 8)
    with pytest.raises(Exception, match=r"rmsnorm\.eps"):
        torch.compile(lambda x: opport.rmsnorm(x, eps=0.0), fullgraph=True, backend="aot_eager")(x)
    with pytest.raises(Exception, match=r"rmsnorm\.weight_shape"):
        torch.compile(lambda x, w: opport.rmsnorm(x, w), fullgraph=True, backend="aot_eager")(x, torch.rand(7))


def test_custom_op_kernel_is_opports_dispatcher_at_run_time():
    x = torch.randn(3, 8)

    def marker(value):
        return lambda x, weight, eps, offset: np.full(x.shape, value, x.dtype)

    compiled = torch.compile(lambda x: opport.rmsnorm(x), fullgraph=True, backend="aot_eager")
    named = torch.compile(lambda x: opport.rmsnorm(x, backend="t_int_named"), fullgraph=True, backend="aot_eager")
    with fake_backend("t_int_ctx"), fake_backend("t_int_named"):
        impl(opport.rmsnorm.spec, "t_int_ctx")(marker(7.0))
        impl(opport.rmsnorm.spec, "t_int_named")(marker(9.0))
        _assert_same(compiled(x), opport.rmsnorm(x))  # cpu tensors -> cpu backend
        with opport.use_backend("t_int_ctx"):  # read when the graph runs, not when it was traced
            assert compiled(x).eq(7.0).all()
        assert named(x).eq(9.0).all()
        assert torch.ops.opport.rmsnorm(x, backend="t_int_named").eq(9.0).all()
    with pytest.raises(opport.BackendUnavailableError):
        torch.ops.opport.rmsnorm(x, backend="no_such_backend")


def test_eager_torch_calls_do_not_go_through_the_custom_op(monkeypatch):
    x = torch.randn(2, 8)
    monkeypatch.setitem(ot.OPS, "rmsnorm", None)  # would fail if eager calls used it
    _assert_same(opport.rmsnorm(x), torch.ops.opport.rmsnorm(x))


def _doc_blocks() -> list:
    text = (Path(__file__).parent.parent / "docs" / "integration.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, re.S)


@pytest.mark.parametrize("block", range(len(_doc_blocks())))
def test_docs_example_runs(block):
    """docs/integration.md's examples run as written (each checks its own results)."""
    code = _doc_blocks()[block]
    for module in re.findall(r"^(?:import|from) (\w+)", code, re.M):
        pytest.importorskip(module)
    exec(compile(code, f"docs/integration.md block {block}", "exec"), {"__name__": "__docs__"})
