"""``LLM``: the user-facing class (vLLM's names): load a model, generate for a batch of prompts."""
from __future__ import annotations

import logging
import os
from typing import Iterator, Sequence as Seq

import torch

from sparrow.config import CacheConfig, EngineConfig, SchedulerConfig
from sparrow.engine.engine import Engine
from sparrow.errors import InvalidRequestError
from sparrow.outputs import RequestOutput
from sparrow.sampling_params import SamplingParams

log = logging.getLogger(__name__)

from sparrow.config import TORCH_DTYPES as _DTYPES


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'. Raises InvalidRequestError for 'cuda' without one."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidRequestError("device='cuda' was asked for but no CUDA GPU is visible")
    if device != "cpu" and not device.startswith("cuda"):
        raise InvalidRequestError(f"unknown device {device!r} (use 'auto', 'cpu' or 'cuda')")
    return device


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16, read from /proc/cpuinfo), so that
    bf16 weights halve the bytes of a matmul without a slow emulation."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_dtype(dtype: str, device: str) -> str:
    """'auto' -> bfloat16 on CUDA and on CPUs with native bf16 (decode reads half the bytes of fp32),
    float32 on other CPUs."""
    if dtype == "auto":
        if device.startswith("cuda") or cpu_has_native_bf16():
            return "bfloat16"
        return "float32"
    if dtype not in _DTYPES:
        raise InvalidRequestError(f"unknown dtype {dtype!r} (use 'auto', 'float32', 'bfloat16' or 'float16')")
    return dtype


