"""CUDA graphs for decode and verify steps: one graph per (batch-size bucket, query rows per sequence q),
captured at start-up and replayed. q = 1 is a decode step; q = k + 1 a speculative verify step of k draft tokens.

A step of n sequences with q rows each runs the graph of the smallest bucket >= n for its q. Inputs live in
static buffers sized for the largest bucket and q; sequences n..bucket-1 are padding whose rows write their K/V
to a reserved pad block (never handed out by the block manager) and attend over q tokens of it, so no step
needs a host sync. The graph covers the model forward and the LM head for every row; sampling runs eagerly on
the logits. A step's inputs reach the graph in two host-to-device copies from pinned staging buffers
(``DecodeInputs``): the int64 ones (input ids, positions, slot mapping; with LoRA the adapter slots) and the
int32 ones (seq_lens, the block tables' used columns), padding rows included, then one device copy spreads the tables; then the replay.
Shapes: Bmax = largest bucket, Q = largest q, M = blocks per sequence at max_model_len, V = vocab.
"""
from __future__ import annotations

import logging
import sys

import numpy as np
import torch

from sparrow.layers.forward_batch import ForwardBatch

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def graph_buckets(max_batch: int) -> list[int]:
    """The batch sizes graphs are captured for: DEFAULT_BUCKETS up to ``max_batch``, and ``max_batch`` itself."""
    buckets = [b for b in DEFAULT_BUCKETS if b <= max_batch] or [max_batch]
    if buckets[-1] < max_batch:
        buckets.append(max_batch)
    return buckets


