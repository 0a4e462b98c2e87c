"""HF checkpoint folders: config.json + *.safetensors (single file or sharded with an index), streamed
one tensor at a time so the model's parameters are the only full copy in memory.

Format (https://github.com/huggingface/safetensors): 8-byte little-endian header length N, N bytes of JSON
``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}``, then the data (offsets
relative to its start, row-major, little-endian). We read each tensor with plain ``readinto`` into a fresh
buffer rather than memory-mapping the file: mapped file pages count in the process's resident memory until
the file is closed, so an mmap reader peaks near (parameters + file size); this one peaks near
(parameters + the largest tensor). Tensors stream in file-offset order (sequential reads).
"""
from __future__ import annotations

import json
import struct
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


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def read_header(path: Path) -> tuple[dict, int]:
    """(header {name: info}, byte offset of the data section) of one safetensors file.
    Raises ModelLoadError for a file that is not safetensors or is truncated."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelLoadError(f"cannot read {path}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 << 20:
            raise ModelLoadError(f"cannot read {path}: header length {n} does not fit a {size}-byte file")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"cannot read {path}: its safetensors header is not JSON ({e})") from None
    header.pop("__metadata__", None)
    data_start = 8 + n
    end = max((info["data_offsets"][1] for info in header.values()), default=0)
    if data_start + end > size:
        raise ModelLoadError(f"{path} is truncated: tensor data ends at byte {data_start + end}, file has {size}")
    return header, data_start


def iter_safetensors(folder: Path, device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the checkpoint, one at a time, each read into its own
    buffer (nothing memory-mapped); the caller copies it into place and drops it."""
    for path in safetensors_files(folder):
        header, data_start = read_header(path)
        with open(path, "rb", buffering=0) as f:
            for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                dtype = _DTYPES.get(info["dtype"])
                if dtype is None:
                    raise ModelLoadError(f"tensor {name!r} in {path} has unsupported dtype {info['dtype']}")
                begin, end = info["data_offsets"]
                shape = [int(x) for x in info["shape"]]
                numel = 1
                for x in shape:
                    numel *= x
                if end - begin != numel * torch.empty((), dtype=dtype).element_size():
                    raise ModelLoadError(f"tensor {name!r} in {path}: {end - begin} bytes for shape {shape} {info['dtype']}")
                buf = torch.empty(end - begin, dtype=torch.uint8)
                f.seek(data_start + begin)
                view = memoryview(buf.numpy())
                got = 0
                while got < len(view):
                    n = f.readinto(view[got:])
                    if not n:
                        raise ModelLoadError(f"{path} is truncated inside tensor {name!r}")
                    got += n
                t = buf.view(dtype).reshape(shape)
                yield name, (t if str(device) == "cpu" else t.to(device))
