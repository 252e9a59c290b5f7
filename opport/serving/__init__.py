"""opport.serving: a small LLM serving engine on opport's ops (docs/serving.md "The engine").

    from opport.serving import Engine, SamplingParams
    engine = Engine(model, num_blocks=256, block_size=16, max_num_tokens=256)   # a transformers causal LM
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, seed=0))
    while engine.has_unfinished():
        for out in engine.step():          # StepOutput(request_id, token, finished, finish_reason)
            ...

Each step runs the (opport-patched) model once on a mixed batch: decodes and prefill chunks packed in one row,
each layer's K/V written by opport.kv_cache_write and attended by opport.paged_varlen_attention; the next tokens
come from opport.sample with each request's own settings and seeded uniforms. Continuous batching, chunked
prefill under a token budget, prefix caching with reference-counted blocks, EOS and stop tokens, preemption by
recompute when blocks run out (scheduler.py, blocks.py).
"""

from opport.serving.engine import Engine, StepOutput, check_model
from opport.serving.scheduler import SamplingParams

__all__ = ["Engine", "SamplingParams", "StepOutput", "check_model"]