class DecodeInputs:
    """The graphs' static inputs and their host staging buffers (pinned on CUDA).

    Device buffers the graphs read: ``i64`` [3, Bmax Q] int64 (rows: input_ids, positions, slot_mapping),
    ``seq_lens`` [Bmax] int32 (the head of ``i32``) and ``block_tables`` [Bmax, M] int32. ``stage`` writes one
    step of n sequences with q rows each into the host copies: rows 0..nq-1 and padding rows nq..bs q-1 (token
    0 at positions 0..q-1 of the pad block, seq_len q, table entries ``pad_block``), the tables as a compact
    [bs, W] block, W = the step's longest table (entries past a row's table are ``pad_block``). ``upload``
    copies them over: all of i64, seq_lens and the [bs, W] block (one copy into ``i32`` behind seq_lens), then
    spreads that block into block_tables[:bs, :W] on the device. Entries past column W keep older values:
    nothing reads them (a row's kernels read its first ceil(seq_len / B) entries), so a step moves bs x W table
    entries, not bs x M."""

    def __init__(self, device: torch.device, bmax: int, max_blocks: int, pad_block: int, block_size: int,
                 max_query_len: int = 1, lora: bool = False):
        self.device, self.bmax, self.max_blocks, self.block_size = device, bmax, max_blocks, block_size
        self.pad_block, self.pad_slot = pad_block, pad_block * block_size
        rows = bmax * max_query_len
        pin = device.type == "cuda"
        n64 = 4 if lora else 3  # with LoRA a fourth row: the adapter slot of each row (-1: none, and padding)
        self.i64_host = torch.zeros(n64, rows, dtype=torch.int64, pin_memory=pin)
        self.i32_host = torch.zeros(bmax * (1 + max_blocks), dtype=torch.int32, pin_memory=pin)
        self._h64, self._h32 = self.i64_host.numpy(), self.i32_host.numpy()
        self.i64 = torch.empty(n64, rows, dtype=torch.int64, device=device)
        self.i32 = torch.empty(bmax * (1 + max_blocks), dtype=torch.int32, device=device)
        self.input_ids, self.positions, self.slot_mapping = self.i64[0], self.i64[1], self.i64[2]
        self.adapter_ids = self.i64[3] if lora else None
        self.seq_lens = self.i32[:bmax]
        self.block_tables = torch.full((bmax, max_blocks), pad_block, dtype=torch.int32, device=device)
        self._width = 1  # W of the staged tables
        self._copied = None  # CUDA event after the last upload: the host copies are free again once it passed
        self.stage(0, bmax, [], [], [], [], [])  # every row a padding row until a step fills it
        self.upload(bmax)

    def stage(self, n: int, bs: int, input_ids: list[int], positions: list[int], slot_mapping: list[int],
              seq_lens: list[int], block_tables: list[list[int]], q: int = 1,
              adapter_ids: list[int] | None = None) -> None:
        """Write n sequences of q rows (row lists of n q entries, seq_lens and tables of n; tables of at most M
        blocks each) and the padding up to bs sequences to the host copies; ``adapter_ids`` (n q LoRA slots, None:
        all -1) when the buffers have the LoRA row. Raises ValueError when a block table is longer than M."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous upload may still be reading the pinned memory
        h64, m, nq, end = self._h64, self.max_blocks, n * q, bs * q
        h64[0, :nq], h64[1, :nq], h64[2, :nq] = input_ids, positions, slot_mapping
        pad_pos = np.arange(end - nq) % q
        h64[0, nq:end] = 0
        h64[1, nq:end] = pad_pos
        h64[2, nq:end] = self.pad_slot + pad_pos % self.block_size
        if self.adapter_ids is not None:
            h64[3, :nq] = adapter_ids if adapter_ids is not None else -1
            h64[3, nq:end] = -1
        seq = self._h32[:self.bmax]
        seq[:n] = seq_lens
        seq[n:bs] = q
        lens = np.fromiter((len(t) for t in block_tables), dtype=np.int64, count=n)
        width = int(lens.max()) if n else 1
        if width > m:
            raise ValueError(f"decode graphs: a block table of {width} blocks exceeds the {m} of max_model_len")
        width = max(width, -(-q // self.block_size))
        tables = self._h32[self.bmax:self.bmax + bs * width].reshape(bs, width)
        tables.fill(self.pad_block)
        if n:
            tables[:n][np.arange(width)[None, :] < lens[:, None]] = [b for t in block_tables for b in t]
        self._width = width

    def upload(self, bs: int) -> None:
        """Copy the staged step (bucket of bs sequences) to the device buffers (asynchronous from pinned memory)."""
        self.i64.copy_(self.i64_host, non_blocking=True)
        end = self.bmax + bs * self._width
        self.i32[:end].copy_(self.i32_host[:end], non_blocking=True)
        self.block_tables[:bs, :self._width].copy_(self.i32[self.bmax:end].view(bs, self._width))
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()


class DecodeGraphs:
    """Graphs keyed by (bucket, q) for q in ``query_lens`` (1: decode; k + 1: verify of k draft tokens)."""

    def __init__(self, model, device: torch.device, max_batch: int, max_blocks_per_seq: int, pad_block: int,
                 block_size: int, query_lens: tuple[int, ...] = (1,), lora: bool = False):
        """``lora``: the graphs read a static adapter-slot row (ForwardBatch.adapter_ids) and run the LoRA
        kernels, whose rows of slot -1 add nothing."""
        self.model = model
        self.device = device
        self.buckets = graph_buckets(max_batch)
        self.query_lens = tuple(sorted(set(query_lens)))
        bmax, qmax = self.buckets[-1], self.query_lens[-1]
        self.max_blocks = max_blocks_per_seq
        self.block_size = block_size
        self.inputs = DecodeInputs(device, bmax, max_blocks_per_seq, pad_block, block_size, qmax, lora)
        self.rows = torch.arange(bmax * qmax + 1, dtype=torch.int64, device=device)
        self.query_start_loc = {q: torch.arange(0, (bmax + 1) * q, q, dtype=torch.int32, device=device)
                                for q in self.query_lens}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        self.pool = None

    def _batch(self, bs: int, q: int) -> ForwardBatch:
        inp, rows = self.inputs, bs * q
        return ForwardBatch(
            input_ids=inp.input_ids[:rows], positions=inp.positions[:rows], slot_mapping=inp.slot_mapping[:rows],
            query_start_loc=self.query_start_loc[q][: bs + 1], seq_lens=inp.seq_lens[:bs],
            block_tables=inp.block_tables[:bs], max_query_len=q, max_seq_len=self.max_blocks * self.block_size,
            sample_rows=self.rows[:rows],
            adapter_ids=inp.adapter_ids[:rows] if inp.adapter_ids is not None else None,
        )

    def _forward(self, bs: int, q: int) -> torch.Tensor:
        batch = self._batch(bs, q)
        return self.model.compute_logits(self.model(batch))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (bucket, q), largest first (smaller graphs reuse the memory pool). One whose capture
        fails (an op that syncs with the host) is left to eager execution, with a log line."""
        stream = torch.cuda.Stream(self.device)
        keys = [(bs, q) for q in reversed(self.query_lens) for bs in reversed(self.buckets)]
        for i, (bs, q) in enumerate(keys):
            print(f"\rcapturing CUDA graphs: {i + 1}/{len(keys)} (batch {bs}, q {q})   ", end="", file=sys.stderr)
            try:
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm-up: Triton compilation, cuBLAS handles
                        self._forward(bs, q)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = self._forward(bs, q)
                self.pool = graph.pool()
                self.graphs[bs, q], self.logits[bs, q] = graph, out
            except RuntimeError as e:
                log.warning("CUDA graph capture failed for batch %d, q %d (runs eagerly): %s", bs, q,
                            str(e).splitlines()[0])
                torch.cuda.synchronize(self.device)
        print(file=sys.stderr)

    def bucket_for(self, n: int, q: int = 1) -> int | None:
        """The captured bucket that runs n sequences of q rows; None when there is none."""
        if q not in self.query_lens:
            return None
        for b in self.buckets:
            if b >= n:
                return b if (b, q) in self.graphs else None
        return None

    def run(self, n: int, q: int, input_ids: list[int], positions: list[int], slot_mapping: list[int],
            seq_lens: list[int], block_tables: list[list[int]], feed: torch.Tensor | None = None,
            adapter_ids: list[int] | None = None) -> torch.Tensor:
        """Replay the graph of n sequences of q rows (row lists of n q entries, seq_lens and block tables of n, at
        most M blocks each); returns logits [n q, V]. ``feed`` [n q] int64 on the device replaces ``input_ids``
        (a device-to-device copy after the upload: tokens the host has not read yet)."""
        bs = self.bucket_for(n, q)
        self.inputs.stage(n, bs, input_ids, positions, slot_mapping, seq_lens, block_tables, q, adapter_ids)
        self.inputs.upload(bs)
        if feed is not None:
            self.inputs.input_ids[:n * q].copy_(feed)
        self.graphs[bs, q].replay()
        return self.logits[bs, q][:n * q]
