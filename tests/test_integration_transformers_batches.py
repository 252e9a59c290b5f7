"""Padded, packed and sliding-window batches through patched tiny Llama, Mistral and Qwen2 models: the forward
equals the unpatched model's on every non-pad position (float32, rtol 1e-5), on cpu, cuda (Triton's interpreter)
and neuron (NKI emulator) in strict mode, with opport's attention on every layer and nothing handed back; five
training steps match the unpatched model's per-step loss (rtol 1e-5)."""

from __future__ import annotations

import functools
import importlib.util

import pytest

import opport

torch = pytest.importorskip("torch")
if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers is not installed", allow_module_level=True)

from opport.dispatch import backends, kernels  # noqa: E402
from opport.integrations.transformers import patch, stats  # noqa: E402
from tests.hf_tiny import (  # noqa: E402
    LAYERS,
    SMALLER,
    WINDOWED,
    backend_skip,
    ids,
    logits,
    model,
    packed,
    packed_labels,
    padded,
)

BACKENDS = ("cpu", "cuda", "neuron")
KINDS = ("dense", "padded", "packed_position_ids", "packed_cu_seq_lens")
# what each kind of batch runs on: dense batches the dense kernel, the others varlen_attention
ATTENTION_OP = {"dense": "attention", "padded": "varlen_attention", "packed_position_ids": "varlen_attention",
                "packed_cu_seq_lens": "varlen_attention", "packed": "varlen_attention"}


def _config(family: str, backend: str) -> dict:
    return {**WINDOWED.get(family, {}), **(SMALLER if backend != "cpu" else {})}


def _skip(backend: str):
    reason = backend_skip(backend)
    if reason:
        pytest.skip(reason)


def _batch(kind: str):
    """(input_ids, the patched model's keywords, the unpatched model's keywords, the positions compared)."""
    if kind == "padded":
        x, mask = padded()
        return x, dict(attention_mask=mask), dict(attention_mask=mask), mask.bool()
    if kind == "dense":
        x, _ = padded()
        return x, {}, {}, torch.ones_like(x, dtype=torch.bool)
    x, pos, fa = packed()
    # Hugging Face's SDPA path separates the documents only without a cache (use_cache=False); the patched model
    # separates them whenever nothing is cached, as FlashAttention's path does
    theirs = dict(position_ids=pos, use_cache=False)
    ours = dict(position_ids=pos) if kind == "packed_position_ids" else dict(position_ids=pos, **fa)
    return x, ours, theirs, torch.ones_like(x, dtype=torch.bool)


def _assert_opport_ran(m, op: str, calls: int):
    counts = stats(m, reset=True)
    assert counts[op]["opport"] == calls, counts
    assert not any(c["handed_back"] for c in counts.values()), counts


# every family x kind on cpu; on the emulating backends (minutes of interpreter time per family) the kernels'
# paths: Llama with every kind of batch, Mistral's window on a padded one (the training test below adds more)
BATCH_CASES = [(f, k, b) for b in BACKENDS for k in KINDS for f in ("llama", "mistral", "qwen2")
               if b == "cpu" or f == "llama" or (f, k) == ("mistral", "padded")]


@pytest.mark.parametrize(("family", "kind", "backend"), BATCH_CASES)
def test_batch_matches_unpatched_in_strict_mode(family, kind, backend):
    _skip(backend)
    m = model(family, **_config(family, backend))
    x, ours, theirs, keep = _batch(kind)
    want = logits(m, x, **theirs)
    patch(m)
    with opport.use_backend(backend), opport.strict():  # strict: no hand-back, no fallback to cpu
        got = logits(m, x, **ours)
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-5, atol=1e-6)
    _assert_opport_ran(m, ATTENTION_OP[kind], LAYERS)


@pytest.mark.parametrize("family", ("mistral", "qwen2"))
def test_the_window_is_in_reach_of_the_batches(family):
    """The comparisons above would pass with the window ignored if no row were longer than it: they are not."""
    x, mask = padded()
    windowed, full = model(family, **WINDOWED[family]), model(family)
    assert (logits(windowed, x, attention_mask=mask) - logits(full, x, attention_mask=mask))[mask.bool()].abs().max() > 1e-3


