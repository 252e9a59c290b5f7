"""opport.serving on a tiny Gemma 2 (built from a config, nothing downloaded): requests that arrive while others
run, a shared prompt prefix, greedy and seeded sampling side by side, on any backend.

    python examples/serve.py [--backend cpu|cuda|neuron]

Gemma 2 is the family that needs most from the engine: alternating sliding-window layers, attention and
final-logit soft caps, (1 + weight) norms and a tanh-GELU MLP, all taken from the patched model itself. The
greedy request is checked against transformers' own `generate` (exit status 1 if they differ); `stats` shows
that every attention call ran opport's paged kernels.
"""

from __future__ import annotations

import argparse

import torch
import transformers

import opport
from opport.integrations.transformers import stats
from opport.serving import Engine, SamplingParams


def tiny_gemma2(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                                    query_pre_attn_scalar=16, attn_logit_softcapping=50.0,
                                    final_logit_softcapping=30.0, max_position_embeddings=256)
    return transformers.Gemma2ForCausalLM(cfg).eval()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu")
    args = ap.parse_args(argv)
    model = tiny_gemma2()
    system = list(range(10, 42))  # a 32-token prefix every request shares: two cached blocks after the first
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(max_tokens=12, temperature=0.8, top_k=40, top_p=0.95, seed=7, ignore_eos=True)
    with torch.no_grad():
        want = model.generate(torch.tensor([system + [50, 51, 52]]), max_new_tokens=12, do_sample=False,
                              eos_token_id=None)[0, len(system) + 3:].tolist()
    engine = Engine(model, num_blocks=64, block_size=16, max_num_tokens=48)
    with opport.use_backend(args.backend), opport.strict():
        first = engine.add_request(system + [50, 51, 52], greedy)
        steps = 0
        while engine.has_unfinished():
            if steps == 2:  # arrives while the first request decodes: its prefix comes from the cache
                second = engine.add_request(system + [60, 61], sampled)
            engine.step()
            steps += 1
    got, other = engine.pop(first), engine.pop(second)
    print(f"greedy  {got}\n        {'equal to' if got == want else 'DIFFERENT from'} transformers' generate")
    print(f"sampled {other} (temperature 0.8, top-k 40, top-p 0.95, seed 7)")
    print(f"{steps} steps; {engine.scheduler.prefix_hits} prefix blocks reused; through opport: "
          + ", ".join(f"{op} {c['opport']}" for op, c in stats(model).items() if c["opport"]))
    return 0 if got == want else 1


if __name__ == "__main__":
    raise SystemExit(main())
