"""The resolved settings of one ``sparrow bench`` run, from the command line."""
from __future__ import annotations

from dataclasses import dataclass


from sparrow.config import CacheConfig
from sparrow.errors import InvalidRequestError

@dataclass
class Settings:
    """The resolved benchmark settings."""

    device: str
    dtype: str
    batch_sizes: list[int]
    prompt_lens: list[int]
    decode_tokens: int
    repeats: int = 1
    seed: int = 0
    enforce_eager: bool = False
    quantization: str | None = None
    quantize_lm_head: bool = False
    """sparrow's LM head in FP8 too (--quantize-lm-head; needs --quantization fp8 or an FP8 checkpoint)."""
    hf_dtype: str | None = None
    """transformers' dtype when it differs from sparrow's (--hf-dtype, checkpoints only); None: the same."""
    gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization
    """Fraction of GPU memory sparrow's engine may use, weights + KV pool (--gpu-memory-utilization)."""
    kv_cache_dtype: str = CacheConfig.kv_cache_dtype
    """sparrow's KV cache storage (--kv-cache-dtype: auto, fp8, fp8_e4m3)."""
    tensor_parallel_size: int = 1
    """sparrow's ranks (--tensor-parallel-size; rank r on cuda:r); transformers runs on one device."""
    enable_expert_parallel: bool = False
    """sparrow's MoE layers split their experts over the ranks (--enable-expert-parallel)."""

    @property
    def max_model_len(self) -> int:
        """Longest sequence a run needs (+1 spare position)."""
        return max(self.prompt_lens) + self.decode_tokens + 1


def _int_list(text: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise InvalidRequestError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not out or any(v < 1 for v in out):
        raise InvalidRequestError(f"{flag} needs positive integers, got {text!r}")
    return out


def resolve_settings(args) -> Settings:
    """Settings from the CLI flags; unset sizes default by device (GPU: batches 1,8,64, prompts 128,2048,
    64 new tokens; CPU: batches 1,8, prompt 128, 32 new tokens)."""
    from sparrow.devices import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    gpu = device.startswith("cuda")
    s = Settings(
        device=device, dtype=resolve_dtype(args.dtype, device),
        batch_sizes=_int_list(_given(args.batch_sizes, "1,8,64" if gpu else "1,8"), "--batch-sizes"),
        prompt_lens=_int_list(_given(args.prompt_len, "128,2048" if gpu else "128"), "--prompt-len"),
        decode_tokens=_given(args.decode_tokens, 64 if gpu else 32),
        repeats=_given(getattr(args, "repeats", None), 1), seed=_given(getattr(args, "seed", None), 0),
        enforce_eager=bool(getattr(args, "enforce_eager", False)), quantization=getattr(args, "quantization", None),
        quantize_lm_head=bool(getattr(args, "quantize_lm_head", False)),
        hf_dtype=resolve_dtype(args.hf_dtype, device) if getattr(args, "hf_dtype", None) else None,
        gpu_memory_utilization=_given(getattr(args, "gpu_memory_utilization", None),
                                      CacheConfig.gpu_memory_utilization),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", None) or CacheConfig.kv_cache_dtype,
        tensor_parallel_size=_given(getattr(args, "tensor_parallel_size", None), 1),
        enable_expert_parallel=bool(getattr(args, "enable_expert_parallel", False)),
    )
    from sparrow.random_gguf import is_recipe

    if is_recipe(s.quantization) and not args.model_shape:
        raise InvalidRequestError(f"--quantization {s.quantization} makes random GGUF blocks: it needs --model-shape "
                                  "(a .gguf file loads in its own blocks, without --quantization)")
    if s.hf_dtype and args.model_shape:
        raise InvalidRequestError("--hf-dtype works with --model only (a random-weight shape is shared in one dtype)")
    if s.decode_tokens < 2:
        raise InvalidRequestError("--decode-tokens must be at least 2 (decode speed needs a second token)")
    if s.repeats < 1:
        raise InvalidRequestError(f"--repeats must be at least 1, got {s.repeats}")
    return s


def _given(value, default):
    """A flag's value when given (0 and "" included, so they are checked, not replaced), else the default."""
    return default if value is None else value
