"""BlockManager unit tests: allocation, reference counts, prefix hashes, eviction of freed cached blocks.
Oracle: the bookkeeping rules in block_manager.py's docstring, worked out by hand for small pools."""
from __future__ import annotations

import pytest
import torch

from sparrow.engine.block_manager import BlockManager
from sparrow.engine.sequence import Sequence
from sparrow.sampling_params import SamplingParams


def seq(tokens, **params) -> Sequence:
    return Sequence("r", 0, list(tokens), SamplingParams(**params), {2})


def computed(bm: BlockManager, s: Sequence) -> Sequence:
    """Allocate the whole prompt, mark it computed and register its hashes (what a finished prefill does)."""
    bm.allocate(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.commit_computed(s)
    return s


def test_allocate_and_free_counts():
    bm = BlockManager(8, 4)
    s = seq(range(10))
    assert bm.blocks_needed(s, 10) == 3 and bm.can_allocate(s, 10)
    bm.allocate(s, 10)
    assert len(s.block_table) == 3 and len(set(s.block_table)) == 3
    assert bm.num_free_blocks == 5
    assert all(bm.ref_counts[b] == 1 for b in s.block_table)
    assert bm.blocks_needed(s, 12) == 0 and bm.blocks_needed(s, 13) == 1
    bm.allocate(s, 13)  # grows by one block
    assert len(s.block_table) == 4 and bm.num_free_blocks == 4
    assert bm.can_allocate(s, 32) and not bm.can_allocate(s, 33)  # 4 held + 4 free blocks
    bm.free_seq(s)
    assert s.block_table == [] and bm.num_free_blocks == 8 and bm.ref_counts == [0] * 8


def test_prefix_reuse_and_ref_counts():
    bm = BlockManager(16, 4)
    a = computed(bm, seq(range(13)))  # hashes cover (13 - 1) // 4 = 3 full blocks
    b = seq(list(range(12)) + [99, 98])
    assert bm.allocate_prefix(b) == 12
    assert b.block_table == a.block_table[:3]
    assert [bm.ref_counts[x] for x in a.block_table] == [2, 2, 2, 1]
    bm.allocate(b, b.num_tokens)
    assert b.block_table[3] not in a.block_table
    # a change in block 1 breaks the chain: block 2's hash names the whole prefix
    c = seq([0, 1, 2, 3, 4, 5, 6, 77, 8, 9, 10, 11, 12])
    assert bm.allocate_prefix(c) == 4 and c.block_table == a.block_table[:1]
    assert bm.ref_counts[a.block_table[0]] == 3
    bm.free_seq(a)
    assert [bm.ref_counts[x] for x in b.block_table[:3]] == [2, 1, 1]
    for s in (b, c):
        bm.free_seq(s)
    assert bm.ref_counts == [0] * 16 and bm.num_free_blocks == 16


def test_last_prompt_token_is_never_cached():
    bm = BlockManager(8, 4)
    computed(bm, seq(range(12)))  # exactly three blocks: the third holds the last token
    again = seq(range(12))
    assert bm.allocate_prefix(again) == 8  # two blocks; the last token must be computed for its logits
    one_block = seq(range(4))
    assert bm.allocate_prefix(one_block) == 0


def test_only_computed_blocks_are_hashed():
    bm = BlockManager(8, 4)
    a = seq(range(13))
    bm.allocate(a, 13)
    a.num_computed_tokens = 5  # a prefill chunk: block 0 complete, block 1 partial
    bm.commit_computed(a)
    assert bm.allocate_prefix(seq(range(13))) == 4


def test_commit_registers_each_block_once_and_again_after_a_preemption():
    """Chunked prefill commits block by block; decode steps after the prompt add nothing; the hashes are
    computed once per sequence; freeing (preemption) resets the count so a recomputed prefill registers its
    new blocks."""
    bm = BlockManager(16, 4)
    a = seq(range(13))
    bm.allocate(a, 13)
    for done, blocks in ((5, 1), (9, 2), (13, 3), (14, 3), (20, 3)):  # chunks, then decode steps
        a.num_computed_tokens = done
        bm.commit_computed(a)
        assert a.num_committed_blocks == blocks
        assert sorted(bm.block_hash) == sorted(a.block_table[:blocks])
    hashes = a.prefix_hashes
    assert len(hashes) == 3 and bm._prefix_hashes(a) is hashes  # computed once
    bm.free_seq(a)  # preempted: blocks freed, their hashes kept until reused
    assert a.num_committed_blocks == 0
    filler = seq([100 + i for i in range(64)])
    bm.allocate(filler, 64)  # every block, the freed prefix included: those hashes are dropped
    assert not bm.block_hash
    bm.free_seq(filler)
    bm.allocate(a, 13)
    a.num_computed_tokens = 13
    bm.commit_computed(a)
    assert a.num_committed_blocks == 3 and sorted(bm.block_hash) == sorted(a.block_table[:3])
    assert bm.allocate_prefix(seq(range(13))) == 12


def test_freed_blocks_keep_their_hash_until_reused():
    bm = BlockManager(6, 4)
    a = computed(bm, seq(range(13)))  # 4 blocks: 0, 1, 2 hashed, 3 holds the last token
    prefix_blocks = a.block_table[:3]
    bm.free_seq(a)
    assert bm.num_free_blocks == 6
    # the freed prefix is still found, and taken back off the free list
    b = seq(list(range(12)) + [50])
    assert bm.allocate_prefix(b) == 12 and b.block_table == prefix_blocks
    assert bm.num_free_blocks == 3
    bm.free_seq(b)
    # never-used blocks go first, then freed ones, tail first (reversed free order): the prefix's head lasts
    filler = seq([200] * 12)
    bm.allocate(filler, 12)  # 3 blocks: the 2 never used, then a's last block
    assert not set(filler.block_table) & set(prefix_blocks)
    assert bm.allocate_prefix(seq(range(13))) == 12
    bm.free_seq(filler)


def test_eviction_of_freed_cached_blocks():
    bm = BlockManager(4, 4)
    a = computed(bm, seq(range(13)))  # all 4 blocks; 3 hashed
    bm.free_seq(a)
    hog = seq([7] * 16)
    bm.allocate(hog, 16)  # takes every block: all hashes evicted
    assert bm.hash_to_block == {} and bm.block_hash == {}
    bm.free_seq(hog)
    assert bm.allocate_prefix(seq(range(13))) == 0


def test_partial_eviction_keeps_the_head_of_a_prefix():
    bm = BlockManager(4, 4)
    a = computed(bm, seq(range(13)))
    blocks = list(a.block_table)
    bm.free_seq(a)  # free order: the block of token 12, then prefix blocks 2, 1, 0
    hog = seq([7] * 8)
    bm.allocate(hog, 8)  # takes the last block and prefix block 2 (its hash is dropped)
    assert hog.block_table == [blocks[3], blocks[2]]
    s = seq(range(13))
    assert bm.allocate_prefix(s) == 8 and s.block_table == blocks[:2]
    assert [bm.ref_counts[b] for b in blocks] == [1, 1, 1, 1]


@pytest.mark.parametrize("why", ["disabled", "soft_embeds", "prompt_logprobs"])
def test_no_prefix_reuse(why):
    bm = BlockManager(8, 4, enable_prefix_caching=why != "disabled")
    computed(bm, seq(range(13)))
    s = seq(range(13), prompt_logprobs=1) if why == "prompt_logprobs" else seq(range(13))
    if why == "soft_embeds":
        s.soft_embeds, s.soft_positions = torch.zeros(1, 8), [0]
    assert bm.allocate_prefix(s) == 0 and s.block_table == []
    if why == "disabled":
        assert bm.hash_to_block == {}


def test_identical_blocks_in_two_sequences_hash_once():
    bm = BlockManager(8, 4)
    a = computed(bm, seq(range(9)))
    b = computed(bm, seq(range(9)))  # computed without looking up the cache: its blocks are not registered
    assert len(bm.hash_to_block) == 2
    assert set(bm.hash_to_block.values()) <= set(a.block_table)
    bm.free_seq(a)
    bm.free_seq(b)
    assert bm.num_free_blocks == 8
