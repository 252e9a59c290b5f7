"""The engine: a patched Hugging Face causal LM run one mixed batch per step over a paged KV cache."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

import opport
from opport.dtypes import FP8
from opport.errors import ArgumentError
from opport.integrations.transformers import family_of, is_patched, patch
from opport.integrations.transformers.layout import KEY, PagedStep
from opport.serving.blocks import BlockPool
from opport.serving.scheduler import Request, SamplingParams, Scheduler


class PagedCache:
    """Per layer, k and v caches [num_blocks, block_size, Hkv, D], made at the layer's first step from its own K/V
    (their heads, head size and device: no config attribute to trust), in the K/V's dtype or in `dtype`, an fp8
    format, with per-(token, head) float32 scales [num_blocks, block_size, Hkv] (kv_cache_write_fp8's)."""

    def __init__(self, num_blocks: int, block_size: int, dtype: str | None = None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype = None if dtype is None else getattr(torch, dtype)
        self.layers: dict = {}

    def layer(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple:
        """(k_cache, v_cache, k_scale, v_scale) of layer i; the scales are None for a cache in the K/V's dtype."""
        if i not in self.layers:
            shape = (self.num_blocks, self.block_size)
            kc = k.new_zeros((*shape, *k.shape[1:]), dtype=self.dtype or k.dtype)
            vc = v.new_zeros((*shape, *v.shape[1:]), dtype=self.dtype or v.dtype)
            scales = (None, None) if self.dtype is None else (k.new_ones((*shape, k.shape[1]), dtype=torch.float32),
                                                              v.new_ones((*shape, v.shape[1]), dtype=torch.float32))
            self.layers[i] = (kc, vc, *scales)
        return self.layers[i]


@dataclass(frozen=True)
class StepOutput:
    """What one step did for one request: the token it generated (None for a prefill chunk that did not reach
    the prompt's end) and, once finished, why: "length", "stop", or "invalid_logits" (NaN or inf in its logits,
    where opport.sample returns -1: nothing is appended)."""

    request_id: str
    token: int | None
    finished: bool
    finish_reason: str | None


class Engine:
    """Continuous batching over a paged KV cache for a Hugging Face causal LM of a family opport patches.

    model: a transformers causal LM (any model_type in opport.integrations.transformers.FAMILIES); patched here
    if it is not already. num_blocks x block_size positions of cache per layer, in the dtype and on the device of
    the layer's K/V. max_num_tokens: the step's token budget (decodes count 1 each, prefills as many as they get);
    max_num_seqs: requests running at once. prefix_caching: share full blocks between requests with the same
    prefix. kv_cache_dtype: "float8_e4m3fn" or "float8_e5m2" stores the cache in fp8 with a scale per token and
    head (half a bf16 cache's bytes, a quarter of float32's; docs/numerics.md 3.12 for its accuracy); None keeps
    the model's dtype.
    """

    def __init__(self, model, num_blocks: int = 256, block_size: int = 16, max_num_tokens: int = 256,
                 max_num_seqs: int = 64, prefix_caching: bool = True, kv_cache_dtype: str | None = None):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size), ("max_num_tokens", max_num_tokens),
                            ("max_num_seqs", max_num_seqs)):
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ArgumentError(op="serving.Engine", arg=name, constraint=f"serving.{name}", expected="an int >= 1",
                                    got=repr(value))
        if kv_cache_dtype not in (None, *FP8):
            raise ArgumentError(op="serving.Engine", arg="kv_cache_dtype", constraint="serving.kv_cache_dtype",
                                expected=f"None or one of {FP8}", got=repr(kv_cache_dtype))
        self.model = model
        check_model(model)
        if not is_patched(model):
            patch(model)
        param = next(model.parameters())
        self.cache = PagedCache(num_blocks, block_size, kv_cache_dtype)
        self.device, self.block_size, self.capacity = param.device, block_size, num_blocks * block_size
        self.pool = BlockPool(num_blocks)
        self.scheduler = Scheduler(self.pool, block_size, max_num_tokens, max_num_seqs, prefix_caching)
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.eos = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
        self.requests: dict = {}
        self._ids = itertools.count()
        self.steps = 0  # model runs so far

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a prompt (token ids); it joins the running batch at a coming step. Returns its id."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt]
        rid = str(next(self._ids)) if request_id is None else request_id
        if not prompt:
            raise ArgumentError(op="serving.add_request", arg="prompt", constraint="serving.prompt",
                                expected="at least one token", got="an empty prompt")
        if len(prompt) + params.max_tokens > self.capacity:
            raise ArgumentError(op="serving.add_request", arg="prompt", constraint="serving.capacity",
                                expected=f"prompt + max_tokens <= the cache's {self.capacity} positions",
                                got=f"{len(prompt)} + {params.max_tokens}")
        if rid in self.requests:
            raise ArgumentError(op="serving.add_request", arg="request_id", constraint="serving.request_id",
                                expected="an id not in use", got=repr(rid))
        stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos)
        req = Request(rid, prompt, len(prompt), params, stop, np.random.default_rng(params.seed))
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def output(self, request_id: str) -> list:
        """The tokens generated so far for a request."""
        return list(self.requests[request_id].output)

    def pop(self, request_id: str) -> list:
        """A finished request's tokens, forgetting the request."""
        req = self.requests[request_id]
        if req.finish_reason is None:
            raise ArgumentError(op="serving.pop", arg="request_id", constraint="serving.finished",
                                expected="a finished request", got=f"{request_id!r} is still running")
        return list(self.requests.pop(request_id).output)

    # ------------------------------------------------------------------ steps

    def step(self) -> list:
        """Schedule, run the model once on every scheduled token, sample where a request reached its last token."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        step, ids, pos, last = self._inputs(batch)
        self.steps += 1
        with torch.no_grad():
            logits = self.model(input_ids=ids[None], position_ids=pos[None], use_cache=False,
                                logits_to_keep=last, **{KEY: step}).logits[0]
        done = [req for req, n in batch if req.num_computed + n == len(req.tokens)]
        tokens = self._sample(done, logits) if done else []
        out = []
        for req, n in batch:
            self.scheduler.computed(req, n)
        for req, tok in zip(done, tokens):
            if tok < 0:  # NaN or inf in the request's logits: opport.sample's invalid row
                req.finish_reason, tok = "invalid_logits", None
            else:
                req.tokens.append(tok)
                if tok in req.stop or len(req.output) >= req.params.max_tokens:
                    req.finish_reason = "stop" if tok in req.stop else "length"
            if req.finish_reason is not None:
                self.scheduler.finish(req)
            out.append(StepOutput(req.id, tok, req.finish_reason is not None, req.finish_reason))
        out += [StepOutput(req.id, None, False, None) for req, n in batch if req not in done]
        return out

    def generate(self, prompts, params: SamplingParams | list | None = None) -> list:
        """Run prompts to completion (all queued now); their generated tokens, in order."""
        many = isinstance(params, (list, tuple))
        rids = [self.add_request(p, params[i] if many else params) for i, p in enumerate(prompts)]
        while self.has_unfinished():
            self.step()
        return [self.pop(r) for r in rids]

    def _inputs(self, batch) -> tuple:
        """The step's PagedStep (slots, tables, cu_seqlens_q, context lengths), token ids, positions and the
        indices of the tokens whose logits are needed."""
        bs = self.block_size
        ids, pos, slots, cu, ctx, last = [], [], [], [0], [], []
        for req, n in batch:
            p = np.arange(req.num_computed, req.num_computed + n)
            ids += req.tokens[req.num_computed:req.num_computed + n]
            pos.append(p)
            slots.append(np.asarray(req.blocks)[p // bs] * bs + p % bs)
            cu.append(cu[-1] + n)
            ctx.append(req.num_computed + n)
            if req.num_computed + n == len(req.tokens):
                last.append(cu[-1] - 1)
        width = max(len(req.blocks) for req, _ in batch)
        tables = np.zeros((len(batch), width), np.int32)
        for b, (req, _) in enumerate(batch):
            tables[b, :len(req.blocks)] = req.blocks

        def dev(a, dtype):
            return torch.as_tensor(np.asarray(a), dtype=dtype).to(self.device)

        step = PagedStep(self.cache, dev(np.concatenate(slots), torch.int64), dev(tables, torch.int32),
                         dev(cu, torch.int32), dev(ctx, torch.int32))
        return step, dev(ids, torch.long), dev(np.concatenate(pos), torch.long), dev(last, torch.long)

    def _sample(self, reqs: list, logits: torch.Tensor) -> list:
        """opport.sample over the rows of the requests that reached their last token, each with its own settings
        and one uniform from its own generator."""
        ps = [r.params for r in reqs]

        def dev(vals, dtype):
            return torch.tensor(vals, dtype=dtype, device=logits.device)

        u = dev([float(r.rng.random(dtype=np.float32)) for r in reqs], torch.float32)
        tokens = opport.sample(logits, u, dev([p.temperature for p in ps], torch.float32),
                               dev([p.top_k for p in ps], torch.int32), dev([p.top_p for p in ps], torch.float32),
                               dev([p.min_p for p in ps], torch.float32))
        return [int(t) for t in tokens.tolist()]


def check_model(model) -> None:
    """Refuse, clearly, a model the engine would compute wrongly: a family the patcher does not know."""
    family_of(model, op="serving.Engine", constraint="serving.model_type")
