"""opport.serving's engine against transformers' batched `generate`, on the cpu backend, in one process: decode
tokens/s and time to first token for a batch of prompts of mixed lengths (random Llama from a config, nothing
downloaded). Interleaved rounds after a warm-up round; prints medians.

    .venv/bin/python tools/bench_serving.py [--rounds 3] [--prompts 8] [--new 32]

transformers runs the batch left-padded (its DynamicCache, SDPA); the engine runs it as continuous batching over
the paged cache (chunked prefill under max_num_tokens, then one decode row per request). Time to first token is
until every request has its first token (transformers' prefill step; the engine's steps until all prompts are in).
Both are greedy and produce the same tokens (checked: a run that differs is reported, not timed).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

import opport
from opport.serving import Engine, SamplingParams

CONFIG = dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=1024)


def _hf(model, prompts, new: int) -> tuple:
    """(tokens per prompt, seconds to the first token, total seconds) of batched generate, left-padded."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kw)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
        total = time.perf_counter() - t0
    return [row[width:].tolist() for row in out], ttft, total


def _engine(model, prompts, new: int, budget: int, kv_cache_dtype=None) -> tuple:
    engine = Engine(model, num_blocks=len(prompts) * 16, block_size=16, max_num_tokens=budget,
                    kv_cache_dtype=kv_cache_dtype)
    rids = [engine.add_request(p, SamplingParams(max_tokens=new)) for p in prompts]
    first, t0 = None, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        if first is None and all(engine.output(r) for r in rids):
            first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return [engine.pop(r) for r in rids], first, total


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--budget", type=int, default=512, help="the engine's max_num_tokens")
    ap.add_argument("--kv-cache-dtype", default=None, choices=["float8_e4m3fn", "float8_e5m2"],
                    help="the engine's fp8 cache: its tokens are then compared with generate's, not required equal")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    model.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, CONFIG["vocab_size"], (32 + 24 * (i % 4),), generator=g).tolist()
               for i in range(args.prompts)]
    new_tokens = args.prompts * args.new
    rows = {"transformers generate": [], "opport.serving": []}
    for r in range(args.rounds + 1):  # round 0 warms up (numba's cache, torch's allocator): not counted
        want, ttft, total = _hf(model, prompts, args.new)
        if r:
            rows["transformers generate"].append((ttft, new_tokens / total))
        with opport.use_backend("cpu"), opport.strict():
            got, ttft, total = _engine(model, prompts, args.new, args.budget, args.kv_cache_dtype)
        from opport.integrations.transformers import unpatch

        unpatch(model)
        same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
        if args.kv_cache_dtype and not r:
            print(f"{args.kv_cache_dtype} cache: {same} of {new_tokens} tokens equal generate's")
        elif got != want and not args.kv_cache_dtype:
            print("tokens differ from transformers' generate: not timed")
            return
        if r:
            rows["opport.serving"].append((ttft, new_tokens / total))
    print(f"{args.prompts} prompts of 32-104 tokens, {args.new} new tokens each, hidden {CONFIG['hidden_size']}, "
          f"{CONFIG['num_hidden_layers']} layers; medians of {args.rounds} interleaved rounds")
    base = statistics.median(r[1] for r in rows["transformers generate"])
    for name, vals in rows.items():
        ttft, tps = statistics.median(v[0] for v in vals), statistics.median(v[1] for v in vals)
        print(f"{name:24s} time to first token {ttft * 1e3:8.1f} ms   {tps:8.1f} tokens/s   {tps / base:5.2f}x")


if __name__ == "__main__":
    main()
