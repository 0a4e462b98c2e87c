"""CUDA graphs for decode steps: one graph per batch-size bucket, captured at start-up and replayed.

A decode step of n sequences runs the graph of the smallest bucket >= n. Inputs live in static buffers
sized for the largest bucket; rows n..bucket-1 are padding that write their K/V to a reserved pad block
(never handed out by the block manager) and attend over one token of it, so no step needs a host sync.
The graph covers the model forward and the LM head; sampling runs eagerly on the logits.
A step's inputs reach the graph in two host-to-device copies from pinned staging buffers (``DecodeInputs``):
the int64 ones (input ids, positions, slot mapping) and the int32 ones (seq_lens, the block tables' used
columns), padding rows included, then one device copy spreads the tables; then the replay.
Shapes: Bmax = largest bucket, M = blocks per sequence at max_model_len, V = vocab.
"""
from __future__ import annotations

import logging
import sys

import numpy as np
import torch

from sparrow.layers.attention import AttentionMetadata

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeInputs:
    """The decode graphs' static inputs and their host staging buffers (pinned on CUDA).

    Device buffers the graphs read: ``i64`` [3, Bmax] int64 (rows: input_ids, positions, slot_mapping),
    ``seq_lens`` [Bmax] int32 (the head of ``i32``) and ``block_tables`` [Bmax, M] int32. ``stage`` writes one
    step into the host copies: rows 0..n-1 and padding rows n..bs-1 (token 0 at position 0 into ``pad_slot``,
    seq_len 1, table entry 0 ``pad_block``), the tables as a compact [bs, W] block, W = the step's longest
    table (entries past a row's table are ``pad_block``). ``upload`` copies them over: all of i64, seq_lens and
    the [bs, W] block (one copy into ``i32`` behind seq_lens), then spreads that block into block_tables[:bs,
    :W] on the device. Entries past column W keep older values: nothing reads them (a row's kernels read its
    first ceil(seq_len / B) entries), so a step moves bs x W table entries, not bs x M."""

    def __init__(self, device: torch.device, bmax: int, max_blocks: int, pad_block: int, block_size: int):
        self.device, self.bmax, self.max_blocks = device, bmax, max_blocks
        self.pad_block, self.pad_slot = pad_block, pad_block * block_size
        pin = device.type == "cuda"
        self.i64_host = torch.zeros(3, bmax, dtype=torch.int64, pin_memory=pin)
        self.i32_host = torch.zeros(bmax * (1 + max_blocks), dtype=torch.int32, pin_memory=pin)
        self._h64, self._h32 = self.i64_host.numpy(), self.i32_host.numpy()
        self.i64 = torch.empty(3, bmax, dtype=torch.int64, device=device)
        self.i32 = torch.empty(bmax * (1 + max_blocks), dtype=torch.int32, device=device)
        self.input_ids, self.positions, self.slot_mapping = self.i64[0], self.i64[1], self.i64[2]
        self.seq_lens = self.i32[:bmax]
        self.block_tables = torch.full((bmax, max_blocks), pad_block, dtype=torch.int32, device=device)
        self._width = 1  # W of the staged tables
        self._copied = None  # CUDA event after the last upload: the host copies are free again once it passed
        self.stage(0, bmax, [], [], [], [], [])  # every row a padding row until a step fills it
        self.upload(bmax)

    def stage(self, n: int, bs: int, input_ids: list[int], positions: list[int], slot_mapping: list[int],
              seq_lens: list[int], block_tables: list[list[int]]) -> None:
        """Write n rows (Python lists; tables of at most M blocks each) and padding rows n..bs-1 to the host
        copies. Raises ValueError when a block table is longer than M."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous upload may still be reading the pinned memory
        h64, m = self._h64, self.max_blocks
        h64[0, :n], h64[1, :n], h64[2, :n] = input_ids, positions, slot_mapping
        h64[:2, n:bs] = 0
        h64[2, n:bs] = self.pad_slot
        seq = self._h32[:self.bmax]
        seq[:n] = seq_lens
        seq[n:bs] = 1
        lens = np.fromiter((len(t) for t in block_tables), dtype=np.int64, count=n)
        width = int(lens.max()) if n else 1
        if width > m:
            raise ValueError(f"decode graphs: a block table of {width} blocks exceeds the {m} of max_model_len")
        width = max(width, 1)
        tables = self._h32[self.bmax:self.bmax + bs * width].reshape(bs, width)
        tables.fill(self.pad_block)
        if n:
            tables[:n][np.arange(width)[None, :] < lens[:, None]] = [b for t in block_tables for b in t]
        self._width = width

    def upload(self, bs: int) -> None:
        """Copy the staged step (bucket of bs rows) to the device buffers (asynchronous from pinned memory)."""
        self.i64.copy_(self.i64_host, non_blocking=True)
        end = self.bmax + bs * self._width
        self.i32[:end].copy_(self.i32_host[:end], non_blocking=True)
        self.block_tables[:bs, :self._width].copy_(self.i32[self.bmax:end].view(bs, self._width))
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()


class DecodeGraphs:
    def __init__(self, model, device: torch.device, max_batch: int, max_blocks_per_seq: int, pad_block: int,
                 block_size: int):
        self.model = model
        self.device = device
        self.buckets = [b for b in DEFAULT_BUCKETS if b <= max_batch] or [max_batch]
        if self.buckets[-1] < max_batch:
            self.buckets.append(max_batch)
        bmax = self.buckets[-1]
        self.max_blocks = max_blocks_per_seq
        self.block_size = block_size
        self.inputs = DecodeInputs(device, bmax, max_blocks_per_seq, pad_block, block_size)
        self.input_ids, self.positions = self.inputs.input_ids, self.inputs.positions
        self.slot_mapping, self.seq_lens = self.inputs.slot_mapping, self.inputs.seq_lens
        self.block_tables = self.inputs.block_tables
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

    def bucket_for(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b if b in self.graphs else None
        return None

    def run(self, n: int, input_ids: list[int], positions: list[int], slot_mapping: list[int],
            seq_lens: list[int], block_tables: list[list[int]], feed: torch.Tensor | None = None) -> torch.Tensor:
        """Replay the bucket graph for n decode rows (inputs as Python lists of n rows, block tables of at
        most M blocks); returns logits [n, V]. ``feed`` [n] int64 on the device replaces ``input_ids`` (a
        device-to-device copy after the upload: tokens the host has not read yet)."""
        bs = self.bucket_for(n)
        self.inputs.stage(n, bs, input_ids, positions, slot_mapping, seq_lens, block_tables)
        self.inputs.upload(bs)
        if feed is not None:
            self.input_ids[:n].copy_(feed)
        self.graphs[bs].replay()
        return self.logits[bs][:n]
