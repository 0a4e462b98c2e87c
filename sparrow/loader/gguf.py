"""GGUF checkpoints: the file's metadata, and its tensors renamed and reshaped to HF conventions (the metadata's
mapping onto HF config fields is ``sparrow.config.gguf.hf_config_from_gguf``).

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md, read with the ``gguf`` package
(memory-mapped). Shapes: GGUF lists dims fastest-first (ne0 = columns); we reverse them to torch's row-major
order. The GGUF conventions that differ from HF (tensor names, merged expert tensors, Llama-family Q/K row
order, Gemma's 1 + w norms, squeezed and relocated MoE tensors) are undone by the per-tensor rules of
``sparrow.loader.gguf_names`` (its docstring lists each, with its source in convert_hf_to_gguf.py).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
import warnings
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from sparrow.cache import cache_dir, file_key
from sparrow.errors import ModelLoadError
from sparrow.loader.gguf_names import GGUFNames, apply_rule, rename, tensor_rule

log = logging.getLogger(__name__)

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""GGUF metadata value type -> bytes (gguf.md: uint8 .. float64; 8 = string, 9 = array are variable)."""


def check_extents(path: Path) -> None:
    """Walk a GGUF file's header (gguf.md: magic, version, tensor and KV counts, the KV pairs, the tensor
    index) without decoding values, and check that the header and every tensor's data (offset + ggml size of
    its dims, after the ``general.alignment``-aligned data start) lie inside the file. Raises ModelLoadError
    naming the file, what is cut and where; a file that is not GGUF at all is left to the full parser."""
    import mmap
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size = path.stat().st_size
    with open(path, "rb") as f:
        if size < 24 or f.read(4) != b"GGUF":
            return
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    pos = 4

    def take(fmt: str):
        nonlocal pos
        n = struct.calcsize(fmt)
        if pos + n > size:
            raise ModelLoadError(f"GGUF file {path} is truncated: its header (metadata and tensor index) runs past "
                                 f"the end of the file ({size} bytes)")
        pos += n
        return struct.unpack_from(fmt, buf, pos - n)

    def skip_value(vtype: int) -> None:
        nonlocal pos
        if vtype == 8:
            (n,) = take("<Q")
            pos += n
        elif vtype == 9:
            etype, count = take("<IQ")
            if etype in _SCALAR_SIZES:
                pos += count * _SCALAR_SIZES[etype]
            else:
                for _ in range(count):
                    skip_value(etype)
        elif vtype in _SCALAR_SIZES:
            pos += _SCALAR_SIZES[vtype]
        else:
            raise ModelLoadError(f"GGUF file {path} has a metadata value of unknown type {vtype} at byte {pos}")

    try:
        _version, n_tensors, n_kv = take("<IQQ")
        alignment = 32
        for _ in range(n_kv):
            (n,) = take("<Q")
            key = bytes(buf[pos:pos + n]).decode("utf-8", "replace")
            pos += n
            (vtype,) = take("<I")
            if key == "general.alignment" and vtype == 4:
                (alignment,) = take("<I")
            else:
                skip_value(vtype)
        infos = []
        for _ in range(n_tensors):
            (n,) = take("<Q")
            name = bytes(buf[pos:pos + n]).decode("utf-8", "replace")
            pos += n
            (n_dims,) = take("<I")
            dims = take(f"<{n_dims}Q")
            ttype, offset = take("<IQ")
            infos.append((name, dims, ttype, offset))
        take("<0s")  # the index itself ends inside the file
        start = (pos + alignment - 1) // alignment * alignment
        for name, dims, ttype, offset in infos:
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
            except (ValueError, KeyError):
                continue  # an unknown type: the dequantizer names it
            count = 1
            for d in dims:
                count *= d
            end = start + offset + count // block * type_size
            if end > size:
                raise ModelLoadError(f"GGUF file {path} is truncated: tensor {name!r} data ends at byte {end}, "
                                     f"file has {size}")
    finally:
        buf.close()


@dataclass
class TensorInfo:
    """Where one tensor's bytes lie in the file."""

    name: str
    tensor_type: int
    shape: list[int]
    """GGUF order: ne0 (fastest) first."""
    data_offset: int
    n_bytes: int


# Metadata arrays that only the tokenizer reads; the index cache records their length, not their content.
_TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                     "tokenizer.ggml.merges")


