"""DecodeInputs (engine/cuda_graphs.py): one step's rows and its padding rows staged for the decode graphs.

The expected buffers are built here row by row from the contract (padding rows: token 0 at position 0 into the
pad block's first slot, seq_len 1, table entry 0 the pad block; entries past a row's table up to the step's
widest table the pad block; columns past that are not read by any kernel and not compared); the class fills
them with numpy in one pass. On CPU the "device" buffers are CPU tensors, so upload is a plain copy.
"""
from __future__ import annotations

import pytest
import torch

from sparrow.engine.cuda_graphs import DecodeInputs

BMAX, M, PAD_BLOCK, BLOCK = 8, 5, 7, 16


def expected(n, bs, ids, pos, slots, lens, tables):
    """(i64 [3, bs], seq_lens [bs], tables [bs, W]) with W the step's widest table (1 at least)."""
    width = max([len(t) for t in tables] + [1])
    i64 = torch.zeros(3, bs, dtype=torch.int64)
    seq = torch.ones(bs, dtype=torch.int32)
    bt = torch.full((bs, width), PAD_BLOCK, dtype=torch.int32)
    i64[2, :] = PAD_BLOCK * BLOCK
    for r in range(n):
        i64[0, r], i64[1, r], i64[2, r], seq[r] = ids[r], pos[r], slots[r], lens[r]
        bt[r, :len(tables[r])] = torch.tensor(tables[r], dtype=torch.int32)
    return i64, seq, bt


def test_rows_and_padding_rows_reach_the_graph_buffers():
    inp = DecodeInputs(torch.device("cpu"), BMAX, M, PAD_BLOCK, BLOCK)
    # fresh: every row a padding row, the whole table the pad block
    i64, seq, _ = expected(0, BMAX, [], [], [], [], [])
    assert torch.equal(inp.i64, i64) and torch.equal(inp.seq_lens, seq)
    assert torch.equal(inp.block_tables, torch.full((BMAX, M), PAD_BLOCK, dtype=torch.int32))

    # full-width ragged tables, then a smaller step in a larger bucket with narrower tables (stale rows become
    # padding rows), then one row of one block
    steps = [
        (4, 4, [11, 12, 13, 14], [20, 3, 0, 47], [97, 3, 16, 50], [21, 4, 1, 48], [[6, 1], [2], [1], [0, 3, 4, 5, 2]]),
        (3, 8, [5, 6, 7], [15, 16, 63], [15, 32, 79], [16, 17, 64], [[2], [0, 3], [1, 4, 0, 3]]),
        (1, 1, [9], [4], [68], [5], [[4]]),
    ]
    for n, bs, ids, pos, slots, lens, tables in steps:
        inp.stage(n, bs, ids, pos, slots, lens, tables)
        inp.upload(bs)
        i64, seq, bt = expected(n, bs, ids, pos, slots, lens, tables)
        assert torch.equal(inp.input_ids[:bs], i64[0]) and torch.equal(inp.positions[:bs], i64[1])
        assert torch.equal(inp.slot_mapping[:bs], i64[2])
        assert torch.equal(inp.seq_lens[:bs], seq)
        assert torch.equal(inp.block_tables[:bs, :bt.shape[1]], bt)


def test_block_table_longer_than_max_model_len_is_named():
    inp = DecodeInputs(torch.device("cpu"), BMAX, M, PAD_BLOCK, BLOCK)
    with pytest.raises(ValueError, match="6 blocks exceeds the 5"):
        inp.stage(1, 1, [1], [0], [0], [1], [[0, 1, 2, 3, 4, 5]])


def test_lora_adapter_row():
    """With LoRA the int64 buffer has a fourth row: each real row's adapter slot (None: -1), -1 in padding rows."""
    inp = DecodeInputs(torch.device("cpu"), BMAX, M, PAD_BLOCK, BLOCK, lora=True)
    assert torch.equal(inp.adapter_ids, torch.full((BMAX,), -1, dtype=torch.int64))
    inp.stage(3, 4, [1, 2, 3], [0, 1, 2], [0, 1, 2], [1, 2, 3], [[0], [1], [2]], adapter_ids=[2, -1, 0])
    inp.upload(4)
    assert inp.adapter_ids[:4].tolist() == [2, -1, 0, -1]
    i64, _, _ = expected(3, 4, [1, 2, 3], [0, 1, 2], [0, 1, 2], [1, 2, 3], [[0], [1], [2]])
    assert torch.equal(inp.i64[:3, :4], i64)  # the other rows as without LoRA
    inp.stage(2, 2, [1, 2], [0, 1], [0, 1], [1, 2], [[0], [1]])
    inp.upload(2)
    assert inp.adapter_ids[:2].tolist() == [-1, -1]
