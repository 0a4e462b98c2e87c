"""Build a model from a path: a ``.gguf`` file or an HF folder (config.json + safetensors)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from sparrow.config import ModelConfig
from sparrow.errors import ModelLoadError, ModelNotFoundError
from sparrow.loader.weights import load_weights
from sparrow.models.registry import get_model_class

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: ModelConfig
    path: Path
    is_gguf: bool
    gguf_metadata: dict | None = None


def read_model_config(path: str | Path) -> tuple[ModelConfig, bool, object]:
    """(config, is_gguf, checkpoint handle) for a path; ModelNotFoundError if it does not exist."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model path {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is neither a .gguf file nor an HF checkpoint folder")
        from sparrow.loader.gguf import GGUFCheckpoint

        ckpt = GGUFCheckpoint(path)
        return ModelConfig.from_gguf(ckpt.metadata, ckpt.tensor_names), True, ckpt
    from sparrow.loader.safetensors import read_config

    return ModelConfig.from_hf(read_config(path)), False, None


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LoadedModel:
    """Instantiate the registered architecture and fill its weights. Errors name the problem
    (missing path, unsupported architecture, missing/misshaped/unused tensor, truncated file)."""
    path = Path(path).expanduser()
    config, is_gguf, ckpt = read_model_config(path)
    cls = get_model_class(config.architecture)
    with torch.device(device):  # parameters are allocated (uninitialized) where they will live
        model = cls(config, dtype=dtype)
    if is_gguf:
        tensors = ckpt.tensors(device="cpu")
    else:
        from sparrow.loader.safetensors import iter_safetensors

        tensors = iter_safetensors(path, device="cpu")
    rope_freqs = []

    def filtered():
        for name, t in tensors:
            if name == "rope_freqs":
                rope_freqs.append(t)
                continue
            yield name, t

    load_weights(model, filtered())
    if rope_freqs:
        for mod in model.modules():
            if hasattr(mod, "set_freq_factors"):
                mod.set_freq_factors(rope_freqs[0])
    if hasattr(model, "process_weights_after_loading"):
        model.process_weights_after_loading()
    model.eval()
    return LoadedModel(model, config, path, is_gguf, ckpt.metadata if is_gguf else None)
