"""Exceptions raised to users. Every message names the thing that is wrong."""


class SparrowError(Exception):
    """Base class of every error sparrow raises for bad input or an unusable model."""


class ModelNotFoundError(SparrowError, FileNotFoundError):
    """The model path does not exist or holds no checkpoint."""


class ModelLoadError(SparrowError):
    """The checkpoint exists but cannot be loaded (truncated file, missing or misshaped tensor)."""


class UnsupportedArchitectureError(SparrowError):
    """The checkpoint's architecture has no sparrow implementation."""


class UnsupportedGGUFTypeError(ModelLoadError):
    """A GGUF tensor uses a ggml quantization type sparrow cannot dequantize."""


class InvalidRequestError(SparrowError, ValueError):
    """A prompt or sampling parameter is invalid (empty prompt, prompt too long, top_p=0, ...)."""


class LoRAAdapterError(InvalidRequestError):
    """A LoRA adapter cannot be used: missing or malformed folder, an unsupported PEFT feature (DoRA, biases,
    modules_to_save), a rank over max_lora_rank, or a target module sparrow cannot adapt."""


class LoRAAdapterNotFoundError(LoRAAdapterError):
    """No adapter at a LoRA path: it is not a folder, or the folder lacks adapter_config.json or its weights file
    (the server answers 404, as vLLM answers "No adapter found")."""


class InsufficientMemoryError(InvalidRequestError):
    """The KV pool the memory settings allow cannot hold one sequence of max_model_len tokens (or does not fit the
    free device memory); the message names the weights, free and total memory and the setting to change."""


class WorkerError(SparrowError):
    """A tensor-parallel worker (rank 1..N-1, ``sparrow.engine.workers``) failed: an exception while loading or in
    a step, or its process died. The message names the rank and quotes the worker's error; the LLM's group is
    broken afterwards (every later step raises it again)."""
