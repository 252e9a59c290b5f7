"""sampling_probs: the filtered, renormalised distribution of a decode step's logits (Llama-3 and Qwen vocabularies),
temperature 0.8, top_k 50, top_p 0.9, min_p 0.05. The baseline is a vLLM-style torch sort of each row."""

from opport.bench.workloads import Workload
from opport.bench.workloads._sampling import make as _make
from opport.bench.workloads._sampling import shapes, torch_probs


def make(d, dtype, mk):
    return _make(d, dtype, mk, uniforms=False)


WORKLOAD = Workload(
    "sampling_probs", shapes("sampling_probs"), make, torch_eager=torch_probs,
    torch_call="torch.sort(logits, descending, stable) + cumsum top-k/top-p masks, min-p, renormalised (vLLM-style)",
)