def test_packing_separates_documents():
    """Restarting position_ids and cu_seq_lens split the row into documents: attention over the whole row (the
    same positions, one sequence) differs, so the packed comparisons above check the split."""
    m = model()
    x, pos, fa = packed()
    patch(m)
    split = logits(m, x, position_ids=pos, **fa)
    cu = torch.tensor([0, x.shape[1]], dtype=torch.int32)
    whole = logits(m, x, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=12, max_length_k=12)
    assert (split - whole).abs().max() > 1e-3


def test_packed_rows_of_a_batch_and_eager_attention():
    """Two packed rows (position_ids [2, S]), on a model built for eager attention: HF's eager path always builds
    a mask; the patched model reads the layout and runs varlen_attention all the same."""
    m = model(attn_implementation="eager")
    x = torch.randint(1, 97, (2, 8), generator=torch.Generator().manual_seed(1))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 0, 1, 2, 3, 0, 1]])
    want = logits(m, x, position_ids=pos, use_cache=False)
    patch(m)
    with opport.strict():
        got = logits(m, x, position_ids=pos)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    _assert_opport_ran(m, "varlen_attention", LAYERS)


@pytest.mark.parametrize("family", ("llama", "mistral"))
def test_generate_from_left_padded_prompts(family):
    """generate() with left-padded prompts: prefill and every decode step (DynamicCache, Mistral's sliding-window
    cache layers included) run varlen_attention; the tokens and the scores equal the unpatched model's."""
    m = model(family, **WINDOWED.get(family, {}))
    m.generation_config.pad_token_id = 0
    x, mask = padded()
    mask[1] = 1  # row 0 left-padded, row 1 without padding (right padding is not for generation)
    x[1] = ids(1, x.shape[1], seed=8)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        want = m.generate(x, **kw)
        patch(m)
        with opport.strict():
            got = m.generate(x, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for g, w in zip(got.logits, want.logits):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    _assert_opport_ran(m, "varlen_attention", 6 * LAYERS)


# --------------------------------------------------------------------------- training


STEPS = 5


def _training_skip(backend: str):
    """Backends without the other ops' backward kernels are skipped; varlen_attention's backward is not asked
    for here: where it is missing, the padded and packed cases fail (strict mode refuses the hand-back)."""
    _skip(backend)
    b = backends()[backend]
    ops = ("rmsnorm", "add_rmsnorm", "swiglu", "rope", "attention", "linear_cross_entropy")
    missing = [op for op in ops if not kernels(opport.get_op(op).backward_op, b)]
    if missing:
        pytest.skip(f"{backend} has no backward kernel for {', '.join(missing)}")


def _train_batch(kind: str):
    """(input_ids, keywords, labels): labels -100 on pads and across document boundaries."""
    if kind == "packed":
        x, pos, fa = packed()
        return x, dict(position_ids=pos, use_cache=False, **fa), packed_labels(x)
    x, mask = padded()
    if kind == "dense":
        return x, {}, x
    return x, dict(attention_mask=mask), x.masked_fill(mask == 0, -100)


def _train(m, kind: str) -> list:
    x, kw, labels = _train_batch(kind)
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    losses = []
    for _ in range(STEPS):
        loss = m(x, labels=labels, **kw).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@functools.cache
def _unpatched_losses(family: str, kind: str, backend: str) -> tuple:
    return tuple(_train(model(family, **_config(family, backend)), kind))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ("padded", "packed"))  # dense batches: every family's, test_..._families.py
@pytest.mark.parametrize("family", ("llama", "mistral"))
def test_training_matches_unpatched_in_strict_mode(family, kind, backend):
    """Five AdamW steps with labels (the patched loss: opport.linear_cross_entropy): each step's float32 loss
    within 1e-5 (relative) of the unpatched model's, every layer's attention through opport, nothing handed back."""
    _training_skip(backend)
    want = _unpatched_losses(family, kind, backend)
    m = model(family, **_config(family, backend))
    patch(m)
    with opport.use_backend(backend), opport.strict():
        got = _train(m, kind)
    assert want[-1] < want[0]  # it trains
    rel = [abs(g - w) / abs(w) for g, w in zip(got, want)]
    assert max(rel) <= 1e-5, f"per-step relative loss differences {rel}"
    _assert_opport_ran(m, ATTENTION_OP[kind], STEPS * LAYERS)
