"""sample on NumPy: the filters of opport/backends/cpu/_sampling.py, then the inverse CDF by a cumulative sum."""

import numpy as np

from opport.backends.cpu._sampling import filtered
from opport.dispatch import impl
from opport.ops.sample import sample as spec


@impl(spec, "cpu")
def sample(logits, uniforms, temperature, top_k, top_p, min_p):
    w, status = filtered(logits, temperature, top_k, top_p, min_p)
    b = w.shape[0]
    tokens = np.empty(b, np.int32)
    if b == 0:
        return tokens
    c = np.cumsum(w, axis=1, dtype=np.float64)
    hit = c > (uniforms.astype(np.float64) * c[:, -1])[:, None]
    last = w.shape[1] - 1 - np.argmax((w > 0)[:, ::-1], axis=1)  # past the end by rounding: the last kept token
    tokens[:] = np.where(hit.any(axis=1), np.argmax(hit, axis=1), last)
    tokens[status < 0] = -1
    return tokens
