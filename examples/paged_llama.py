"""A small serving loop on opport's ops: greedy generation for a batch of prompts with a paged KV cache.

    python examples/paged_llama.py [--backend cpu|cuda|neuron] [--new-tokens 8]

The engine takes a Hugging Face Llama-family model (Llama, Mistral; q/k/v biases as in Qwen2 are taken
too) and runs it with opport ops only: `rmsnorm` / `add_rmsnorm` (each residual add fused with the next
norm), `matmul`, `rope`, `swiglu`, and the serving ops:
- prefill: every prompt's tokens packed into one [T, H, D] batch, `kv_cache_write` puts their K and V
  into the cache slots the block tables give them, `varlen_attention` attends within each prompt;
- decode: one token per sequence, `kv_cache_write` of its K and V (a new block when the last one is
  full), `paged_attention` over the sequence's cached blocks.
The cache is `num_blocks` blocks of `block_size` tokens per layer; a sequence owns the blocks its block
table lists, in order. Nothing here is specific to a backend: `opport.use_backend(...)` picks the kernels
(`tests/test_serving_example.py` checks that the tokens equal transformers' `generate` on all three).
"""

from __future__ import annotations

import argparse

import torch

import opport


class PagedCache:
    """Per-layer K and V caches [num_blocks, block_size, Hkv, D] and one block table per sequence."""

    def __init__(self, layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype):
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(layers)]
        self.block_size = block_size
        self.free = list(range(num_blocks - 1, -1, -1))  # popped from the end: blocks 0, 1, 2, ...
        self.tables: list[list[int]] = []

    def add_sequence(self) -> int:
        self.tables.append([])
        return len(self.tables) - 1

    def slots(self, seq: int, start: int, n: int) -> list[int]:
        """The cache slots of positions start .. start + n - 1 of `seq`, taking free blocks as needed."""
        table, bs = self.tables[seq], self.block_size
        while len(table) * bs < start + n:
            if not self.free:
                raise RuntimeError("KV cache full: raise num_blocks")
            table.append(self.free.pop())
        return [table[p // bs] * bs + p % bs for p in range(start, start + n)]

    def block_tables(self) -> torch.Tensor:
        """[B, max_blocks] int32; entries past a sequence's blocks are 0 (never read: context_lens bound it)."""
        width = max(1, max(len(t) for t in self.tables))
        return torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int32)


# what this loop computes: Llama's layout (pre-norm, SwiGLU, full rope, no q/k norm, no soft cap, no window)
SUPPORTED = ("llama", "qwen2")


def refuse(cfg):
    """Raise UnsupportedError for a model this loop would compute wrongly (a window, q/k norms, soft caps, another
    layer layout), instead of generating other tokens than the model would."""
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    why = (f"model_type {cfg.model_type!r} (this loop computes {SUPPORTED})" if cfg.model_type not in SUPPORTED else
           f"sliding_window={window}" if window is not None else None)
    if why:
        raise opport.UnsupportedError(op="examples.paged_llama", arg="model", constraint="paged_llama.model",
                                      expected=f"a {' or '.join(SUPPORTED)} model without a sliding window", got=why)


class PagedLlama:
    """Greedy generation with a paged KV cache; the weights are the model's own tensors (nothing copied but
    the transposed projections)."""

    def __init__(self, model, block_size: int = 16, num_blocks: int = 64):
        cfg, inner = model.config, model.model
        refuse(cfg)
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps, self.rotary = cfg.rms_norm_eps, inner.rotary_emb
        self.embed = inner.embed_tokens.weight.detach()
        self.layers = [self._layer(layer) for layer in inner.layers]
        self.norm = inner.norm.weight.detach()
        self.lm_head = model.lm_head.weight.detach().T.contiguous()
        self.block_size, self.num_blocks = block_size, num_blocks

    @staticmethod
    def _layer(layer) -> dict:
        att, mlp = layer.self_attn, layer.mlp

        def proj(linear):
            bias = linear.bias.detach() if linear.bias is not None else None
            return linear.weight.detach().T.contiguous(), bias

        return {"w_in": layer.input_layernorm.weight.detach(), "w_post": layer.post_attention_layernorm.weight.detach(),
                "q": proj(att.q_proj), "k": proj(att.k_proj), "v": proj(att.v_proj), "o": proj(att.o_proj),
                "gate": proj(mlp.gate_proj), "up": proj(mlp.up_proj), "down": proj(mlp.down_proj)}

    # ------------------------------------------------------------------ the model on a batch of tokens

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """Final-normed hidden states [T, H] of `tokens` at `positions`; attend(layer, q, k, v) -> [T, Hq, D]."""
        x = self.embed[tokens]
        normed, resid = opport.rmsnorm(x, self.layers[0]["w_in"], self.eps), x
        cos, sin = self._tables(x, positions)
        for i, w in enumerate(self.layers):
            q, k, v = (self._project(normed, w[n], h) for n, h in (("q", self.heads), ("k", self.kv_heads),
                                                                     ("v", self.kv_heads)))
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            att = attend(i, q, k, v).reshape(len(tokens), -1)
            normed, resid = opport.add_rmsnorm(opport.matmul(att, *w["o"]), resid, w["w_post"], self.eps)
            mlp = opport.matmul(opport.swiglu(opport.matmul(normed, *w["gate"]), opport.matmul(normed, *w["up"])),
                                *w["down"])
            following = self.layers[i + 1]["w_in"] if i + 1 < len(self.layers) else self.norm
            normed, resid = opport.add_rmsnorm(mlp, resid, following, self.eps)  # next layer's norm, or the final
        return normed

    def _project(self, x, weight_bias, heads: int) -> torch.Tensor:
        return opport.matmul(x, *weight_bias).reshape(len(x), heads, self.head_dim)

    def _tables(self, x, positions):
        """The model's own rotary tables at `positions`, as opport.rope takes them: [T, D/2]."""
        cos, sin = self.rotary(x, positions[None])
        half = self.head_dim // 2
        return cos[0, :, :half].contiguous(), sin[0, :, :half].contiguous()

    @staticmethod
    def _rope(x, cos, sin):
        """[T, H, D] rotated per token: opport.rope on the [1, H, T, D] view with [T, D/2] tables."""
        return opport.rope(x.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1).contiguous()

    def _logits(self, hidden):
        return opport.matmul(hidden, self.lm_head)

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        """Greedy continuation of each prompt (token ids), `new_tokens` tokens each."""
        if not prompts or min(len(p) for p in prompts) == 0:
            raise ValueError("generate needs at least one prompt and no empty prompt")
        cache = PagedCache(len(self.layers), self.num_blocks, self.block_size, self.kv_heads, self.head_dim,
                           self.embed.dtype)
        seqs = [cache.add_sequence() for _ in prompts]
        lens = [len(p) for p in prompts]
        with torch.no_grad():
            nxt = self._prefill(cache, seqs, prompts)
            out = [[t] for t in nxt.tolist()]
            for _ in range(new_tokens - 1):
                nxt = self._decode(cache, seqs, nxt, lens)
                lens = [n + 1 for n in lens]
                for o, t in zip(out, nxt.tolist()):
                    o.append(t)
        return out

    def _prefill(self, cache: PagedCache, seqs: list[int], prompts: list[list[int]]) -> torch.Tensor:
        lens = [len(p) for p in prompts]
        tokens = torch.tensor([t for p in prompts for t in p])
        positions = torch.cat([torch.arange(n) for n in lens])
        slots = torch.tensor([s for q, n in zip(seqs, lens) for s in cache.slots(q, 0, n)])
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

        def attend(i, q, k, v):
            opport.kv_cache_write(k, v, cache.k[i], cache.v[i], slots)
            return opport.varlen_attention(q, k, v, cu, cu, causal=True)

        hidden = self._forward(tokens, positions, attend)
        return self._logits(hidden[cu[1:].long() - 1]).argmax(-1)

    def _decode(self, cache: PagedCache, seqs: list[int], tokens: torch.Tensor, lens: list[int]) -> torch.Tensor:
        """One step: each sequence's newest token (at position lens[b]) in, its next token out."""
        slots = torch.tensor([cache.slots(q, n, 1)[0] for q, n in zip(seqs, lens)])
        tables = cache.block_tables()
        context = torch.tensor([n + 1 for n in lens], dtype=torch.int32)

        def attend(i, q, k, v):
            opport.kv_cache_write(k, v, cache.k[i], cache.v[i], slots)
            return opport.paged_attention(q, cache.k[i], cache.v[i], tables, context)

        return self._logits(self._forward(tokens, torch.tensor(lens), attend)).argmax(-1)


def tiny_llama(seed: int = 0):
    """A random 2-layer Llama (GQA 4/2 heads, head_dim 16): nothing is downloaded."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None  # generate exactly the asked number of tokens
    model.generation_config.pad_token_id = 0
    return model


def reference_generate(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' own greedy `generate`, one prompt at a time (no padding)."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False)
            out.append(ids[0, len(p):].tolist())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--new-tokens", type=int, default=8)
    args = ap.parse_args(argv)
    model = tiny_llama()
    prompts = [[5, 17, 42], list(range(1, 20)), [7] * 33]  # 3, 19 and 33 tokens: blocks of 16 fill and spill
    engine = PagedLlama(model, block_size=16)
    with opport.use_backend(args.backend), opport.strict():
        got = engine.generate(prompts, args.new_tokens)
    want = reference_generate(model, prompts, args.new_tokens)
    for g, w in zip(got, want):
        print(("same  " if g == w else "DIFFER"), g, w)
    return 0 if got == want else 1


if __name__ == "__main__":
    raise SystemExit(main())
