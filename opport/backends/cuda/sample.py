"""sample in Triton: one program per row, the filters as order-key thresholds found by P-ary searches, the
inverse CDF as an index search (opport/backends/cuda/_sampling.py)."""

import torch

from opport.backends.cuda._sampling import launch, supports
from opport.dispatch import impl
from opport.ops.sample import sample as spec


@impl(spec, "cuda", supports=supports)
def sample(logits: torch.Tensor, uniforms, temperature, top_k, top_p, min_p):
    return launch(logits, uniforms, temperature, top_k, top_p, min_p, probs=False)
