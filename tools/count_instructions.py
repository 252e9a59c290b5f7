"""Instructions one tiny-Llama greedy decode or training step executes on the cpu backend, patched with opport against
unpatched torch eager, counted by valgrind's callgrind: a measure the machine's load does not move (wall-clock
ratios on the 2-core VMs swing by 20% from one minute to the next; instruction counts repeat to a few parts in a
thousand). Cache misses are not counted, and valgrind has no AVX-512 (every library, numba's loops included, takes its
AVX2 path under it): confirm a change with tools/bench_tiny_llama.py before calling it faster.

    .venv/bin/python tools/count_instructions.py [--what decode|train] [--repo PATH]

Needs valgrind, gcc and valgrind's callgrind.h (Debian: valgrind). Each variant runs in its own valgrind (about a
minute each); only the measured call is instrumented, after two warm calls. --repo runs the patched variant with
another checkout's opport first on the path (an A/B of two trees: `git worktree add /tmp/old HEAD~1`).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

TOGGLE = """#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void cg_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS; }
"""


def _measured(what: str, variant: str, lib: str) -> None:
    """Inside valgrind: build the model, warm it, and count one call between the toggles."""
    import ctypes

    import torch
    import transformers

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_tiny_llama import CONFIG

    from opport.integrations.transformers import patch

    toggle = ctypes.CDLL(lib)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    if variant != "torch":
        patch(model)
    batch = torch.randint(1, CONFIG["vocab_size"], (4, 128), generator=torch.Generator().manual_seed(1))

    def call():
        if what == "train":
            model.train()
            model.zero_grad(set_to_none=True)
            model(input_ids=batch, labels=batch).loss.backward()
        else:
            model.eval()
            with torch.no_grad():
                model.generate(batch[:1, :16], max_new_tokens=32, do_sample=False, min_new_tokens=32)

    call()
    call()
    toggle.cg_start()
    call()
    toggle.cg_stop()


def _count(what: str, variant: str, lib: str, tmp: str, repo: str | None) -> int:
    out = os.path.join(tmp, f"{what}-{variant}.out")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPPORT_NUM_THREADS="1")
    if repo is not None:
        env["PYTHONPATH"] = os.pathsep.join([repo, env.get("PYTHONPATH", "")])
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}", sys.executable,
           __file__, "--inside", what, variant, lib]
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    dumped = (Path(out + ".1") if Path(out + ".1").exists() else Path(out)).read_text()
    return int(re.search(r"^totals:\s*(\d+)", dumped, re.M).group(1))


def main(argv=None) -> None:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--inside":
        return _measured(*sys.argv[2:5])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", choices=("decode", "train"), default="decode")
    ap.add_argument("--repo", help="another checkout whose opport the patched variant also runs (A/B of two trees)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = os.path.join(tmp, "toggle.c"), os.path.join(tmp, "libtoggle.so")
        Path(src).write_text(TOGGLE)
        subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", lib, src], check=True)
        counts = {"torch eager": _count(args.what, "torch", lib, tmp, None),
                  "opport (this tree)": _count(args.what, "opport", lib, tmp, None)}
        if args.repo:
            counts[f"opport ({args.repo})"] = _count(args.what, "opport", lib, tmp, os.path.abspath(args.repo))
    base = counts["torch eager"]
    print(f"tiny Llama {args.what}, instructions (callgrind), one call after two warm ones, 1 thread")
    for name, n in counts.items():
        print(f"{name:32s} {n:>14,d}  ({base / n:.3f}x torch's count)")


if __name__ == "__main__":
    main()
