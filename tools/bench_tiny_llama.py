"""A tiny random Llama (transformers' LlamaConfig, nothing downloaded) on the cpu backend: a training step
(forward, loss, backward) and a greedy decode, unpatched (torch eager) against patched with opport (fused numba
loops, then OPPORT_NUMBA=0's NumPy kernels), interleaved in one process. Prints medians in ms and the ratios.

    .venv/bin/python tools/bench_tiny_llama.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import transformers

from opport.integrations.transformers import patch, unpatch

CONFIG = dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)


def _time(fn, reps: int) -> float:
    fn()  # warm (numba's cache load, torch's allocator)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) * 1e3 / reps


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    batch = torch.randint(1, CONFIG["vocab_size"], (4, 128), generator=torch.Generator().manual_seed(1))
    prompt = batch[:1, :16]

    def train_step():
        model.train()
        model.zero_grad(set_to_none=True)
        model(input_ids=batch, labels=batch).loss.backward()

    def decode():
        model.eval()
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=32, do_sample=False, min_new_tokens=32)

    results = {k: {"train": [], "decode": []} for k in ("torch eager", "opport (fused)", "opport (NumPy kernels)")}
    for _ in range(args.rounds):  # interleaved: every variant once per round
        for name in results:
            if name == "torch eager":
                unpatch(model)
            else:
                patch(model)
                os.environ["OPPORT_NUMBA"] = "0" if "NumPy" in name else "1"
            results[name]["train"].append(_time(train_step, 2))
            results[name]["decode"].append(_time(decode, 1))
    unpatch(model)
    os.environ.pop("OPPORT_NUMBA", None)
    base = {k: statistics.median(v) for k, v in results["torch eager"].items()}
    print(f"tiny Llama {CONFIG}, train batch {tuple(batch.shape)}, decode 16 + 32 tokens; torch threads "
          f"{torch.get_num_threads()}; medians of {args.rounds} interleaved rounds")
    for name, r in results.items():
        tr, de = statistics.median(r["train"]), statistics.median(r["decode"])
        print(f"{name:24s} train step {tr:8.1f} ms ({base['train'] / tr:.2f}x torch)   "
              f"greedy decode {de:8.1f} ms ({base['decode'] / de:.2f}x torch)")


if __name__ == "__main__":
    main()
