"""Block allocation with hash-chained prefix reuse (after nano-vllm's BlockManager).

A full block is identified by the hash of its tokens chained to the hash of
the block before it, so equal hashes mean equal whole prefixes. Freed blocks
keep their hash until they are handed out again, so a later request with the
same prefix can pick them back up.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from specmesh.shared.core.images import PromptImages
from specmesh.shared.core.sequence import Sequence
from specmesh.shared.kvcache.events import CacheEventLog


def block_hash(tokens: list[int], prev_hash: int | None, salt: bytes = b"") -> int:
    """Stable across processes (unlike `hash`), so other services can address blocks by it.
    `salt`: what else the block's K/V depends on (the digests of images that begin in it)."""
    h = hashlib.blake2b(digest_size=8)
    if prev_hash is not None:
        h.update(prev_hash.to_bytes(8, "little"))
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    h.update(salt)
    return int.from_bytes(h.digest(), "little")


def prefix_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The hashes of `token_ids`'s whole blocks, chained as the prefix cache chains them."""
    hashes, prev = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = block_hash(token_ids[start : start + block_size], prev)
        hashes.append(prev)
    return hashes


def block_salt(images: PromptImages | None, index: int, block_size: int) -> bytes:
    """Block `index`'s salt: the digests of the prompt's images that begin in it."""
    if images is None:
        return b""
    return images.salt(index * block_size, (index + 1) * block_size)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    tokens: list[int] = field(default_factory=list)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.reused_tokens = 0  # prompt tokens served from the prefix cache, all time
        self.events: CacheEventLog | None = None  # set: hash_to_block's keys come and go here

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def _take(self, block_id: int | None = None) -> Block:
        """Claim a free block (a given one, or the least recently freed)."""
        if block_id is None:
            block_id = self.free_ids[0]
        self.free_ids.remove(block_id)
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
            self._forget(block.hash)
        block.hash, block.tokens, block.ref_count = None, [], 1
        return block

    def _forget(self, block_hash: int) -> None:
        del self.hash_to_block[block_hash]
        if self.events is not None:
            self.events.remove(block_hash)

    def flush(self) -> int:
        """Forget the prefix cache held by free blocks (blocks in use keep theirs, so
        running requests are untouched); how many blocks forgot their prefix."""
        forgotten = 0
        for block_id in self.free_ids:
            block = self.blocks[block_id]
            if block.hash is None:
                continue
            if self.hash_to_block.get(block.hash) == block_id:
                self._forget(block.hash)
            block.hash, block.tokens = None, []
            forgotten += 1
        return forgotten

    def _salt(self, seq: Sequence, index: int) -> bytes:
        salt = block_salt(seq.images, index, self.block_size)
        return seq.cache_salt + salt if index == 0 else salt

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding a prefix of `seq`. The last token is never covered,
        because its logits must be computed."""
        ids, prev = [], None
        for i in range((len(seq) - 1) // self.block_size):
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            prev = block_hash(tokens, prev, self._salt(seq, i))
            block_id = self.hash_to_block.get(prev)
            if block_id is None or self.blocks[block_id].tokens != tokens:
                break
            ids.append(block_id)
        return ids

    def num_cached_blocks(self, seq: Sequence) -> int:
        """How many of `seq`'s first blocks the prefix cache holds."""
        return len(self._cached_prefix(seq))

    def _blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_allocate(self, seq: Sequence, reserve: int = 0) -> bool:
        """Whether `seq` fits while leaving `reserve` blocks free."""
        cached = self._cached_prefix(seq)
        # Cached blocks sitting in the free list are claimed too, not only new ones.
        free_cached = sum(self.blocks[b].ref_count == 0 for b in cached)
        needed = self._blocks_needed(len(seq)) - len(cached) + free_cached
        return needed + reserve <= self.num_free

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` blocks for all its tokens, reusing cached prefix blocks."""
        assert not seq.block_table
        for block_id in self._cached_prefix(seq):
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self.free_ids.remove(block_id)
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_computed_tokens = seq.num_reused_tokens = len(seq.block_table) * self.block_size
        self.reused_tokens += seq.num_reused_tokens
        self.ensure_capacity(seq)

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_ids.append(block_id)
        seq.block_table.clear()
        seq.num_computed_tokens = 0

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq` can hold `num_tokens` more tokens than it has now."""
        return self._blocks_needed(len(seq) + num_tokens) - len(seq.block_table) <= self.num_free

    def ensure_capacity(self, seq: Sequence, extra_tokens: int = 0) -> None:
        while len(seq.block_table) < self._blocks_needed(len(seq) + extra_tokens):
            seq.block_table.append(self._take().block_id)

    def seal(self, seq: Sequence, computed_before: int) -> None:
        """Publish the blocks that became full of computed K/V since `computed_before`.
        Only computed blocks are published, so no request can reuse K/V still being written."""
        bs = self.block_size
        for i in range(computed_before // bs, seq.num_computed_tokens // bs):
            block = self.blocks[seq.block_table[i]]
            prev = self.blocks[seq.block_table[i - 1]].hash if i else None
            block.tokens = seq.token_ids[i * bs : (i + 1) * bs]
            block.hash = block_hash(block.tokens, prev, self._salt(seq, i))
            if self.events is not None and block.hash not in self.hash_to_block:
                self.events.store(block.hash)
            self.hash_to_block[block.hash] = block.block_id
