"""The KV cache's blocks: reference counts, a free list in eviction order, and the prefix cache.

A block holds `block_size` consecutive positions of a sequence. A full block is named by the hash of every token
up to its end (a chain: the previous block's hash and its own tokens), so two requests whose prompts share a
prefix share its full blocks: the second takes them with their K/V already computed (prefix caching). A block
nobody holds any longer goes to the free list but keeps its contents and its hash until it is handed out again,
least recently freed first, so a finished request's prefix stays reusable for as long as memory allows.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


def chain_hash(parent: bytes, tokens) -> bytes:
    """The name of a full block: SHA-256 over its predecessor's name and its token ids (no collisions to fear)."""
    return hashlib.sha256(parent + np.asarray(tokens, np.int64).tobytes()).digest()


class BlockPool:
    """`num_blocks` blocks with reference counts; `take` hands out free ones, `share` takes cached full blocks."""

    def __init__(self, num_blocks: int):
        self.refs = [0] * num_blocks
        self.free: OrderedDict = OrderedDict((b, None) for b in range(num_blocks))  # eviction order, oldest first
        self.cached: dict = {}  # hash -> block holding that full prefix block
        self.hash_of: dict = {}  # block -> its hash (while its contents are that block's)

    def num_free(self) -> int:
        return len(self.free)

    def take(self) -> int:
        """A free block for new contents (the least recently freed; its cached prefix, if any, is forgotten)."""
        block, _ = self.free.popitem(last=False)
        old = self.hash_of.pop(block, None)
        if old is not None:
            del self.cached[old]
        self.refs[block] = 1
        return block

    def lookup(self, name: bytes) -> int | None:
        return self.cached.get(name)

    def share(self, block: int) -> None:
        """Hold a cached block (again): out of the free list while anyone holds it."""
        if self.refs[block] == 0:
            del self.free[block]
        self.refs[block] += 1

    def release(self, blocks) -> None:
        """Drop one hold on each block; a block nobody holds is free (newest last), keeping its cached contents.
        Released in reverse, so a sequence's last blocks are evicted before its prefix."""
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free[block] = None

    def name(self, block: int, name: bytes) -> None:
        """Record that `block` now holds the full prefix block `name` (first holder wins; a duplicate stays
        unnamed and is freed as plain memory)."""
        if name not in self.cached and block not in self.hash_of:
            self.cached[name] = block
            self.hash_of[block] = name
