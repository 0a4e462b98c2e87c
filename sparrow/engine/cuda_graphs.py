"""CUDA graphs for decode steps: one graph per batch-size bucket, captured at start-up and replayed.

A decode step of n sequences runs the graph of the smallest bucket >= n. Inputs live in static buffers
sized for the largest bucket; rows n..bucket-1 are padding that write their K/V to a reserved pad block
(never handed out by the block manager) and attend over one token of it, so no step needs a host sync.
The graph covers the model forward and the LM head; sampling runs eagerly on the logits.
Shapes: Bmax = largest bucket, M = blocks per sequence at max_model_len, V = vocab.
"""
from __future__ import annotations

import logging
import sys

import torch

from sparrow.layers.attention import AttentionMetadata

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    def __init__(self, model, device: torch.device, max_batch: int, max_blocks_per_seq: int, pad_block: int,
                 block_size: int):
        self.model = model
        self.device = device
        self.buckets = [b for b in DEFAULT_BUCKETS if b <= max_batch] or [max_batch]
        if self.buckets[-1] < max_batch:
            self.buckets.append(max_batch)
        bmax = self.buckets[-1]
        self.pad_slot = pad_block * block_size
        self.pad_block = pad_block
        self.max_blocks = max_blocks_per_seq
        self.block_size = block_size
        self.input_ids = torch.empty(bmax, dtype=torch.int64, device=device)
        self.positions = torch.empty(bmax, dtype=torch.int64, device=device)
        self.slot_mapping = torch.empty(bmax, dtype=torch.int64, device=device)
        self.seq_lens = torch.empty(bmax, dtype=torch.int32, device=device)
        self.block_tables = torch.empty(bmax, max_blocks_per_seq, dtype=torch.int32, device=device)
        self._reset_inputs()  # every row a padding row until a step fills it
        self.query_start_loc = torch.arange(bmax + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            positions=self.positions[:bs], slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1], seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs], max_query_len=1,
            max_seq_len=self.max_blocks * self.block_size,
            logits_indices=self.query_start_loc[:bs].long(),
        )

    def _forward(self, bs: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bs], self._meta(bs))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse the memory pool). A bucket whose
        capture fails (an op that syncs with the host) is left to eager execution, with a log line."""
        stream = torch.cuda.Stream(self.device)
        for i, bs in enumerate(reversed(self.buckets)):
            print(f"\rcapturing CUDA graphs: {i + 1}/{len(self.buckets)} (batch {bs})   ", end="", file=sys.stderr)
            try:
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm-up: Triton compilation, cuBLAS handles
                        self._forward(bs)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = self._forward(bs)
                self.pool = graph.pool()
                self.graphs[bs], self.logits[bs] = graph, out
            except RuntimeError as e:
                log.warning("CUDA graph capture failed for batch %d (runs eagerly): %s", bs, str(e).splitlines()[0])
                torch.cuda.synchronize(self.device)
        print(file=sys.stderr)

    def _reset_inputs(self) -> None:
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(self.pad_slot)
        self.seq_lens.fill_(1)
        self.block_tables.fill_(self.pad_block)

    def bucket_for(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b if b in self.graphs else None
        return None

    def run(self, n: int, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            seq_lens: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """Replay the bucket graph for n decode rows (inputs are CPU tensors of n rows); returns logits [n, V]."""
        bs = self.bucket_for(n)
        if bs > n:  # padding rows: token 0 at position 0, written to the pad block
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
            self.slot_mapping[n:bs].fill_(self.pad_slot)
            self.seq_lens[n:bs].fill_(1)
        self.block_tables[:bs].fill_(self.pad_block)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.block_tables[:n, : block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        self.graphs[bs].replay()
        return self.logits[bs][:n]
