"""Requests and the scheduler: continuous batching, chunked prefill under a token budget, prefix caching and
preemption by recompute.

Each step the scheduler picks, under `max_num_tokens`, a number of new tokens per request: the running requests
first, in the order they were admitted (a decode needs 1 token, a prompt being prefilled the rest of it or the
budget's remainder: chunked prefill), then waiting requests in arrival order while the budget, `max_num_seqs` and
free blocks allow. A request admitted from the waiting queue first takes the cached full blocks of its prefix.
When a running request needs a block and none is free, the most recently admitted running request is preempted:
its blocks are released (their full, named blocks stay cached) and it waits at the head of the queue, to be
recomputed, prompt and generated tokens alike, when it is admitted again. A request never waits on a full cache
forever: every request fits the whole cache alone (`Engine.add_request` checks), and the earliest running request
is never preempted for a later one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from opport.errors import ArgumentError
from opport.serving.blocks import BlockPool, chain_hash


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings, as opport.sample takes them (docs/serving.md "Sampling").

    temperature 0 is greedy (argmax, ties to the lowest id); top_k 0 and top_p 1 and min_p 0 are off. `seed` seeds
    the request's own generator of uniforms (one float32 in [0, 1) per sampled token), so a request's tokens do not
    depend on what it is batched with; None draws a seed from the OS. Generation stops after `max_tokens` tokens,
    or at a token of `stop_token_ids` or the model's EOS (unless `ignore_eos`), which is kept in the output."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple = ()
    ignore_eos: bool = False

    def __post_init__(self):
        for name, ok, rule in (("max_tokens", self.max_tokens >= 1, "an int >= 1"),
                               ("temperature", 0.0 <= self.temperature < float("inf"), "a finite number >= 0"),
                               ("top_k", self.top_k >= 0, "an int >= 0"),
                               ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
                               ("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1]")):
            if not ok:
                raise ArgumentError(op="serving.SamplingParams", arg=name, constraint=f"serving.{name}", expected=rule,
                                    got=repr(getattr(self, name)))


@dataclass(eq=False)
class Request:
    id: str
    tokens: list  # the prompt, then every generated token
    prompt_len: int
    params: SamplingParams
    stop: frozenset
    rng: np.random.Generator
    blocks: list = field(default_factory=list)  # the cache blocks of positions 0, bs, 2 bs, ...
    names: list = field(default_factory=list)  # the chain hashes of its full blocks so far
    num_computed: int = 0  # positions whose K/V are in its blocks
    finish_reason: str | None = None  # "length", "stop" or "invalid_logits" once finished

    @property
    def output(self) -> list:
        return self.tokens[self.prompt_len:]

    def name_of(self, i: int, block_size: int) -> bytes:
        """The chain hash of full block i of its tokens (computed once)."""
        while len(self.names) <= i:
            j = len(self.names)
            self.names.append(chain_hash(self.names[-1] if self.names else b"", self.tokens[j * block_size:
                                                                                              (j + 1) * block_size]))
        return self.names[i]


class Scheduler:
    def __init__(self, pool: BlockPool, block_size: int, max_num_tokens: int, max_num_seqs: int,
                 prefix_caching: bool = True):
        self.pool, self.block_size = pool, block_size
        self.max_num_tokens, self.max_num_seqs, self.prefix_caching = max_num_tokens, max_num_seqs, prefix_caching
        self.waiting: deque = deque()
        self.running: list = []
        self.preempted = self.prefix_hits = 0  # preemptions, and cached blocks requests took, so far

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list:
        """[(request, new tokens this step)], running requests first, then admitted ones (see the module doc)."""
        budget, out = self.max_num_tokens, []
        for req in list(self.running):
            if req not in self.running or budget == 0:
                continue  # preempted by an earlier request of this step
            n = min(len(req.tokens) - req.num_computed, budget)
            if self._reserve_or_preempt(req, n):
                out.append((req, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if self.prefix_caching:
                self._take_prefix(req)
            n = min(len(req.tokens) - req.num_computed, budget)
            if not self._reserve(req, n):
                self._release(req)
                break
            self.waiting.popleft()
            self.running.append(req)
            out.append((req, n))
            budget -= n
        return out

    def computed(self, req: Request, n: int) -> None:
        """After a step: n more positions of req are in its blocks; its newly full blocks join the prefix cache."""
        before = req.num_computed // self.block_size
        req.num_computed += n
        if self.prefix_caching:
            for i in range(before, req.num_computed // self.block_size):
                self.pool.name(req.blocks[i], req.name_of(i, self.block_size))

    def finish(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)

    def _take_prefix(self, req: Request) -> None:
        """Share the cached full blocks of req's tokens, at most up to its last token (which must be computed
        for its logits)."""
        for i in range((len(req.tokens) - 1) // self.block_size):
            block = self.pool.lookup(req.name_of(i, self.block_size))
            if block is None:
                break
            self.pool.share(block)
            req.blocks.append(block)
            self.prefix_hits += 1
        req.num_computed = len(req.blocks) * self.block_size

    def _reserve(self, req: Request, n: int) -> bool:
        """Blocks for positions up to num_computed + n, if that many are free."""
        need = -(-(req.num_computed + n) // self.block_size) - len(req.blocks)
        if need > self.pool.num_free():
            return False
        req.blocks.extend(self.pool.take() for _ in range(need))
        return True

    def _reserve_or_preempt(self, req: Request, n: int) -> bool:
        while not self._reserve(req, n):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        self.preempted += 1
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        self.pool.release(req.blocks)
        req.blocks, req.num_computed = [], 0
