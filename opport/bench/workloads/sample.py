"""sample: one token per row of a decode step's logits (Llama-3 and Qwen vocabularies), temperature 0.8, top_k 50,
top_p 0.9, min_p 0.05. The baseline is a vLLM-style torch sampler: a stable sort of each row, cumulative sums."""

from opport.bench.workloads import Workload
from opport.bench.workloads._sampling import make as _make
from opport.bench.workloads._sampling import shapes, torch_sample


def make(d, dtype, mk):
    return _make(d, dtype, mk, uniforms=True)


WORKLOAD = Workload(
    "sample", shapes("sample"), make, torch_eager=torch_sample,
    torch_call="torch.sort(logits, descending, stable) + cumsum top-k/top-p masks, min-p, cumsum inverse CDF (vLLM-style)",
)
