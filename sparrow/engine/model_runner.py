"""The model runner: allocates the paged KV pool, and runs a StepPlan: plan -> ForwardBatch -> model (or a captured
CUDA graph) -> logits of the sampled rows -> sampling -> StepResult.

Shapes: R = rows of the step, R' = sampled rows, S = sequences, V = vocab.
"""
from __future__ import annotations

import logging

import torch

from sparrow.config import TORCH_DTYPES, EngineConfig
from sparrow.engine.forward_inputs import StepInputs, StepRows, fed_tokens, forward_batch, pad_rows, step_rows
from sparrow.engine.grammar import apply_bitmask, constrained_rows
from sparrow.engine.kv_budget import KVPool, agree_over_ranks, graph_reserve_bytes, plan_kv_pool
from sparrow.engine.sampler import Sampler, SamplingState, prompt_logprob_rows
from sparrow.engine.step_plan import StepPlan, StepResult
from sparrow.kv_cache import KVCache, kv_bytes_per_token  # noqa: F401  (kv_bytes_per_token: re-exported)

log = logging.getLogger(__name__)


def graph_query_lens(config: EngineConfig) -> tuple[int, ...]:
    """The q (rows per sequence) the target's CUDA graphs cover: 1, and 2 .. k + 1 with k speculative tokens."""
    spec = config.speculative
    return tuple(range(1, spec.num_speculative_tokens + 2)) if spec is not None else (1,)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, query_lens: tuple[int, ...] = (1,),
                 extra_kv_bytes_per_token: int = 0, workers=None):
        """``query_lens``: the rows per sequence of the steps the CUDA graphs cover (1: decode; 2 .. k + 1 also
        for speculative verify steps of up to k draft tokens). ``extra_kv_bytes_per_token``: KV bytes per token
        of another pool with as many blocks (a draft model's), taken from the same memory budget. ``workers``:
        on rank 0 of a tensor-parallel group, its ``sparrow.engine.workers.WorkerGroup`` (each step's inputs are
        sent to it); None on one rank and on the workers themselves. With ``config.parallel.world_size`` > 1 every
        rank of the group (``sparrow.distributed.get_tp()``) builds its runner at once: the KV pool is the
        smallest any rank sizes."""
        self.config = config
        self.model = model
        self.workers = workers
        self.device = torch.device(config.device)
        self.dtype = TORCH_DTYPES[config.dtype]
        self.block_size = config.cache.block_size
        self.lora = None
        """The LoRA adapter slots (``sparrow.lora.manager.LoRAManager``) when LoRA is enabled, made before the KV
        pool is sized and the CUDA graphs are captured (they read its buffers)."""
        if config.lora is not None:
            from sparrow.lora.manager import LoRAManager

            self.lora = LoRAManager(model, config.lora.max_loras, config.lora.max_lora_rank, self.dtype, self.device,
                                    config.lora.max_cpu_loras)
        if self.lora is not None and workers is not None:
            self.lora.slot_writes = []  # sent to the workers with each step
        self.kv_pool = agree_over_ranks(self._kv_pool(extra_kv_bytes_per_token, query_lens),
                                        config.parallel.world_size)
        """The KV pool's size and what set it (``sparrow.engine.kv_budget.KVPool``), sized before graph capture."""
        self.num_blocks = self.kv_pool.num_blocks
        self.pad_block = self.num_blocks  # one extra block, never handed out: CUDA-graph padding rows write here
        self._allocate_kv_cache()
        self.sampler = Sampler()
        self.graphs = None
        from sparrow.kernels import get_backend

        if self.device.type == "cuda" and not config.enforce_eager and get_backend() != "torch":
            from sparrow.engine.cuda_graphs import DecodeGraphs

            max_blocks = -(-config.max_model_len // self.block_size)
            self.graphs = DecodeGraphs(model, self.device, config.scheduler.max_num_seqs, max_blocks,
                                       self.pad_block, self.block_size, query_lens, lora=self.lora is not None)
            self.graphs.capture()

    def _kv_pool(self, extra_bytes_per_token: int = 0, query_lens: tuple[int, ...] = (1,)) -> KVPool:
        """The pool ``plan_kv_pool`` sizes from the cache settings and, on CUDA, the memory left after the
        weights (less the CUDA graphs' estimated reserve when they will be captured); logs it. Raises
        InsufficientMemoryError when it cannot hold one sequence of max_model_len tokens."""
        from sparrow.engine.cuda_graphs import graph_buckets
        from sparrow.kernels import get_backend

        cache = self.config.cache
        per_token = kv_bytes_per_token(self.model, self.dtype, cache.kv_cache_dtype,
                                       cache.kv_cache_dtype_skip_layers) + extra_bytes_per_token
        device = dict(cpu_budget=cache.cpu_kv_cache_bytes)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # blocks loading freed (on-load quantization) count as free, not in use
            free, total = torch.cuda.mem_get_info(self.device)
            reserve = 0
            if not self.config.enforce_eager and get_backend() != "torch":
                buckets = graph_buckets(self.config.scheduler.max_num_seqs)
                reserve = graph_reserve_bytes(buckets, query_lens, self.config.model.vocab_size)
            device = dict(device_total=total, device_free=free, graph_reserve=reserve)
        weights = sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers()))
        pool = plan_kv_pool(bytes_per_token=per_token, block_size=self.block_size,
                            max_model_len=self.config.max_model_len, max_num_seqs=self.config.scheduler.max_num_seqs,
                            num_kv_blocks=cache.num_blocks, kv_cache_memory=cache.kv_cache_memory,
                            gpu_memory_utilization=cache.gpu_memory_utilization, weights_bytes=weights, **device)
        log.info("%s; KV cache dtype %s", pool.describe(), cache.kv_cache_dtype)
        return pool

    def _allocate_kv_cache(self) -> None:
        """``self.kv_cache``: the pool of num_blocks blocks (+ the pad block), bound to every attention layer."""
        cache = self.config.cache
        self.kv_cache = KVCache(self.model, self.num_blocks, self.block_size, self.dtype, self.device,
                                cache.kv_cache_dtype, cache.kv_cache_dtype_skip_layers, cache.calculate_kv_scales)
        log.debug("KV cache: %s, %d bytes per token", cache.kv_cache_dtype, self.kv_cache.bytes_per_token)

    @torch.inference_mode()
    def run(self, plan: StepPlan, previous: StepResult | None = None) -> StepResult:
        """Run one step without waiting for the GPU unless the step asks for host values (logprobs, random
        sampling). ``previous``: the step this one was queued behind (its sampled ids feed rows with
        ``fed_row``). A step whose sequences all have q rows, all sampled, replays the graph of (bucket, q) when
        one was captured; other steps run the model eagerly. Adapter rows use the slots of ``plan.lora_slots``.
        With tensor-parallel workers the step's inputs are broadcast to them first (``sparrow.engine.workers``);
        a worker's failure raises WorkerError."""
        rows = step_rows(plan, self.block_size, plan.lora_slots)
        feed = fed_tokens(plan, previous)
        inputs = self._step_inputs(plan, rows)
        feed = feed if inputs.num_fed else None
        prompt_lp = {}

        def prompt_logprobs(j: int, logits: torch.Tensor) -> None:  # j-th entry of rows.prompt_rows
            i, _, m = rows.prompt_rows[j]
            item = plan.seqs[i]
            targets = item.seq.tokens(item.start + 1, item.start + 1 + m)
            prompt_lp[i] = prompt_logprob_rows(logits, targets, item.seq.params.prompt_logprobs)

        if self.workers is None:
            logits = self.execute(inputs, feed, prompt_logprobs)
        else:
            if self.lora is not None:
                inputs.lora_slots, self.lora.slot_writes = self.lora.slot_writes, []
            with self.workers.guard():
                self.workers.send(inputs, feed)
                logits = self.execute(inputs, feed, prompt_logprobs)
        return self._sample(plan, logits, prompt_lp)

    def _step_inputs(self, plan: StepPlan, rows: StepRows) -> StepInputs:
        """The StepInputs of ``plan``'s rows: a graph replay (rows padded to q per sequence when they differ) or an
        eager step (measuring pending KV scales when it computes prompt rows)."""
        q = self._graph_query_len(plan, rows)
        n_fed = sum(item.fed_row is not None for item in plan.seqs)
        if q is not None:
            if all(s.num_new_tokens == q for s in plan.seqs):  # uniform: no padding
                return StepInputs(rows, graph_q=q, num_fed=n_fed)
            padded, keep = pad_rows(plan, rows, q, self.pad_block * self.block_size, self.block_size)
            return StepInputs(padded, graph_q=q, keep=keep)  # a padded step is never fed (fed steps have q = 1)
        prefill = any(s.start < s.seq.num_prompt_tokens for s in plan.seqs)
        return StepInputs(rows, num_fed=n_fed, measure_kv_scales=self.kv_cache.scales_pending and prefill)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, feed: torch.Tensor | None = None,
                on_prompt_logits=None) -> torch.Tensor | None:
        """The forward part of a step, the same on every tensor-parallel rank (its collectives run in the same
        order everywhere): the graph replay or eager forward of ``inputs`` and the logits calls. ``feed``:
        [inputs.num_fed] int64 on the device, the fed rows' input ids (None: none). ``on_prompt_logits(j,
        logits)``: called with the logits [m, V] of the j-th ``rows.prompt_rows`` entry as each is computed (one
        at a time: a long prompt chunk's [m, V] is freed before the next), None to drop them. Returns the logits
        [R', V] of the sampled rows, None when no row is sampled."""
        rows, q = inputs.rows, inputs.graph_q
        if q is not None:
            logits = self.graphs.run(len(rows.seq_lens), q, rows.input_ids, rows.positions, rows.slot_mapping,
                                     rows.seq_lens, rows.block_tables, feed=feed, adapter_ids=rows.adapter_ids)
            if inputs.keep is not None:
                logits = logits[torch.tensor(inputs.keep, device=logits.device)]
            return logits
        batch = forward_batch(rows, feed, self.pad_block, self.device)
        with self.kv_cache.calculating_scales(inputs.measure_kv_scales):  # calculate_kv_scales: the first prefill
            hidden = self.model(batch)
        logits = self.model.compute_logits(hidden[batch.sample_rows]) if rows.sample_rows else None
        for j, (_, row0, m) in enumerate(rows.prompt_rows):
            prompt = self.model.compute_logits(hidden[row0:row0 + m])
            if on_prompt_logits is not None:
                on_prompt_logits(j, prompt)
        return logits

    def _graph_query_len(self, plan: StepPlan, rows) -> int | None:
        """The q of the captured graph that runs ``plan``: the smallest captured q >= its longest sequence (all
        rows sampled, no prompt logprobs or soft embeddings, a bucket captured, padded rows within
        max_model_len); None: run eagerly."""
        q = plan.max_query_len()
        if self.graphs is None or q is None or rows.prompt_rows or any(rows.soft_mask):
            return None
        q = next((g for g in self.graphs.query_lens if g >= q), None)
        if q is None or self.graphs.bucket_for(len(plan.seqs), q) is None:
            return None
        if any(s.start + q > self.config.max_model_len for s in plan.seqs):
            return None
        return q

    def _sample(self, plan: StepPlan, logits: torch.Tensor | None, prompt_lp: dict | None = None) -> StepResult:
        """The sampling stage: logits [R', V] of the plan's sampled rows -> StepResult (argmax on the device when
        the plan is ``argmax_only``, else the sampler); constrained rows (structured output) get their grammar's
        token bitmask first (``sparrow.engine.grammar.apply_bitmask``: after the forward pass or graph replay)."""
        if logits is None:
            return StepResult(torch.empty(0, dtype=torch.int64, device=self.device), None, prompt_lp)
        grammar_rows = constrained_rows(plan)
        if grammar_rows:
            apply_bitmask(logits, grammar_rows)
        if plan.argmax_only:
            return StepResult(logits.float().argmax(dim=-1), None, prompt_lp)
        out = self.sampler(logits, self._states(plan))
        return StepResult(out.tokens, out.logprobs, prompt_lp)

    @staticmethod
    def _states(plan: StepPlan) -> list[SamplingState]:
        """One SamplingState per sampled row; row j of a verify step sees the draft tokens before it as output."""
        states = []
        for item in plan.seqs:
            seq = item.seq
            for j in range(item.num_sampled):
                drafts = item.draft_token_ids[:j - item.num_sampled + len(item.draft_token_ids) + 1]
                out = seq.output_token_ids + list(drafts) if drafts else seq.output_token_ids
                states.append(SamplingState(seq.params, seq.prompt_token_ids, out, seq.generator, seq.eos_token_ids))
        return states
