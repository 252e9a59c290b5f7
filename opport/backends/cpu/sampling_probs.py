"""sampling_probs on NumPy: the filters of opport/backends/cpu/_sampling.py, each row divided by its kept mass."""

import numpy as np

from opport.backends.cpu._sampling import filtered
from opport.dispatch import impl
from opport.ops.sampling_probs import sampling_probs as spec


@impl(spec, "cpu")
def sampling_probs(logits, temperature, top_k, top_p, min_p):
    w, status = filtered(logits, temperature, top_k, top_p, min_p)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = (w / np.sum(w, axis=1, keepdims=True)).astype(np.float32)
    out[status < 0] = np.nan
    return out
