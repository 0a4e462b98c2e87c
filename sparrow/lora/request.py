"""``LoRARequest`` (vLLM's name and fields): which adapter a request runs with."""
from __future__ import annotations

import os
from dataclasses import dataclass

from sparrow.errors import InvalidRequestError


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors`` or ``adapter_model.bin``) to
    apply to one request.

    lora_name: a name for logs and errors; lora_int_id: the adapter's id, unique per adapter and > 0 (the engine
    caches the loaded adapter and the prefix cache keys blocks by it); lora_path: the folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise InvalidRequestError(f"LoRARequest {self.lora_name!r}: lora_int_id must be an int >= 1, "
                                      f"got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, (str, os.PathLike)):
            raise InvalidRequestError(f"LoRARequest {self.lora_name!r}: lora_path must be a path, "
                                      f"got {type(self.lora_path).__name__}")
        object.__setattr__(self, "lora_path", os.fspath(self.lora_path))
