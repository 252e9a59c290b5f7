"""The native torch autograd nodes (opport/integrations/torch_native.py): which calls take them, and that they give the
Python Function path's results and gradients bit for bit, the loops' left-over elements and rows included."""

import pytest
import torch

import opport
from opport.backends.cpu._common import PARALLEL_MIN
from opport.integrations import torch_native

NATIVE = "CppNode"


@pytest.fixture(scope="module", autouse=True)
def built():
    torch_native.build()  # a path check where `make native` ran (make run / make test); else ~25 s, once
    if torch_native._MODULE is False:  # this process looked before the build: look again
        torch_native._MODULE = None
    assert torch_native.load() is not None, torch_native.STATUS


def _inputs(shapes, special, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ins = [torch.randn(*s, generator=gen) for s in shapes]
    special(ins)
    return ins


def _run(fn, ins, grad_of=lambda y: torch.randn(y.shape, generator=torch.Generator().manual_seed(7))):
    leaves = [t.clone().requires_grad_() for t in ins]
    ys = fn(*leaves)
    ys = list(ys) if isinstance(ys, tuple) else [ys]  # add_rmsnorm: (normed, sum), a gradient for each
    grads = torch.autograd.grad(ys, leaves, [grad_of(y) if i == 0 else grad_of(y) * -0.5 for i, y in enumerate(ys)])
    return ys[0].grad_fn.name(), [*(y.detach() for y in ys), *grads]


def _bits(ts):
    return [t.view(torch.int32) for t in ts]


def _same_as_python(fn, ins, monkeypatch, **kw):
    node, native = _run(fn, ins, **kw)
    with monkeypatch.context() as m:
        m.setattr(torch_native, "_SPECS", {})  # every call takes the Python Function path
        python_node, python = _run(fn, ins, **kw)
    assert NATIVE in node and NATIVE not in python_node, (node, python_node)
    for a, b in zip(_bits(native), _bits(python)):
        assert torch.equal(a, b)
    return native


def _none(ins):
    pass


def _awkward(ins):
    """NaN, infinities, a deep negative tail (exp overflows), huge values: elements and rows the loops leave."""
    x = ins[0].view(-1)
    x[1], x[3], x[5], x[8] = float("nan"), float("-inf"), -200.0, float("inf")
    if len(ins) > 1 and ins[1].dim() > 1:
        ins[1].view(-1)[5] = 3e38


def _overflow_row(ins):
    ins[0][1] = 3e38 * ins[0][1].sign()  # a row whose statistics overflow float32 (the NumPy kernel's rescaled path)


LAYERNORM = (lambda x, w, b: opport.layernorm(x, w, b))
RMSNORM = (lambda x, w: opport.rmsnorm(x, w, 1e-6))
ADD_RMSNORM = (lambda x, r, w: opport.add_rmsnorm(x, r, w, 1e-5))

CASES = [
    ("silu", opport.silu, [(1, 14336)], _none),
    ("silu-awkward", opport.silu, [(3, 100)], _awkward),
    ("swiglu", opport.swiglu, [(1, 14336), (1, 14336)], _none),
    ("swiglu-awkward", opport.swiglu, [(2, 64), (2, 64)], _awkward),
    ("layernorm", LAYERNORM, [(1, 4096), (4096,), (4096,)], _none),
    ("layernorm-3d", LAYERNORM, [(2, 3, 64), (64,), (64,)], _none),
    ("layernorm-awkward", LAYERNORM, [(4, 64), (64,), (64,)], _awkward),
    ("layernorm-overflow", LAYERNORM, [(4, 64), (64,), (64,)], _overflow_row),
    ("layernorm-two", LAYERNORM, [(5, 2), (2,), (2,)], _none),  # rows of 2: the backward loop leaves them all
    ("rmsnorm", (lambda x, w: opport.rmsnorm(x, w, 1e-6)), [(4, 128, 256), (256,)], _none),  # a training call's
    ("rmsnorm-awkward", (lambda x, w: opport.rmsnorm(x, w, 1e-6)), [(4, 64), (64,)], _awkward),
    ("rmsnorm-overflow", (lambda x, w: opport.rmsnorm(x, w, 1e-6)), [(4, 64), (64,)], _overflow_row),
    ("add_rmsnorm", ADD_RMSNORM, [(4, 128, 256), (4, 128, 256), (256,)], _none),  # a decoder layer's training call
    ("add_rmsnorm-awkward", ADD_RMSNORM, [(4, 64), (4, 64), (64,)], _awkward),
    ("add_rmsnorm-overflow", ADD_RMSNORM, [(4, 64), (4, 64), (64,)], _overflow_row),
]


@pytest.mark.parametrize("name,fn,shapes,special", CASES, ids=[c[0] for c in CASES])
def test_native_node_matches_the_python_path_bitwise(name, fn, shapes, special, monkeypatch):
    out = _same_as_python(fn, _inputs(shapes, special), monkeypatch)
    if special is _none:
        assert all(torch.isfinite(t).all() for t in out)


@pytest.mark.parametrize("name,fn,shapes,special", CASES[::2], ids=[c[0] for c in CASES[::2]])
def test_a_non_contiguous_upstream_gradient(name, fn, shapes, special, monkeypatch):
    """y.sum().backward() hands the node an expanded (stride 0) gradient."""
    _same_as_python(fn, _inputs(shapes, special), monkeypatch, grad_of=lambda y: torch.ones(()).expand(y.shape))


def test_calls_the_nodes_do_not_take_run_the_python_function(monkeypatch):
    monkeypatch.setenv("OPPORT_NUM_THREADS", "2")  # (at a budget of one thread, large calls take the nodes whole)
    x = torch.randn(4, 64)
    w = torch.randn(64)
    declined = {
        "bfloat16": lambda: opport.silu(x.bfloat16().requires_grad_()),
        "float64": lambda: opport.silu(x.double().requires_grad_()),
        "non-contiguous": lambda: opport.silu(torch.randn(64, 4).t().requires_grad_()),
        "one block or more, torch on one thread": lambda: opport.silu(torch.randn(PARALLEL_MIN).requires_grad_()),
        "no bias": lambda: opport.layernorm(x.requires_grad_(), w, None),
        "rows of one block or more": lambda: opport.layernorm(torch.randn(PARALLEL_MIN // 64, 64).requires_grad_(),
                                                              w, torch.randn(64)),
    }
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for why, call in declined.items():
            assert NATIVE not in call().grad_fn.name(), why
        assert NATIVE in opport.silu(torch.randn(PARALLEL_MIN - 1, requires_grad=True)).grad_fn.name()
        torch.set_num_threads(2)  # as torch's guest, elementwise calls of any size take the node; rows do not
        assert NATIVE in opport.silu(torch.randn(PARALLEL_MIN, requires_grad=True)).grad_fn.name()
        assert NATIVE not in declined["rows of one block or more"]().grad_fn.name()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("budget", ["1", "2"])
@pytest.mark.parametrize("name,fn,shapes,special", [
    ("silu", opport.silu, [(5, PARALLEL_MIN // 4 + 3)], _none),
    ("swiglu", opport.swiglu, [(3, PARALLEL_MIN // 2 + 1), (3, PARALLEL_MIN // 2 + 1)], _none),
    ("swiglu-awkward", opport.swiglu, [(2, PARALLEL_MIN), (2, PARALLEL_MIN)], _awkward),
    ("rmsnorm", RMSNORM, [(4, 128, 256), (256,)], _none),
    ("rmsnorm-overflow", RMSNORM, [(1200, 200), (200,)], _overflow_row),
    ("rmsnorm-odd", RMSNORM, [(700, 300), (300,)], _none),  # three row tasks, column tasks of 112, 112, 76
    ("add_rmsnorm", ADD_RMSNORM, [(4, 128, 256), (4, 128, 256), (256,)], _none),
    ("add_rmsnorm-awkward", ADD_RMSNORM, [(3, 250, 300), (3, 250, 300), (300,)], _awkward),
], ids=["silu", "swiglu", "swiglu-awkward", "rmsnorm", "rmsnorm-overflow", "rmsnorm-odd", "add_rmsnorm",
        "add_rmsnorm-awkward"])
def test_large_calls_as_torchs_guest_split_over_torchs_pool_bitwise(name, fn, shapes, special, budget, monkeypatch):
    """As torch's guest (torch's pool has several threads) an elementwise call of one block or more takes the node,
    its loops split over torch's pool in ranges of GRAIN elements (or whole with OPPORT_NUM_THREADS=1): the Python
    Function path's bits (opport's own pool, inline as torch's guest), left-over elements included. rmsnorm's and
    add_rmsnorm's calls of two GRAINs or more split their rows, and the backward's dweight by columns, the same way."""
    monkeypatch.setenv("OPPORT_NUM_THREADS", budget)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        grains = []
        node = torch_native._NODES[name.split("-")[0]]
        monkeypatch.setitem(torch_native._NODES, name.split("-")[0], node._replace(
            node=lambda mod, b, grain: grains.append(grain) or node.node(mod, b, grain)))
        _same_as_python(fn, _inputs(shapes, special), monkeypatch)
        assert grains == [torch_native.GRAIN if budget == "2" else torch_native._WHOLE]
    finally:
        torch.set_num_threads(before)


def test_fused_loops_off_means_the_python_path(monkeypatch):
    monkeypatch.setenv("OPPORT_NUMBA", "0")
    assert NATIVE not in opport.silu(torch.randn(8, requires_grad=True)).grad_fn.name()


def test_validation_errors_come_first():
    x = torch.randn(2, 8, requires_grad=True)
    with pytest.raises(opport.ShapeError) as info:
        opport.layernorm(x, torch.randn(7), torch.randn(8))
    assert info.value.op == "layernorm"
    with pytest.raises(opport.ShapeError):
        opport.swiglu(x, torch.randn(2, 9))
    q = torch.randn(1, 4, 8, 16, requires_grad=True)  # rope's and attention's nodes: the dispatcher's checks first
    with pytest.raises(opport.ShapeError) as info:
        opport.rope(q, torch.randn(8, 7), torch.randn(8, 7))
    assert (info.value.op, info.value.arg) == ("rope", "cos")
    with pytest.raises(opport.ShapeError) as info:
        opport.attention(q, torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16), causal=True)  # 4 heads over 3
    assert info.value.op == "attention"
    with torch.no_grad(), pytest.raises(opport.ShapeError):  # the decode step's native forward
        opport.attention(q[:, :, :1], torch.randn(1, 2, 8, 15), torch.randn(1, 2, 8, 16))


def test_create_graph_gives_first_order_gradients_that_refuse_a_second_backward(monkeypatch):
    x = torch.randn(3, 16, requires_grad=True)
    (gx,) = torch.autograd.grad(opport.silu(x).sum(), x, create_graph=True)
    with monkeypatch.context() as m:
        m.setattr(torch_native, "_SPECS", {})
        (want,) = torch.autograd.grad(opport.silu(x).sum(), x)
    assert torch.equal(gx.detach(), want)
    with pytest.raises(opport.UnsupportedError, match="double backward"):
        gx.sum().backward()


def test_an_input_modified_in_place_after_the_forward_is_caught():
    x = torch.randn(2, 32, requires_grad=True)
    h = x * 1
    y = opport.silu(h)
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_gradients_reach_leaves_through_a_module():
    ln = torch.nn.LayerNorm(48)
    x = torch.randn(5, 48, requires_grad=True)
    opport.layernorm(x, ln.weight, ln.bias, ln.eps).pow(2).sum().backward()
    want = [torch.autograd.grad(torch.nn.functional.layer_norm(x, (48,), ln.weight, ln.bias, ln.eps).pow(2).sum(), t)[0]
            for t in (x, ln.weight, ln.bias)]
    for got, w in zip((x.grad, ln.weight.grad, ln.bias.grad), want):
        torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-4)


def test_the_awkward_cases_reach_the_python_kernels():
    """The cases above take the nodes' Python branch: their loops leave elements or rows, forward and backward."""
    import numpy as np

    from opport.backends.cpu import _fused

    loops, fl = _fused._HERE, np.zeros(1, np.uint8)
    x = _inputs([(3, 100)], _awkward)[0].numpy().reshape(-1)
    g, out = np.ones_like(x), np.empty_like(x)
    assert loops["_silu"](x, out, False, fl) and loops["_silu_grad"](x, g, out, False, fl)
    gate, up = (t.numpy().reshape(-1) for t in _inputs([(2, 64), (2, 64)], _awkward))
    assert loops["_swiglu"](gate, up, out[:128], False, fl)
    assert loops["_swiglu_grad"](gate, up, g[:128], out[:128], out[128:256], False, fl)
    x, w, b = (t.numpy() for t in _inputs([(4, 64), (64,), (64,)], _overflow_row))
    assert _fused.ln_forward(x, w, b, 1e-5, np.empty_like(x)) is not None
    x2 = np.random.default_rng(0).standard_normal((5, 2)).astype(np.float32)
    assert _fused.ln_backward(x2, x2, np.ones(2), 1e-5, np.empty_like(x2), np.zeros(2), np.zeros(2)) is not None


_ANGLES = torch.randn(1, 16, 4, generator=torch.Generator().manual_seed(10))
ROPE = (lambda x: opport.rope(x, _ANGLES.cos(), _ANGLES.sin()))  # the tables: constants
ROPE_DECODE = (lambda x: opport.rope(x, _ANGLES[:, -1:].cos(), _ANGLES[:, -1:].sin()))

FORWARD_CASES = CASES + [
    ("rmsnorm-decode", RMSNORM, [(1, 1, 256), (256,)], _none),
    ("add_rmsnorm-decode", ADD_RMSNORM, [(1, 1, 256), (1, 1, 256), (256,)], _none),
    ("rope", ROPE, [(2, 3, 16, 8)], _none),
    ("rope-awkward", ROPE, [(2, 3, 16, 8)], _awkward),
    ("rope-decode", ROPE_DECODE, [(1, 6, 1, 8)], _none),  # q and k of a decode step, side by side
    # a decode step's attention (one query row per head, GQA 2): its own loop; a huge key makes it decline
    ("attention-decode", lambda q, k, v: opport.attention(q, k, v, causal=True), [(2, 4, 1, 8), (2, 2, 9, 8),
                                                                                 (2, 2, 9, 8)], _none),
    ("attention-decode-awkward", lambda q, k, v: opport.attention(q, k, v, causal=True), [(1, 4, 1, 8), (1, 2, 9, 8),
                                                                                         (1, 2, 9, 8)], _awkward),
    ("attention-decode-window-softcap", lambda q, k, v: opport.attention(q, k, v, causal=True, sliding_window=4,
                                                                         softcap=20.0), [(1, 4, 1, 8), (1, 2, 9, 8),
                                                                                         (1, 2, 9, 8)], _none),
]


def _outs(y) -> list:
    return list(y) if isinstance(y, tuple) else [y]


@pytest.mark.parametrize("name,fn,shapes,special", FORWARD_CASES, ids=[c[0] for c in FORWARD_CASES])
def test_calls_without_gradients_take_the_nodes_forward(name, fn, shapes, special, monkeypatch):
    """Decode's calls (no grad mode, inference mode, or no input requiring grad) run the native forward: the
    dispatcher's result bit for bit, the loops' left-over elements and rows included."""
    from opport.integrations import NATIVE_OPS

    assert {name for name, n in torch_native._NODES.items() if n.forward is not None} == NATIVE_OPS
    ins = _inputs(shapes, special)
    op = name.split("-")[0]
    with monkeypatch.context() as m:
        m.setattr(torch_native, "_SPECS", {})  # the dispatcher's way
        with torch.no_grad():
            want = _bits(_outs(fn(*ins)))
    taken = []
    node = torch_native._NODES[op]
    monkeypatch.setitem(torch_native._NODES, op,
                        node._replace(forward=lambda mod, b, grain: taken.append(1) or node.forward(mod, b, grain)))
    for mode in (torch.no_grad, torch.inference_mode, torch.enable_grad):
        with mode():
            ys = _outs(fn(*ins))
        assert len(ys) == len(want) and not any(y.requires_grad for y in ys), mode
        assert all(torch.equal(y.view(torch.int32), w) for y, w in zip(ys, want)), mode
    assert len(taken) == 3


def test_norm_calls_the_forwards_do_not_take(monkeypatch):
    """rmsnorm: an offset (Gemma's 1 + weight) or no weight goes the dispatcher's way; rmsnorm and add_rmsnorm calls
    that autograd records take their nodes (not the forwards alone), with the same values."""
    x, r, w = torch.randn(2, 32), torch.randn(2, 32), torch.randn(32)
    taken = []
    for op in ("rmsnorm", "add_rmsnorm"):
        node = torch_native._NODES[op]
        monkeypatch.setitem(torch_native._NODES, op,
                            node._replace(forward=lambda mod, b, grain, f=node.forward: taken.append(1) or f(mod, b, grain)))
    with torch.no_grad():
        opport.rmsnorm(x, w, 1e-6, offset=1.0)
        opport.rmsnorm(x, None, 1e-6)
        opport.rmsnorm(x.double(), w.double(), 1e-6)
    assert not taken
    xg = x.clone().requires_grad_()
    y = opport.rmsnorm(xg, w, 1e-6)
    normed, total = opport.add_rmsnorm(xg, r, w, 1e-6)
    assert not taken and NATIVE in y.grad_fn.name() and NATIVE in normed.grad_fn.name()
    with torch.no_grad():
        assert torch.equal(opport.rmsnorm(x, w, 1e-6), y.detach()) and len(taken) == 1
        n2, t2 = opport.add_rmsnorm(x, r, w, 1e-6)
        assert torch.equal(n2, normed.detach()) and torch.equal(t2, total.detach()) and len(taken) == 2


@pytest.mark.parametrize("used", ["normed", "sum"])
def test_add_rmsnorm_node_with_one_output_used(used, monkeypatch):
    """A gradient for one of add_rmsnorm's outputs only (the other's reaches the node as nothing: zeros): the Python
    Function path's bits."""
    pick = 0 if used == "normed" else 1
    _same_as_python(lambda x, r, w: ADD_RMSNORM(x, r, w)[pick], _inputs([(8, 64), (8, 64), (64,)], _none), monkeypatch)


def test_building_leaves_the_extensions_name_alone(monkeypatch, tmp_path):
    """torch's load() appends its own -L/-l flags to the lists it is given: the build hands it copies, so the name the
    same process then loads (a hash of the flags) is the one it built."""
    import torch.utils.cpp_extension as cpp

    from opport.integrations import _native_build

    def load(name, sources, extra_cflags=None, extra_ldflags=None, verbose=False):
        extra_cflags.append("-DTORCH_APPENDED")
        extra_ldflags.append("-ltorch")

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built there: build() calls load()
    monkeypatch.setattr(cpp, "load", load)
    before = _native_build.module_name()
    _native_build.build()
    assert _native_build.module_name() == before


@pytest.mark.parametrize("causal,sq,sk", [(True, 128, 128), (False, 70, 300), (True, 40, 90)])
def test_attention_tasks_on_torch_pool_match_the_calling_thread_bitwise(causal, sq, sk, monkeypatch):
    """float32 attention's Python Function path as torch's guest spreads its tasks (_attn_tasks.py) over torch's pool:
    the same bits as the tasks run one after another on the calling thread (torch at one thread), forward and
    gradients, and the pool is what ran them."""
    import opport.integrations.torch  # noqa: F401 - it hands the cpu kernels torch's pool (POOL_TASKS)
    from opport.backends.cpu import _common

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, s, 32, generator=gen) for h, s in ((4, sq), (2, sk), (2, sk)))
    ran = []
    real = _common.POOL_TASKS[0]
    monkeypatch.setattr(_common, "POOL_TASKS", [lambda: ran.append(1) or real()])
    monkeypatch.setattr(torch_native, "_SPECS", {})  # the Python Function path (the node's own test is below)
    threads = torch.get_num_threads()
    results = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            ran.clear()
            results[n] = _run(lambda a, b, c: opport.attention(a, b, c, causal=causal), (q, k, v))[1]
            assert len(ran) == (2 if n > 1 else 0), (n, ran)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(_bits(results[1]), _bits(results[2])):
        assert torch.equal(a, b)


@pytest.mark.parametrize("op", ["cross_entropy", "linear_cross_entropy"])
def test_cross_entropy_rows_on_torch_pool_match_the_calling_thread_bitwise(op, monkeypatch):
    """cross_entropy's row loops (statistics, gradient) as torch's guest split their rows over torch's pool: the same
    bits as on the calling thread, loss and gradients, a row of NaN and one of inf among them (left to NumPy)."""
    import opport.integrations.torch  # noqa: F401 - it hands the cpu kernels torch's pool (POOL_TASKS)
    from opport.backends.cpu import _common

    gen = torch.Generator().manual_seed(4)
    if op == "cross_entropy":
        x = torch.randn(300, 1024, generator=gen) * 4
        x[7, 3], x[200, 9] = float("nan"), float("inf")
        ins, fn = (x,), lambda a: opport.cross_entropy(a, target, label_smoothing=0.1)
    else:
        ins = (torch.randn(300, 64, generator=gen), torch.randn(1024, 64, generator=gen))
        fn = lambda h, w: opport.linear_cross_entropy(h, w, target)  # noqa: E731
    target = torch.randint(0, 1024, (300,), generator=gen)
    ran = []
    real = _common.POOL_TASKS[0]
    threads = torch.get_num_threads()
    results = {}
    try:
        torch.set_num_threads(2)  # (the head's GEMM goes to torch at 2 threads: both runs there, pool on and off)
        for pooled in (False, True):
            monkeypatch.setattr(_common, "POOL_TASKS", [lambda p=pooled: ran.append(p) or (real() if p else None)])
            ran.clear()
            results[pooled] = _run(fn, ins, grad_of=lambda y: torch.ones(()))[1]
            assert ran and set(ran) == {pooled}, ran
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(_bits(results[False]), _bits(results[True])):
        assert torch.equal(a, b)


def _heads(b, s, h, d, gen, layout):
    """[B, H, S, D] normal values: contiguous, or the model's view of a [B, S, H, D] projection (strided)."""
    if layout == "model":
        return torch.randn(b, s, h, d, generator=gen).transpose(1, 2)
    return torch.randn(b, h, s, d, generator=gen)


def _nan_q(ins):
    ins[0][0, 1, 5, 3] = float("nan")  # a non-finite score: the tasks decline, the Python kernels run the call


def _inf_masked_k(ins):
    ins[1][1, 0, -1, 0] = float("inf")  # a key the first rows do not see: the forward's partly masked block declines


ATTENTION_CASES = [  # (id, causal, scale, (Sq, Sk), layout, special)
    ("causal-gqa-model-layout", True, None, (128, 128), "model", _none),
    ("full-longer-keys", False, None, (70, 300), "contiguous", _none),
    ("causal-fewer-queries-scaled", True, 0.3, (40, 90), "model", _none),
    ("more-queries-than-keys", True, None, (50, 20), "contiguous", _none),  # rows that see no key: Python kernels
    ("nan-in-q", True, None, (64, 64), "model", _nan_q),
    ("inf-in-a-masked-key", True, None, (64, 64), "contiguous", _inf_masked_k),
]


@pytest.mark.parametrize("budget", ["1", "2"])
@pytest.mark.parametrize("name,causal,scale,lengths,layout,special", ATTENTION_CASES, ids=[c[0] for c in ATTENTION_CASES])
def test_attention_node_matches_the_python_path_bitwise(name, causal, scale, lengths, layout, special, budget,
                                                        monkeypatch):
    """float32 attention that records takes its node (q, k, v copied once where strided; the tasks on torch's pool as
    its guest with a budget of 2, one after another on the calling thread with a budget of 1): the Python Function
    path's output and gradients bit for bit, where the tasks decline too."""
    monkeypatch.setenv("OPPORT_NUM_THREADS", budget)
    gen = torch.Generator().manual_seed(5)
    sq, sk = lengths
    ins = [_heads(2, sq, 4, 32, gen, layout), _heads(2, sk, 2, 32, gen, layout), _heads(2, sk, 2, 32, gen, layout)]
    special(ins)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        out = _same_as_python(lambda q, k, v: opport.attention(q, k, v, causal=causal, scale=scale), ins, monkeypatch)
    finally:
        torch.set_num_threads(before)
    if special is _none and sq <= sk:
        assert all(torch.isfinite(t).all() for t in out)


def test_attention_calls_the_node_does_not_take_run_the_python_function(monkeypatch):
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, h, 16, 8, generator=gen).requires_grad_() for h in (2, 1, 1))
    declined = {
        "soft cap": lambda: opport.attention(q, k, v, causal=True, softcap=30.0),
        "sliding window": lambda: opport.attention(q, k, v, causal=True, sliding_window=4),
        "one query row (decode)": lambda: opport.attention(q[:, :, :1], k, v),
        "bfloat16": lambda: opport.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True),
        "float64": lambda: opport.attention(q.double(), k.double(), v.double(), causal=True),
    }
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert NATIVE in opport.attention(q, k, v, causal=True).grad_fn.name()
        for why, call in declined.items():
            assert NATIVE not in call().grad_fn.name(), why
        torch.set_num_threads(1)  # not torch's guest, a budget of 2: the Python path (BLAS gets the budget there)
        monkeypatch.setenv("OPPORT_NUM_THREADS", "2")
        assert NATIVE not in opport.attention(q, k, v, causal=True).grad_fn.name()
        monkeypatch.setenv("OPPORT_NUM_THREADS", "1")  # a budget of one: the node, its tasks on the calling thread
        assert NATIVE in opport.attention(q, k, v, causal=True).grad_fn.name()
    finally:
        torch.set_num_threads(before)


def test_attention_node_under_create_graph_gives_first_order_gradients(monkeypatch):
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, h, 24, 8, generator=gen).requires_grad_() for h in (2, 1, 1))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        y = opport.attention(q, k, v, causal=True)
        assert NATIVE in y.grad_fn.name()
        got = torch.autograd.grad(y.sum(), (q, k, v), create_graph=True)
        with monkeypatch.context() as m:
            m.setattr(torch_native, "_SPECS", {})
            want = torch.autograd.grad(opport.attention(q, k, v, causal=True).sum(), (q, k, v))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(got, want):
        assert torch.equal(a.detach(), b)
    with pytest.raises(opport.UnsupportedError, match="double backward"):
        got[0].sum().backward()


