"""GGUF checkpoints: tensors renamed and reshaped to HF conventions, in one place (the metadata's mapping onto
HF config fields is ``sparrow.config.gguf.hf_config_from_gguf``).

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md, read with the ``gguf`` package
(memory-mapped). GGUF conventions that differ from HF, undone here:
- tensor names (``blk.N.attn_q.weight`` -> ``model.layers.N.self_attn.q_proj.weight``);
- shapes: GGUF lists dims fastest-first (ne0 = columns); we reverse them to torch's row-major order;
- Llama-family Q/K rows are permuted for llama.cpp's interleaved RoPE (convert_hf_to_gguf.py
  ``LlamaModel.permute``); we apply the inverse permutation to get HF's rotate-half layout;
- Gemma norm weights are stored as 1 + w (convert_hf_to_gguf.py, Gemma2/3); we subtract 1 in fp32.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
import warnings
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from sparrow.cache import cache_dir, file_key
from sparrow.errors import ModelLoadError

log = logging.getLogger(__name__)

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


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
        """HF name of a GGUF tensor, or None when it has no HF counterpart (e.g. rope_freqs)."""
        base, _, kind = gguf_name.rpartition(".")
        if base in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[base]}.{kind}"
        m = _BLK.match(gguf_name)
        if not m:
            return None
        layer, short, kind = m.groups()
        if short == "ffn_norm":
            # Gemma 3 has sandwich norms: its ffn_norm is the pre-FF norm; elsewhere it is the post-attention norm
            hf = "pre_feedforward_layernorm" if self.arch == "gemma3" else "post_attention_layernorm"
        elif short in _LAYER_NAMES:
            hf = _LAYER_NAMES[short]
        else:
            return None
        return f"model.layers.{layer}.{hf}.{kind}"

    def tensors(self, device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, float32 tensor on ``device``), dequantized and converted to HF conventions.

        Raises ModelLoadError for a tensor GGUF names that sparrow does not know, and
        UnsupportedGGUFTypeError for an unsupported quantization type."""
        from sparrow.kernels.common.gguf_blocks import dequantize

        n_head = self.metadata.get(f"{self.arch}.attention.head_count")
        n_kv = self.metadata.get(f"{self.arch}.attention.head_count_kv", n_head)
        permute_qk = self.arch in ("llama", "mistral")
        for t in self.tensor_infos:
            name = self.rename(t.name)
            with warnings.catch_warnings():  # the memory map is read-only; we only read it
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.from_numpy(self._mmap[t.data_offset:t.data_offset + t.n_bytes])
            if name is None:
                if t.name == "rope_freqs.weight":
                    yield "rope_freqs", dequantize(raw, t.tensor_type, tuple(reversed(t.shape)), name=t.name)
                    continue
                raise ModelLoadError(f"GGUF tensor {t.name!r} has no known HF counterpart for {self.arch}")
            shape = tuple(reversed(t.shape))
            w = dequantize(raw.to(device), t.tensor_type, shape, name=t.name)
            if permute_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = n_head if "q_proj" in name else n_kv
                # inverse of llama.cpp's reshape(heads, 2, D/2, K).swapaxes(1, 2)
                w = w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
            if self.arch == "gemma3" and name.endswith("norm.weight"):
                w = w - 1
            yield name, w
