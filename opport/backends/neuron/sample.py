"""sample on NKI: rows on the partitions; the filters as radix-searched thresholds (value, then index among ties),
the inverse CDF as an index search (opport/backends/neuron/_sampling.py)."""

import numpy as np

from opport.backends.neuron._sampling import launch, supports
from opport.dispatch import impl
from opport.ops.sample import sample as spec


@impl(spec, "neuron", supports=supports)
def sample(logits: np.ndarray, uniforms, temperature, top_k, top_p, min_p):
    return launch(logits, uniforms, temperature, top_k, top_p, min_p, probs=False)
