"""sampling_probs on NKI: sample's filters (opport/backends/neuron/sample.py), then the kept weights times the
reciprocal of their sum."""

import numpy as np

from opport.backends.neuron.sample import launch, supports
from opport.dispatch import impl
from opport.ops.sampling_probs import sampling_probs as spec


@impl(spec, "neuron", supports=supports)
def sampling_probs(logits: np.ndarray, temperature, top_k, top_p, min_p):
    return launch(logits, None, temperature, top_k, top_p, min_p, probs=True)
