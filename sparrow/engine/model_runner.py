"""The model runner: allocates the paged KV pool, turns a scheduled step into batch tensors
(input_ids, positions, slot_mapping, block_tables, seq_lens, query_start_loc), runs the model, and samples.

Shapes: R = rows of the step, S = scheduled sequences, M = max blocks per sequence, V = vocab.
"""
from __future__ import annotations

import logging

import torch

from sparrow.config import EngineConfig
from sparrow.engine.sampler import Sampler, SamplingState
from sparrow.engine.scheduler import ScheduledSeq
from sparrow.layers.attention import AttentionMetadata

log = logging.getLogger(__name__)

from sparrow.config import TORCH_DTYPES as _DTYPES


def kv_bytes_per_token(model, dtype: torch.dtype) -> int:
    """Bytes of K and V one token occupies over all layers."""
    size = torch.tensor([], dtype=dtype).element_size()
    return sum(a.num_kv_heads * (a.head_dim + a.v_head_dim) * size for a in model.attention_layers())


class GreedyPicks:
    """The picked ids of a queued greedy step: ``tokens`` [n] int64 on the device (what the next step is fed)
    and, on CUDA, a copy on its way to pinned host memory behind an event, so reading them waits for this
    step only, not for a step queued after it on the same stream."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens
        self._host, self._ready = tokens, None
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()

    def tolist(self) -> list[int]:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module):
        self.config = config
        self.model = model
        self.device = torch.device(config.device)
        self.dtype = _DTYPES[config.dtype]
        self.block_size = config.cache.block_size
        self.num_blocks = self._num_blocks()
        self.pad_block = self.num_blocks  # one extra block, never handed out: CUDA-graph padding rows write here
        self._allocate_kv_cache()
        self.sampler = Sampler()
        self.graphs = None
        from sparrow.kernels import get_backend

        if self.device.type == "cuda" and not config.enforce_eager and get_backend() != "torch":
            from sparrow.engine.cuda_graphs import DecodeGraphs

            max_blocks = -(-config.max_model_len // self.block_size)
            self.graphs = DecodeGraphs(model, self.device, config.scheduler.max_num_seqs, max_blocks,
                                       self.pad_block, self.block_size)
            self.graphs.capture()

    def _num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        per_block = kv_bytes_per_token(self.model, self.dtype) * self.block_size
        want = self.config.scheduler.max_num_seqs * -(-self.config.max_model_len // self.block_size)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1 - cache.gpu_memory_utilization) * total
        else:
            budget = cache.cpu_kv_cache_bytes
        fits = int(budget // per_block)
        need_one = -(-self.config.max_model_len // self.block_size)
        if fits < need_one:
            fits = need_one  # one full-length sequence must fit; later ones wait or are preempted
        return max(1, min(want, fits))

    def _allocate_kv_cache(self) -> None:
        self.kv_caches = []
        for attn in self.model.attention_layers():
            shape_k = (self.num_blocks + 1, self.block_size, attn.num_kv_heads, attn.head_dim)
            shape_v = (self.num_blocks + 1, self.block_size, attn.num_kv_heads, attn.v_head_dim)
            k = torch.zeros(shape_k, dtype=self.dtype, device=self.device)
            v = torch.zeros(shape_v, dtype=self.dtype, device=self.device)
            attn.kv_cache = (k, v)
            self.kv_caches.append((k, v))
        log.info("KV cache: %d blocks of %d tokens", self.num_blocks, self.block_size)

    def prepare(self, scheduled: list[ScheduledSeq]):
        """Batch tensors for one step; returns (input_ids [R], meta, soft_embeds, soft_mask, sample_rows,
        prompt_logprob_rows)."""
        input_ids, positions, slots, qsl, seq_lens, tables = [], [], [], [0], [], []
        soft_vecs, soft_mask = [], []
        sample_rows: list[int] = []
        prompt_rows: list[tuple[int, int, int]] = []  # (scheduled idx, first row, count)
        bs = self.block_size
        for i, item in enumerate(scheduled):
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            row0 = len(input_ids)
            input_ids += seq.tokens(start, start + n)
            positions += range(start, start + n)
            slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
            if seq.soft_embeds is not None:
                index = {p: j for j, p in enumerate(seq.soft_positions)}
                for p in range(start, start + n):
                    j = index.get(p)
                    soft_mask.append(j is not None)
                    if j is not None:
                        soft_vecs.append(seq.soft_embeds[j])
            else:
                soft_mask += [False] * n
            qsl.append(len(input_ids))
            seq_lens.append(start + n)
            tables.append(seq.block_table)
            if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens:
                m = min(n, seq.num_prompt_tokens - 1 - start)
                if m > 0:
                    prompt_rows.append((i, row0, m))
            if item.samples:
                sample_rows.append(len(input_ids) - 1)
        dev = self.device
        meta = self._meta(positions, slots, qsl, seq_lens, tables, max(s.num_new_tokens for s in scheduled),
                          sample_rows)
        ids = torch.tensor(input_ids, dtype=torch.int64).to(dev, non_blocking=True)
        soft = torch.stack(soft_vecs).to(dev) if soft_vecs else None
        mask = torch.tensor(soft_mask, dtype=torch.bool, device=dev) if soft_vecs else None
        return ids, meta, soft, mask, sample_rows, prompt_rows

    def _meta(self, positions: list[int], slots: list[int], qsl: list[int], seq_lens: list[int],
              tables: list[list[int]], max_query_len: int, logits_rows: list[int]) -> AttentionMetadata:
        """AttentionMetadata on the device from the step's host lists (see its fields)."""
        dev = self.device
        return AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.int64).to(dev, non_blocking=True),
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32).to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            block_tables=self._block_tables(tables).to(dev, non_blocking=True),
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens),
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64).to(dev, non_blocking=True),
        )

    def _decode_rows(self, seqs: list, positions: list[int]) -> tuple[list[int], list[int], list[list[int]]]:
        """(slot_mapping, seq_lens, block tables) of decode rows: one row per sequence, its token at positions[i]."""
        bs = self.block_size
        slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, positions)]
        return slots, [p + 1 for p in positions], [s.block_table for s in seqs]

    def _block_tables(self, tables: list[list[int]]) -> torch.Tensor:
        """[S, M] int32 CPU tensor of the sequences' blocks, padded with the pad block."""
        bt = torch.full((len(tables), max(len(t) for t in tables)), self.pad_block, dtype=torch.int32)
        for i, t in enumerate(tables):
            bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        return bt

    @staticmethod
    def _states(scheduled: list[ScheduledSeq]) -> list[SamplingState]:
        return [SamplingState(i.seq.params, i.seq.prompt_token_ids, i.seq.output_token_ids, i.seq.generator,
                              i.seq.eos_token_ids) for i in scheduled if i.samples]

    def _execute_graph(self, scheduled: list[ScheduledSeq]):
        """A pure decode step through the captured graph of its batch bucket."""
        seqs = [s.seq for s in scheduled]
        pos = [s.num_computed_tokens for s in seqs]
        ids = [s.token_at(p) for s, p in zip(seqs, pos)]
        logits = self.graphs.run(len(seqs), ids, pos, *self._decode_rows(seqs, pos))
        return self.sampler(logits, self._states(scheduled))

    @torch.inference_mode()
    def launch_greedy(self, seqs: list, positions: list[int], feed: torch.Tensor | None = None) -> GreedyPicks:
        """Queue one decode step of ``seqs`` (one row each, its token at ``positions[i]``, K/V blocks already
        allocated) and the greedy pick of each row, without waiting for the GPU: returns the picked ids [n]
        int64 (``GreedyPicks``: on the device, and their host copy). ``feed`` [n] int64 on the device: the rows' input
        tokens when the host does not have them yet (the previous step's picks); else each row's token at its
        position. The caller checked that the sampler would only take each row's argmax (greedy, no
        penalties, no logprobs): the same ids ``execute`` returns for these rows. Decode graph of the batch's
        bucket when captured, else the eager forward."""
        n = len(seqs)
        ids = [0] * n if feed is not None else [s.token_at(p) for s, p in zip(seqs, positions)]
        slots, seq_lens, tables = self._decode_rows(seqs, positions)
        if self.graphs is not None and self.graphs.bucket_for(n) is not None:
            logits = self.graphs.run(n, ids, positions, slots, seq_lens, tables, feed=feed)
        else:
            meta = self._meta(positions, slots, list(range(n + 1)), seq_lens, tables, 1, list(range(n)))
            input_ids = feed if feed is not None else torch.tensor(ids, dtype=torch.int64).to(self.device,
                                                                                              non_blocking=True)
            logits = self.model.compute_logits(self.model(input_ids, meta))
        return GreedyPicks(logits.float().argmax(dim=-1))

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]):
        """Run one step. Returns (sampler output for the sequences that sample, in scheduled order,
        {scheduled idx: [[(token, logprob, rank, topk dict)], ...]} prompt logprobs)."""
        n = len(scheduled)
        if (self.graphs is not None and all(s.num_new_tokens == 1 and s.samples for s in scheduled)
                and all(s.seq.params.prompt_logprobs is None for s in scheduled)
                and self.graphs.bucket_for(n) is not None):
            return self._execute_graph(scheduled), {}
        ids, meta, soft, mask, sample_rows, prompt_rows = self.prepare(scheduled)
        hidden = self.model(ids, meta, soft, mask)
        out = None
        if sample_rows:
            logits = self.model.compute_logits(hidden[meta.logits_indices])
            out = self.sampler(logits, self._states(scheduled))
        prompt_lp = {}
        for i, row0, m in prompt_rows:
            seq = scheduled[i].seq
            lp = torch.log_softmax(self.model.compute_logits(hidden[row0:row0 + m]), dim=-1)
            start = seq.num_computed_tokens
            targets = torch.tensor(seq.tokens(start + 1, start + 1 + m), device=lp.device)
            chosen = lp.gather(1, targets[:, None])[:, 0]
            ranks = (lp > chosen[:, None]).sum(1) + 1
            k = seq.params.prompt_logprobs
            top = lp.topk(k, dim=-1) if k > 0 else None
            rows = []
            for r in range(m):
                d = {int(targets[r]): (float(chosen[r]), int(ranks[r]))}
                if top is not None:
                    for j in range(k):
                        tid = int(top.indices[r, j])
                        d.setdefault(tid, (float(top.values[r, j]), j + 1))
                rows.append(d)
            prompt_lp[i] = rows
        return out, prompt_lp
