"""Patched models behave like models: deepcopy, pickle, torch.save, state_dict round trips, .to(dtype), moving
device (cpu -> meta -> cpu) and unpatch keep every module computing with its own weights, and the copy keeps
running opport. Each test changes the weights of the copy and compares it with an unpatched model that was
given those weights (a forward closed over the original module would still compute with the original's)."""

from __future__ import annotations

import copy
import importlib.util
import io
import pickle

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers is not installed", allow_module_level=True)

from opport.integrations.transformers import is_patched, patch, stats, unpatch  # noqa: E402
from tests.hf_tiny import LAYERS, WINDOWED, logits, model, padded  # noqa: E402

FAMILY = "mistral"  # the sliding window on every layer: the window's forward is carried along too


def _patched():
    m = model(FAMILY, **WINDOWED[FAMILY])
    patch(m)
    return m


def _halve(m):
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(0.5)
    return m


def _unpatched_with(state_dict, dtype=torch.float32):
    ref = model(FAMILY, **WINDOWED[FAMILY]).to(dtype)
    ref.load_state_dict(state_dict)
    return ref


def _assert_computes_like(m, ref):
    """m's logits on a padded batch equal ref's (unpatched) on every non-pad position, through opport."""
    x, mask = padded()
    stats(m, reset=True)
    got, want = logits(m, x, attention_mask=mask), logits(ref, x, attention_mask=mask)
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-5, atol=1e-6)
    counts = stats(m)
    assert counts["varlen_attention"]["opport"] == LAYERS and counts["rmsnorm"]["opport"] == LAYERS + 1, counts
    assert not any(c["handed_back"] for c in counts.values()), counts


def _changed_copy(make_copy):
    """(original, copy with halved weights): the original must keep its own weights and results."""
    original = _patched()
    before = logits(original, padded()[0])
    dup = _halve(make_copy(original))
    assert dup is not original and is_patched(dup)
    torch.testing.assert_close(logits(original, padded()[0]), before, rtol=0, atol=0)
    return original, dup


def _pickled(m):
    return pickle.loads(pickle.dumps(m))


def _torch_saved(m):
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("make_copy", [copy.deepcopy, _pickled, _torch_saved], ids=["deepcopy", "pickle", "torch.save"])
def test_a_copy_computes_with_its_own_weights(make_copy):
    original, dup = _changed_copy(make_copy)
    _assert_computes_like(dup, _unpatched_with(dup.state_dict()))
    _assert_computes_like(original, _unpatched_with(original.state_dict()))
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(logits(dup, padded()[0]), logits(original, padded()[0])))


def test_a_copy_has_its_own_counts():
    original, dup = _changed_copy(copy.deepcopy)
    stats(original, reset=True)
    stats(dup, reset=True)  # a deep copy: the counts so far are copied too
    logits(dup, padded()[0])
    assert stats(original)["attention"]["opport"] == 0 and stats(dup)["attention"]["opport"] == LAYERS


def test_state_dict_round_trip():
    m = _patched()
    other = _halve(model(FAMILY, **WINDOWED[FAMILY]))
    assert list(m.state_dict()) == list(other.state_dict())  # patching adds no state
    m.load_state_dict(other.state_dict())
    _assert_computes_like(m, _unpatched_with(other.state_dict()))


def test_to_dtype():
    m = _halve(_patched()).to(torch.float64)
    ref = _unpatched_with(m.state_dict(), torch.float64)
    _assert_computes_like(m, ref)
    assert logits(m, padded()[0]).dtype == torch.float64


def test_moving_device_through_meta():
    """cpu -> meta (weights dropped) -> cpu (to_empty) -> new weights loaded: the modules' forwards are the same
    objects bound to the same modules throughout, computing with whatever weights the modules hold."""
    m = _patched()
    forwards = {name: vars(mod)["forward"] for name, mod in m.named_modules() if "forward" in vars(mod)}
    m.to("meta")
    assert all(p.is_meta for p in m.parameters())
    m.to_empty(device="cpu")
    fresh = _halve(model(FAMILY, **WINDOWED[FAMILY]))
    weights = fresh.state_dict()
    m.load_state_dict(weights)
    for name, buf in fresh.named_buffers():  # rope's inverse frequencies are not in the state_dict
        m.get_buffer(name).copy_(buf)
    assert {name: vars(mod)["forward"] for name, mod in m.named_modules() if "forward" in vars(mod)} == forwards
    _assert_computes_like(m.to("cpu"), _unpatched_with(weights))


def test_unpatch_a_copy():
    original, dup = _changed_copy(copy.deepcopy)
    assert unpatch(dup) == 5 * LAYERS + 3 and not is_patched(dup) and is_patched(original)
    x, mask = padded()
    want = logits(_unpatched_with(dup.state_dict()), x, attention_mask=mask)
    torch.testing.assert_close(logits(dup, x, attention_mask=mask), want, rtol=0, atol=0)  # the model's own code
    _assert_computes_like(original, _unpatched_with(original.state_dict()))


def test_gradient_checkpointing_is_kept():
    """model.gradient_checkpointing_enable(): the patched decoder layers checkpoint as the layer's own forward
    does (recomputed in the backward: each op runs twice), with the unpatched model's gradients."""
    x = padded()[0]
    labels = x.clone()
    grads = []
    for patched in (False, True):
        m = model(FAMILY, **WINDOWED[FAMILY]).train()
        enable = getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable  # renamed
        enable()
        if patched:
            patch(m)
        m(x, labels=labels).loss.backward()
        grads.append([p.grad for p in m.parameters()])
    for g, w in zip(*reversed(grads)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    assert stats(m)["add_rmsnorm"]["opport"] == 2 * LAYERS  # forward, then the recompute in the backward