class LLM:
    """Load a model and generate.

    model: an HF folder (config.json + safetensors), a ``.gguf`` file, or None for the packaged default
    (Gemma 3 270M Q4_K_M). device: 'auto' | 'cpu' | 'cuda'. dtype: 'auto' | 'float32' | 'bfloat16' |
    'float16'. max_model_len: longest prompt + output (default: the model's, capped at 8192).
    quantization: None or a registered weight format (``sparrow.quant.supported_quantization()``; 'fp8':
    quantize a float checkpoint's linear layers and experts to block-scaled FP8 at load); a quantized
    checkpoint, declared by config.json's quantization_config, loads in its format either way.
    quantize_lm_head: with FP8 linears, compute the logits on a block-scaled FP8 copy of the LM head too (off by
    default, as in vLLM: it halves the LM head's bytes and rounds the logits; see ``CausalLM.quantize_lm_head``).
    tokenizer: a transformers tokenizer to use instead of the model's; skip_tokenizer_init=True runs without one.
    Raises sparrow errors (ModelNotFoundError, ModelLoadError, UnsupportedArchitectureError, ...)."""

    def __init__(self, model: str | None = None, device: str = "auto", dtype: str = "auto",
                 max_model_len: int | None = None, quantization: str | None = None, block_size: int = 16,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, enforce_eager: bool = False,
                 num_kv_blocks: int | None = None, enable_prefix_caching: bool = True, seed: int = 0,
                 tokenizer=None, skip_tokenizer_init: bool = False, quantize_lm_head: bool = False):
        from sparrow.default_model import default_model_path
        from sparrow.loader.model_loader import load_model
        from sparrow.quant import check_quantization
        from sparrow.tokenizer import load_tokenizer

        check_quantization(quantization)  # InvalidRequestError naming the registered formats
        if model is not None and not isinstance(model, (str, os.PathLike)):
            raise InvalidRequestError(f"model={model!r} must be a path (str) or None for the packaged default")
        for name, val in (("max_model_len", max_model_len), ("block_size", block_size), ("max_num_seqs", max_num_seqs),
                          ("max_num_batched_tokens", max_num_batched_tokens), ("num_kv_blocks", num_kv_blocks)):
            if val is not None and (isinstance(val, bool) or not isinstance(val, int)):
                raise InvalidRequestError(f"{name}={val!r} must be an integer")
            if val is not None and val < 1:
                raise InvalidRequestError(f"{name}={val} must be at least 1")
        if block_size & (block_size - 1):  # >= 1 checked above
            raise InvalidRequestError(f"block_size={block_size} must be a power of two")
        path = os.fspath(model) if model is not None else default_model_path()
        device = resolve_device(device)
        dtype = resolve_dtype(dtype, device)
        if dtype == "float16" and device == "cpu":
            raise InvalidRequestError("dtype='float16' is not supported on the CPU (use 'float32' or 'bfloat16')")
        torch.manual_seed(seed)
        loaded = load_model(path, _DTYPES[dtype], device, quantization=quantization,
                            quantize_lm_head=quantize_lm_head)
        mcfg = loaded.config
        limit = mcfg.max_position_embeddings
        if max_model_len is None:
            max_model_len = min(limit, 8192)
        elif max_model_len > limit:
            raise InvalidRequestError(f"max_model_len={max_model_len} exceeds the model's {limit} positions")
        elif max_model_len < 2:
            raise InvalidRequestError(f"max_model_len={max_model_len} must be at least 2")
        if num_kv_blocks is not None and num_kv_blocks * block_size < max_model_len:
            raise InvalidRequestError(f"num_kv_blocks={num_kv_blocks} of {block_size} tokens cannot hold one "
                                      f"sequence of max_model_len={max_model_len} tokens")
        config = EngineConfig(
            model=mcfg, device=device, dtype=dtype, max_model_len=max_model_len,
            cache=CacheConfig(block_size=block_size, num_blocks=num_kv_blocks,
                              enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens),
            enforce_eager=enforce_eager,
        )
        # skip_tokenizer_init (vLLM's name): no tokenizer; prompts must be {'prompt_token_ids': [...]}, no text out
        self.tokenizer = tokenizer if tokenizer is not None or skip_tokenizer_init else load_tokenizer(path)
        self.engine = Engine(config, loaded.model, self.tokenizer)
        self.model_path = path
        self._watched: dict[str, RequestOutput | None] = {}
        """Latest output of each request a ``generate`` or ``stream`` call is waiting on (None before its first):
        whichever call steps the engine records them, so interleaved calls lose nothing."""

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def get_tokenizer(self):
        return self.tokenizer

    def _normalize(self, prompts, sampling_params):
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise InvalidRequestError(f"prompts must be a string, a dict with 'prompt_token_ids', or a list of "
                                      f"them; got {type(prompts).__name__}")
        prompts = list(prompts)
        if not prompts:
            raise InvalidRequestError("no prompts given")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        sampling_params = list(sampling_params)
        if any(not isinstance(sp, SamplingParams) for sp in sampling_params):
            raise InvalidRequestError("sampling_params must be a SamplingParams or a list of them")
        if len(sampling_params) != len(prompts):
            raise InvalidRequestError(
                f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts (give one, or one per prompt)")
        return prompts, sampling_params

    def _step(self) -> None:
        """One engine step, recording the outputs of the requests in ``_watched``."""
        for out in self.engine.step():
            if out.request_id in self._watched:
                self._watched[out.request_id] = out

    def _aborted(self, rid: str) -> bool:
        """Whether ``rid`` left the engine without finishing (aborted by the engine: a step it was in raised)."""
        out = self._watched.get(rid)
        return (out is None or not out.finished) and rid not in self.engine.requests

    def _release(self, rid: str) -> None:
        """Stop waiting on ``rid``; abort it when it has not finished (an exception or an abandoned stream)."""
        out = self._watched.pop(rid, None)
        if (out is None or not out.finished) and rid in self.engine.requests:
            self.engine.abort(rid)

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for one prompt or a list (text, or {'prompt_token_ids': [...]}); results in prompt order.
        All prompts are validated before any runs, so a bad one raises without side effects. Requests of an
        unfinished ``stream`` keep running and keep their outputs; if this call raises (or is interrupted), its
        own requests are aborted."""
        prompts, params = self._normalize(prompts, sampling_params)
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.engine.add_request(p, sp))
                self._watched[ids[-1]] = None
            bar = None
            if use_tqdm:
                from tqdm import tqdm

                bar = tqdm(total=len(ids), desc="generating")
            finished = 0
            while True:
                now = sum(1 for r in ids if self._watched[r] is not None and self._watched[r].finished)
                if bar:
                    bar.update(now - finished)
                finished = now
                if finished == len(ids):
                    break
                gone = [r for r in ids if self._aborted(r)]
                if gone:
                    raise RuntimeError(f"request {gone[0]} was aborted: a step it was part of was interrupted "
                                       "or failed")
                self._step()
            if bar:
                bar.close()
            return [self._watched[r] for r in ids]
        finally:
            for rid in ids:
                self._release(rid)

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one prompt's first completion as it is generated (new text per step). With stop
        strings (and not ``include_stop_str_in_output``) the last len(longest stop string) - 1 characters are
        held back until the request finishes, so the pieces always join to the final text. Closing the
        iterator early aborts the request."""
        rid = self.engine.add_request(prompt, sampling_params or SamplingParams())
        self._watched[rid] = None
        sp = self.engine.requests[rid][1][0].params  # the request's validated copy (stop strings normalized)
        stops = [] if sp.include_stop_str_in_output else sp.stop_strings
        hold = max((len(s) for s in stops), default=1) - 1
        sent = 0
        try:
            while True:
                out = self._watched[rid]
                if out is not None:
                    text = out.outputs[0].text
                    end = len(text) if out.finished else max(sent, len(text) - hold)
                    if end > sent:
                        piece, sent = text[sent:end], end
                        yield piece
                        continue  # read again: a generate() between two pieces may have stepped the engine
                    if out.finished:
                        return
                if self._aborted(rid):
                    raise RuntimeError(f"request {rid} was aborted: a step it was part of was interrupted or failed")
                self._step()
        finally:
            self._release(rid)

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None) -> RequestOutput:
        """Generate the assistant's reply to a conversation, rendered with the model's chat template."""
        from sparrow.tokenizer import apply_chat_template

        return self.generate(apply_chat_template(self.tokenizer, messages), sampling_params)[0]
