"""sample and sampling_probs end to end: top_k = 1 is the argmax on every backend, the draws follow the filtered
distribution (total variation), the filter order and the special rows by hand, torch and NumPy inputs."""

from __future__ import annotations

import numpy as np
import pytest

import opport
from opport.errors import ArgumentError
from opport.ops.sample import margin_ok, sample_rows
from opport.ops.sampling_probs import probs_rows

BACKENDS = ("cpu", "cuda", "neuron")


def _settings(b, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    return (np.full(b, temperature, np.float32), np.full(b, top_k, np.int32), np.full(b, top_p, np.float32),
            np.full(b, min_p, np.float32))


def _sample(logits, u, *settings, backend="cpu"):
    with opport.strict():
        return np.asarray(opport.sample(logits, u, *settings, backend=backend))


def _probs(logits, *settings, backend="cpu"):
    with opport.strict():
        return np.asarray(opport.sampling_probs(logits, *settings, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_top_k_1_is_the_argmax(backend, dtype):
    """Whatever the temperature, uniform, top_p and min_p: ties (a row of a few levels) go to the lowest index."""
    import ml_dtypes

    rng = np.random.default_rng(1)
    b, v = 12, 300
    x = rng.standard_normal((b, v)).astype(np.float32)
    x[::3] = rng.integers(0, 4, (4, v))  # rows with many ties at the max
    x = x.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)
    t = rng.choice(np.float32([0.3, 1.0, 2.0]), b)
    tp = rng.choice(np.float32([1.0, 0.5, 0.9]), b)
    mp = rng.choice(np.float32([0.0, 0.1]), b)
    u = rng.random(b).astype(np.float32)
    got = _sample(x, u, t, np.ones(b, np.int32), tp, mp, backend=backend)
    want = np.argmax(x.astype(np.float32), axis=1)
    assert got.dtype == np.int32 and np.array_equal(got, want)
    probs = _probs(x, t, np.ones(b, np.int32), tp, mp, backend=backend)
    assert np.array_equal(probs, np.eye(v, dtype=np.float32)[want])


def _row():
    """One row of 24 logits whose settings each cut something: top_k 10 drops 14, top_p 0.8 leaves 6 of those and
    min_p 0.15 leaves 4 (checked below, so the distribution test is not trivially all tokens)."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(24) * 1.5).astype(np.float32)
    return x, dict(temperature=0.8, top_k=10, top_p=0.8, min_p=0.15)


def test_the_row_is_cut_by_every_filter():
    x, s = _row()
    x64 = x[None].astype(np.float64)

    def kept(**over):
        t, k, p, m = _settings(1, **{**s, **over})
        return int(np.count_nonzero(probs_rows(x64, t, k, p, m)))

    full = kept(top_k=0, top_p=1.0, min_p=0.0)
    assert full == 24
    assert kept(top_p=1.0, min_p=0.0) == 10
    assert kept(min_p=0.0) == 6 and kept(top_p=1.0) == 4 and kept() == 4
    assert margin_ok(x64[0], s["temperature"], s["top_k"], s["top_p"], s["min_p"])  # no boundary within rounding


def _tv(tokens, exact):
    emp = np.bincount(tokens, minlength=exact.shape[0]) / tokens.shape[0]
    return 0.5 * np.abs(emp - exact).sum()


def test_draws_follow_the_filtered_distribution_cpu():
    """200K draws (uniforms from a seeded generator) of one row: total variation <= 0.01 from the exact filtered
    distribution (the float64 reference); the draws never leave the kept set."""
    x, s = _row()
    n = 200_000
    logits = np.broadcast_to(x, (n, x.shape[0]))
    u = np.random.default_rng(11).random(n).astype(np.float32)
    tokens = _sample(logits, u, *_settings(n, **s))
    exact = probs_rows(x[None].astype(np.float64), *_settings(1, **s))[0]
    assert np.all(exact[tokens] > 0)
    assert _tv(tokens, exact) <= 0.01
    assert np.allclose(_probs(x[None], *_settings(1, **s))[0], exact, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", ["cuda", "neuron"])
def test_draws_on_device_backends(backend):
    """Fewer draws there (the interpreter runs one program at a time, the emulator 128 rows a tile): each draw is
    the cpu's and the reference's token for the same uniform; on neuron 10K draws are within total variation 0.03
    of the exact distribution (4 kept tokens: the expected distance is ~0.007)."""
    x, s = _row()
    n = 10_000 if backend == "neuron" else 128
    logits = np.ascontiguousarray(np.broadcast_to(x, (n, x.shape[0])))
    u = np.random.default_rng(12).random(n).astype(np.float32)
    settings = _settings(n, **s)
    tokens = _sample(logits, u, *settings, backend=backend)
    assert np.array_equal(tokens, _sample(logits, u, *settings))
    assert np.array_equal(tokens, sample_rows(logits.astype(np.float64), u.astype(np.float64), *settings))
    if backend == "neuron":
        exact = probs_rows(x[None].astype(np.float64), *_settings(1, **s))[0]
        assert _tv(tokens, exact) <= 0.03


def test_top_p_is_judged_on_what_top_k_left():
    """p = (0.5, 0.3, 0.2): top_k = 2 leaves (0.625, 0.375); top_p = 0.6 then keeps token 0 alone (judged on the
    whole distribution it would have kept two)."""
    x = np.log(np.float32([[0.5, 0.3, 0.2]]))
    for backend in BACKENDS:
        p = _probs(x, *_settings(1, top_k=2, top_p=0.6), backend=backend)
        assert np.array_equal(p, [[1.0, 0.0, 0.0]]), backend
        p = _probs(x, *_settings(1, top_p=0.6), backend=backend)
        np.testing.assert_allclose(p, [[0.625, 0.375, 0.0]], rtol=1e-6)
        # min_p 0.5: tokens of p >= 0.25 (0.5 and 0.3), renormalised
        p = _probs(x, *_settings(1, min_p=0.5), backend=backend)
        np.testing.assert_allclose(p, [[0.625, 0.375, 0.0]], rtol=1e-6)


def test_inverse_cdf_in_vocabulary_order():
    """Weights (0.5, 1, 0.5): top_k = 2 keeps token 1 and, of the two tied at the second place, the lower index 0.
    In vocabulary order the kept CDF is (1/3, 1): u < 1/3 draws token 0, u above it token 1; 2 is never drawn."""
    x = np.float32([[0.0, np.log(2.0), 0.0]])
    u = np.float32([0.0, 0.3, 0.34, 0.99])
    logits = np.repeat(x, 4, axis=0)
    for backend in BACKENDS:
        got = _sample(logits, u, *_settings(4, top_k=2), backend=backend)
        assert got.tolist() == [0, 0, 1, 1], backend


def test_special_rows():
    """NaN or +inf anywhere, or all -inf: -1 and a NaN row of probabilities, at any temperature; a row masked to
    -inf but one token: that token."""
    nan, inf = np.nan, np.inf
    x = np.float32([[0.0, nan, 1.0, 2.0], [inf, 0.0, 1.0, 2.0], [-inf] * 4, [-inf, -inf, 3.0, -inf],
                    [1.0, 2.0, -inf, 0.5]])
    for t in (0.0, 1.0):
        for backend in BACKENDS:
            settings = _settings(5, temperature=t, top_p=0.9)
            tok = _sample(x, np.float32([0.5, 0.5, 0.5, 0.99, 0.0]), *settings, backend=backend)
            assert tok.tolist() == [-1, -1, -1, 2, 1 if t == 0 else 0], (backend, t)
            p = _probs(x, *settings, backend=backend)
            assert np.isnan(p[:3]).all() and not np.isnan(p[3:]).any()
            assert p[3].tolist() == [0.0, 0.0, 1.0, 0.0] and p[4, 2] == 0.0


def test_torch_and_numpy_inputs():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 50)).astype(np.float32)
    u = rng.random(6).astype(np.float32)
    settings = _settings(6, temperature=0.7, top_k=20, top_p=0.9, min_p=0.02)
    want = opport.sample(x, u, *settings)
    got = opport.sample(torch.from_numpy(x), torch.from_numpy(u), *map(torch.from_numpy, settings))
    assert isinstance(got, torch.Tensor) and got.dtype == torch.int32
    assert np.array_equal(got.numpy(), want)
    p = opport.sampling_probs(torch.from_numpy(x), *map(torch.from_numpy, settings))
    assert isinstance(p, torch.Tensor) and p.dtype == torch.float32
    np.testing.assert_allclose(p.numpy(), opport.sampling_probs(x, *settings), rtol=1e-6, atol=0)


@pytest.mark.parametrize("arg, value", [("uniforms", 1.0), ("temperature", -0.5), ("top_k", -1), ("top_p", 0.0),
                                        ("min_p", 1.5)])
def test_out_of_range_settings_are_refused(arg, value):
    x = np.zeros((3, 8), np.float32)
    args = {"uniforms": np.full(3, 0.5, np.float32)}
    args.update(zip(("temperature", "top_k", "top_p", "min_p"), _settings(3)))
    args[arg] = args[arg].copy()
    args[arg][1] = value
    with pytest.raises(ArgumentError) as err:
        opport.sample(x, *args.values())
    assert err.value.constraint == f"sample.{arg}_range"