class GGUFCheckpoint:
    """An open GGUF file. ``metadata`` is {key: python value}; ``tensors()`` yields (HF name, fp32 tensor).

    gguf's GGUFReader parses every metadata field up front, which takes seconds for a 262k-token
    vocabulary; so the first open saves the tensor index and the metadata (tokenizer arrays reduced to
    their length) under ~/.cache/sparrow/gguf-index, keyed by path, size and mtime, and later opens read
    that index and memory-map the file directly."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        st = self.path.stat()
        cache = cache_dir("gguf-index", f"{file_key(self.path, 20)}.json")
        index = None
        if cache.is_file():
            try:
                index = json.loads(cache.read_text())
            except (OSError, json.JSONDecodeError):
                index = None
        if index is None:
            check_extents(self.path)  # a truncated file is named in a second, not after parsing it all
            log.info("reading the metadata of %s (first use only; its index is cached in %s)", self.path.name, cache)
            index = self._parse()
            try:
                cache.parent.mkdir(parents=True, exist_ok=True)
                cache.write_text(json.dumps(index))
            except OSError as e:  # a read-only cache only costs time
                log.warning("could not write the GGUF index cache %s: %s", cache, e)
        self.metadata = index["metadata"]
        self.tensor_infos = [TensorInfo(**t) for t in index["tensors"]]
        self.tensor_names = {t.name for t in self.tensor_infos}
        self.arch = self.metadata.get("general.architecture")
        end = max((t.data_offset + t.n_bytes for t in self.tensor_infos), default=0)
        if end > st.st_size:
            raise ModelLoadError(f"GGUF file {self.path} is truncated: tensor data ends at byte {end}, "
                                 f"file has {st.st_size}")
        self.tensor_bytes = sum(t.n_bytes for t in self.tensor_infos)
        """Bytes of tensor data in the file."""
        self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")

    def _parse(self) -> dict:
        import gguf

        try:
            reader = gguf.GGUFReader(str(self.path))
        except Exception as e:  # truncated or not a GGUF file: gguf raises various types
            raise ModelLoadError(f"cannot read GGUF file {self.path} (truncated or not a GGUF file): "
                                 f"{type(e).__name__}: {' '.join(str(e).split())}") from None
        meta: dict[str, Any] = {}
        for key, f in reader.fields.items():
            if key in _TOKENIZER_ARRAYS:
                meta[key + ".length"] = len(f.data)
                continue
            try:
                val = f.contents()
            except Exception:  # a field gguf cannot decode is not one we read
                continue
            if isinstance(val, (str, int, float, bool, list)) or val is None:
                meta[key] = val
        tensors = [dict(name=t.name, tensor_type=int(t.tensor_type), shape=[int(x) for x in t.shape.tolist()],
                        data_offset=int(t.data_offset), n_bytes=int(t.n_bytes)) for t in reader.tensors]
        return {"metadata": meta, "tensors": tensors}

    def rename(self, gguf_name: str) -> str | None:
        """HF name of a GGUF tensor that maps one to one, or None (merged experts, rope_freqs, unknown names)."""
        return rename(self.arch, gguf_name)

    def rope_freqs(self) -> list[float] | None:
        """The values of the ``rope_freqs.weight`` tensor (llama.cpp's per-frequency RoPE divisors), None when
        the file has none; ``ModelConfig.from_gguf`` reads Gemma 4's proportional RoPE from them."""
        from sparrow.kernels.common.gguf_blocks import dequantize

        t = next((t for t in self.tensor_infos if t.name == "rope_freqs.weight"), None)
        if t is None:
            return None
        return dequantize(self._raw(t), t.tensor_type, tuple(reversed(t.shape)), name=t.name).flatten().tolist()

    def _raw(self, t: TensorInfo) -> torch.Tensor:
        """The bytes of tensor ``t`` (uint8, a view of the read-only memory map)."""
        with warnings.catch_warnings():  # the memory map is read-only; we only read it
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(self._mmap[t.data_offset:t.data_offset + t.n_bytes])

    def tensors(self, device: str | torch.device = "cpu", packed: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, tensor on ``device``) converted to HF conventions by the rules of
        ``sparrow.loader.gguf_names`` (merged expert tensors as per-expert views). ``packed``: a quantized tensor
        comes as its packed rows, uint8 [..., K // B * T] (views of the file's bytes) carrying its ggml type in
        ``ggml_type`` (the GGUF format, ``sparrow.quant.gguf``); float tensors, and every tensor without ``packed``,
        come dequantized to float32.

        Raises ModelLoadError for a tensor GGUF names that sparrow does not know or whose expert count is not
        the metadata's, and UnsupportedGGUFTypeError for an unsupported quantization type."""
        from sparrow.kernels.common.gguf_blocks import SUPPORTED_TYPES, block_bytes, dequantize

        names = GGUFNames.from_metadata(self.metadata)
        for t in self.tensor_infos:
            shape = tuple(reversed(t.shape))
            rule = tensor_rule(names, t.name, shape)
            if not rule.pieces:
                continue
            elems, type_bytes = block_bytes(t.tensor_type)
            if packed and elems > 1 and t.tensor_type in SUPPORTED_TYPES and not rule.norm_shift \
                    and len(shape) >= 2 and shape[-1] % elems == 0:
                rows = self._raw(t).view(*shape[:-1], shape[-1] // elems * type_bytes)
                for name, w in apply_rule(rule, t.name, rows):
                    w.ggml_type = t.tensor_type
                    yield name, w
                continue
            w = dequantize(self._raw(t).to(device), t.tensor_type, shape, name=t.name)
            yield from apply_rule(rule, t.name, w)
