"""HF checkpoint folders: config.json + *.safetensors (single file or sharded with an index), streamed
one tensor at a time so the model's parameters are the only full copy in memory."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from sparrow.errors import ModelLoadError, ModelNotFoundError, SparrowError


def read_config(folder: Path) -> dict:
    """config.json of an HF folder as a dict."""
    path = folder / "config.json"
    if not path.is_file():
        raise ModelNotFoundError(f"{folder} has no config.json (not an HF checkpoint folder)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's files: those named by model.safetensors.index.json, else every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"sharded checkpoint lacks the files {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{folder} holds no *.safetensors files")
    return files


def iter_safetensors(folder: Path, device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the checkpoint, one at a time (memory-mapped reads)."""
    from safetensors import safe_open

    for path in safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SparrowError:
            raise
        except Exception as e:  # safetensors raises its own SafetensorError for corrupt files
            raise ModelLoadError(f"cannot read {path}: {e}") from None
