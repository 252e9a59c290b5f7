"""sampling_probs in Triton: sample's filters (opport/backends/cuda/_sampling.py), then each kept weight divided by
the kept mass in one more pass over the row."""

import torch

from opport.backends.cuda._sampling import launch, supports
from opport.dispatch import impl
from opport.ops.sampling_probs import sampling_probs as spec


@impl(spec, "cuda", supports=supports)
def sampling_probs(logits: torch.Tensor, temperature, top_k, top_p, min_p):
    return launch(logits, None, temperature, top_k, top_p, min_p, probs=True)