def _tables(shape, seed=8):
    angle = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return angle.cos(), angle.sin()


ROPE_CASES = [  # (id, x [B, S, H, D] viewed as [B, H, S, D] or contiguous [B, H, S, D], tables' shape, interleaved)
    ("model-layout-batch-tables", "model", (4, 128, 32), False),
    ("model-layout-shared-table", "model", (1, 128, 32), False),
    ("contiguous-2d-table-interleaved", "contiguous", (128, 32), True),
    ("awkward", "contiguous", (4, 128, 32), False),  # NaN and infinities propagate as in the Python kernel
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name,layout,table,interleaved", ROPE_CASES, ids=[c[0] for c in ROPE_CASES])
def test_rope_node_matches_the_python_path_bitwise(name, layout, table, interleaved, threads, monkeypatch):
    """rope's training calls take its node, x read in place at its strides (q and k are views of the projections),
    the rows split over torch's pool as its guest: the Python Function path's bits, forward and gradient."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(4, 128, 4, 64, generator=gen).transpose(1, 2) if layout == "model" else torch.randn(
        4, 4, 128, 64, generator=gen)
    if name == "awkward":
        _awkward([x])
    cos, sin = _tables(table)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        _same_as_python(lambda t: opport.rope(t, cos, sin, interleaved), [x], monkeypatch)
    finally:
        torch.set_num_threads(before)


def test_rope_calls_the_node_does_not_take_run_the_python_function():
    x = torch.randn(1, 2, 8, 16, requires_grad=True)
    cos, sin = _tables((8, 8))
    declined = {
        "float64 tables": lambda: opport.rope(x, cos.double(), sin.double()),
        "bfloat16": lambda: opport.rope(x.bfloat16(), cos, sin),
    }
    assert NATIVE in opport.rope(x, cos, sin).grad_fn.name()
    for why, call in declined.items():
        assert NATIVE not in call().grad_fn.name(), why


def test_large_calls_at_a_budget_of_one_thread_take_the_nodes_whole(monkeypatch):
    """torch on one thread and OPPORT_NUM_THREADS=1: no pool either way, so one block or more takes the node, its loop
    whole on the calling thread: the Python path's bits."""
    monkeypatch.setenv("OPPORT_NUM_THREADS", "1")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _same_as_python(opport.swiglu, _inputs([(3, PARALLEL_MIN // 2 + 1), (3, PARALLEL_MIN // 2 + 1)], _none),
                        monkeypatch)
    finally:
        torch.set_num_threads(before)
