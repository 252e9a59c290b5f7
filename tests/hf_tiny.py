"""Tiny random Hugging Face models built from configs (nothing downloaded) and the batches the transformers
integration tests feed them: dense, padded (left and right), packed (position_ids that restart per document,
FlashAttention's cu_seq_lens keywords). Imported by tests/test_integration_transformers*.py."""

from __future__ import annotations

import torch

import opport
from opport.dispatch import backends, kernels

# Probe cuda before transformers imports triton: without a GPU, Triton's interpreter must be switched on first.
CUDA_UNAVAILABLE = backends()["cuda"].unavailable() if "cuda" in backends() else "no cuda backend installed"
import transformers  # noqa: E402

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
}
LAYERS = 2
VOCAB = 97
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
SMALLER = dict(hidden_size=32, intermediate_size=48)  # for the emulating backends (Triton's interpreter, NKI's)
WINDOW = 3  # in reach of every batch below (9 tokens a row): the window changes the result
# family -> config overrides: Mistral's window on every layer; Qwen2's on layers >= max_window_layers only
WINDOWED = {"mistral": dict(sliding_window=WINDOW),
            "qwen2": dict(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1)}
PATCHED_OPS = ("rmsnorm", "swiglu", "rope", "attention", "varlen_attention", "add_rmsnorm", "linear_cross_entropy")


def model(family="llama", dtype=torch.float32, **config):
    cfg_cls, model_cls = FAMILIES[family]
    torch.manual_seed(0)
    return model_cls(cfg_cls(**{**TINY, **config})).eval().to(dtype)


def ids(batch=2, seq=9, seed=3):
    return torch.randint(1, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def padded(batch=2, seq=9) -> tuple:
    """(input_ids, attention_mask): row 0 left-padded by 3, row 1 right-padded by 2 (pad id 0)."""
    x = ids(batch, seq)
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    mask[1, seq - 2:] = 0
    return x.masked_fill(mask == 0, 0), mask


DOCS = (4, 1, 5, 2)  # document lengths of the packed row (one of 1 token)


def packed() -> tuple:
    """(input_ids [1, 12], position_ids restarting per document, FlashAttention's varlen keywords), as TRL's
    padding-free collator (DataCollatorWithFlattening) hands them to the model."""
    pos = torch.cat([torch.arange(n) for n in DOCS])[None]
    cu = torch.tensor([0, *torch.tensor(DOCS).cumsum(0).tolist()], dtype=torch.int32)
    fa = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(DOCS), max_length_k=max(DOCS))
    return ids(1, sum(DOCS)), pos, fa


def packed_labels(x):
    """Labels of a packed row: no prediction across a document boundary (each document's first token -100)."""
    labels = x.clone()
    labels[0, torch.tensor([0, *torch.tensor(DOCS).cumsum(0)[:-1].tolist()])] = -100
    return labels


def logits(m, x, **kwargs):
    with torch.no_grad():
        return m(x, **kwargs).logits


def backend_skip(name: str, ops=PATCHED_OPS) -> str | None:
    """Why backend `name` cannot run the patched model's forward ops, or None."""
    if name not in backends():
        return f"no {name} backend installed"
    b = backends()[name]
    reason = b.unavailable()
    if reason:
        return f"{name} backend unavailable: {reason}"
    missing = [op for op in ops if not kernels(opport.get_op(op), b)]
    return f"{name} backend has no kernel for {', '.join(missing)}" if missing else None
