"""The token layout of a batch, read once per forward by the patched base model for every attention layer.

Hugging Face turns padding and packing into a materialised [B, 1, Sq, Sk] mask before the attention runs;
opport reads the same information where it enters the model (the 2-D `attention_mask`, `position_ids`,
FlashAttention's `cu_seq_lens_q/k` keywords) and hands it to each attention layer as a `Layout` (under the
keyword `opport_layout`), which maps the call to varlen_attention:

- dense: no padding, one document per row: `attention` (causal, bottom-right, with the layer's window);
- padded: a 2-D mask with zeros (left, right or any padding): the valid tokens of each row are gathered
  into packed rows, run as one sequence per row, and scattered back (pad positions get 0);
- packed: `cu_seq_lens_q` (and `_k`) as FlashAttention's varlen path takes them, or `position_ids` that
  break (the next position is not the previous + 1: Hugging Face's rule) while there is no padding and
  nothing in the cache: one sequence per document;
- custom: a 4-D or prepared mask (a dict of masks): opport cannot read its layout, the attention hands back;
  misfit: a 2-D mask whose length is not the cached plus the new tokens: the same; traced: a 2-D mask or
  position_ids while torch.compile traces (the layout depends on their values): the same (cu_seq_lens run).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KEY = "opport_layout"  # the keyword the patched base model passes down to its attention layers


class Layout:
    def __init__(self, kind: str, mask=None, cu_q=None, cu_k=None):
        self.kind, self.mask, self.cu_q, self.cu_k = kind, mask, cu_q, cu_k
        self._rows: dict = {}

    @property
    def varlen(self) -> bool:
        return self.kind in ("padded", "packed")

    def rows(self, n: int, device):
        """Padded: (flat indices of the valid tokens among the last n columns, their int32 cu_seqlens, whether
        each row's valid tokens are contiguous). Memoized: the queries and keys of every layer share it."""
        if n not in self._rows:
            m = self.mask[:, self.mask.shape[1] - n:].to(device)
            counts = m.sum(1)
            first = m.int().argmax(1)
            last = n - 1 - m.flip(1).int().argmax(1)
            contiguous = bool(((counts == 0) | (last - first + 1 == counts)).all())
            cu = F.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
            self._rows[n] = (m.reshape(-1).nonzero().squeeze(1), cu, contiguous)
        return self._rows[n]


class PagedStep(Layout):
    """A serving step (opport.serving): the new tokens of a mixed batch packed in one row [1, T], each layer's K/V
    written to its paged cache at `slots` and attended with paged_varlen_attention (tables, cu_seqlens_q and context
    lengths as that op takes them). `cache.layer(layer_idx, k, v)` gives the layer's (k_cache, v_cache, k_scale,
    v_scale), made on first use from the layer's own K/V heads, head size and dtype (the scales: None, or an fp8
    cache's per-token ones)."""

    def __init__(self, cache, slots, block_tables, cu_seqlens_q, context_lens):
        super().__init__("paged")
        self.cache, self.slots = cache, slots
        self.block_tables, self.cu_seqlens_q, self.context_lens = block_tables, cu_seqlens_q, context_lens


DENSE = Layout("dense")
CUSTOM = Layout("custom")
MISFIT = Layout("misfit")  # a 2-D mask whose length is not the cached plus the new tokens
TRACED = Layout("traced")  # a mask or position_ids under torch.compile: their values are not known


def read(attention_mask, position_ids, cache, kwargs: dict, shape) -> Layout:
    """The layout of this forward's batch of `shape` (B, S, ...) tokens (the module docstring has the rules)."""
    traced = torch.compiler.is_compiling()  # values cannot be read: a mask or position_ids hand back
    if attention_mask is not None:
        if not (isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 2):
            return CUSTOM
        if traced:
            return TRACED
        if attention_mask.shape[1] != _past(cache) + shape[1]:  # HF pads or slices it: not the tokens one to one
            return MISFIT
        if not bool(attention_mask.all()):
            return Layout("padded", mask=attention_mask.bool())
    cu_q = kwargs.get("cu_seq_lens_q")
    if cu_q is not None:
        cu_k = kwargs.get("cu_seq_lens_k")
        return Layout("packed", cu_q=cu_q.to(torch.int32), cu_k=(cu_q if cu_k is None else cu_k).to(torch.int32))
    if position_ids is not None and position_ids.ndim == 2:
        if traced:
            return TRACED
        cu = _documents(position_ids, shape[0]) if _past(cache) == 0 else None
        if cu is not None:
            return Layout("packed", cu_q=cu, cu_k=cu)
    return DENSE


def _past(cache) -> int:
    return 0 if cache is None else int(cache.get_seq_length())


def _documents(position_ids, batch: int):
    """int32 cu_seqlens over the B*S tokens, a document starting at each row's start and wherever the position
    is not the previous + 1; None when every row holds one document."""
    pos = position_ids.expand(batch, -1) if position_ids.shape[0] != batch else position_ids
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] - pos[:, :-1] != 1
    if int(starts.sum()) == batch:
        return None
    first = starts.reshape(-1).nonzero().squeeze(1)
    return torch.cat([first, first.new_tensor([pos.numel()])]).to(torch.int32)


def in_token_order(cache, layer_idx: int) -> bool:
    """Whether this layer's cached keys are the sequence's last tokens in order, ending with the queries
    (DynamicCache's full and sliding-window layers), as bottom-right causal attention takes them."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return layers is not None and layer_idx < len(layers) and isinstance(layers[layer_idx], DynamicLayer)
