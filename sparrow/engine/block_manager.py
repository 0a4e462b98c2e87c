"""Paged KV-cache bookkeeping: fixed-size blocks, reference counts, and prefix hashes.

A full block of prompt tokens is hashed with its predecessor's hash (so the hash names the whole prefix; the
first block's predecessor is the sequence's LoRA adapter id, so two adapters never share a block);
a new sequence whose first blocks hash the same reuses them instead of recomputing. Freed blocks keep
their hash until they are handed out again (least recently freed first), so a prefix outlives its request.
"""
from __future__ import annotations

from collections import OrderedDict

from sparrow.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.block_hash: dict[int, int] = {}
        self.prefix_cache_queries = 0
        """Prompt tokens looked up in the prefix cache on admission (vLLM's prefix_cache_queries)."""
        self.prefix_cache_hits = 0
        """Of those, tokens found cached (vLLM's prefix_cache_hits)."""

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction in [0, 1] of the blocks held by a live sequence (cached free blocks count as free): vLLM's
        kv_cache_usage_perc."""
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``seq`` needs to hold ``num_tokens`` tokens in total."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def _take_free(self) -> int:
        block, _ = self.free.popitem(last=False)
        h = self.block_hash.pop(block, None)
        if h is not None and self.hash_to_block.get(h) == block:
            del self.hash_to_block[h]
        self.ref_counts[block] = 1
        return block

    def _prefix_hashes(self, seq: Sequence) -> list[int]:
        # only blocks before the one holding the last prompt token: that token must be computed for logits
        if seq.prefix_hashes is None:
            full = (seq.num_prompt_tokens - 1) // self.block_size
            hashes, h = [], ("lora", seq.lora_int_id) if seq.lora_int_id else None  # blocks are keyed by adapter
            for i in range(full):
                h = hash((h, tuple(seq.prompt_token_ids[i * self.block_size:(i + 1) * self.block_size])))
                hashes.append(h)
            seq.prefix_hashes = hashes
        return seq.prefix_hashes

    def allocate_prefix(self, seq: Sequence) -> int:
        """On admission: reuse cached blocks of the prompt's prefix; returns the tokens found cached."""
        # a prompt_logprobs request computes every prompt row, so it takes nothing from the cache (as vLLM)
        if (not self.enable_prefix_caching or seq.soft_embeds is not None or seq.block_table
                or seq.params.prompt_logprobs is not None):
            return 0
        cached = 0
        for h in self._prefix_hashes(seq):
            block = self.hash_to_block.get(h)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                self.free.pop(block, None)
            self.ref_counts[block] += 1
            seq.block_table.append(block)
            cached += self.block_size
        self.prefix_cache_queries += seq.num_prompt_tokens
        self.prefix_cache_hits += cached
        return cached

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq``'s block table to hold ``num_tokens`` tokens (caller checked can_allocate)."""
        for _ in range(self.blocks_needed(seq, num_tokens)):
            seq.block_table.append(self._take_free())

    def commit_computed(self, seq: Sequence) -> None:
        """Register hashes of the prompt blocks whose K/V are now fully computed (each block once: a decode
        step costs nothing once the prompt's blocks are in)."""
        if not self.enable_prefix_caching or seq.soft_embeds is not None:
            return
        hashes = self._prefix_hashes(seq)
        if seq.num_committed_blocks == len(hashes):
            return  # every decode step once the prompt's blocks are in
        done = min(len(hashes), seq.num_computed_tokens // self.block_size)
        for i in range(seq.num_committed_blocks, done):
            h, block = hashes[i], seq.block_table[i]
            if h not in self.hash_to_block and block not in self.block_hash:
                self.hash_to_block[h] = block
                self.block_hash[block] = h
        seq.num_committed_blocks = max(seq.num_committed_blocks, done)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep the blocks holding ``seq``'s first ``num_tokens`` slots and give back the rest (the slots of rejected
        draft tokens). Only prompt blocks whose K/V are computed are ever registered in the prefix cache, so no
        block given back here carries a hash of its own tokens."""
        keep = -(-num_tokens // self.block_size)
        for block in reversed(seq.block_table[keep:]):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
        del seq.block_table[keep:]
        seq.num_committed_blocks = min(seq.num_committed_blocks, keep)

    def free_seq(self, seq: Sequence) -> None:
        """Drop the sequence's references; blocks reaching zero go to the free list (hash kept)."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
        seq.block_table = []
        seq.num_committed_blocks = 0
