"""GGUF checkpoints: metadata mapped to an HF config dict, and tensors renamed and reshaped to HF conventions,
in one place.

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
from sparrow.errors import ModelLoadError, UnsupportedArchitectureError

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


GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
"""GGUF ``general.architecture`` -> the HF architecture name sparrow builds for it."""

GEMMA3_27B_BLOCKS = 62
"""Block count of Gemma 3 27B, the one Gemma 3 size whose query_pre_attn_scalar is not its head_dim."""


def hf_config_from_gguf(metadata: dict[str, Any], tensor_names: set[str] | None = None) -> dict[str, Any]:
    """An HF ``config.json``-style dict for GGUF ``metadata`` ({key: python value}, as ``GGUFCheckpoint``
    reads it), for ``ModelConfig.from_hf``.

    Read from the metadata (``{arch}.`` keys, gguf.md's names): embedding_length, block_count,
    attention.head_count, attention.head_count_kv (default: head_count), attention.key_length (default:
    embedding_length / head_count, llama.cpp's n_embd_head_k), feed_forward_length,
    attention.layer_norm_rms_epsilon (default 1e-6), context_length (default 4096), rope.freq_base
    (default 10000), vocab_size (default: the tokenizer's token count), tokenizer.ggml.bos/eos_token_id.

    Fields the metadata does not carry, one rule each (llama.cpp's ``llama_model::load_hparams`` is the
    reference loader):
    - tie_word_embeddings: the file has no ``output.weight`` (llama.cpp then reuses ``token_embd``); left to
      from_hf's default when ``tensor_names`` is None.
    - hidden_act: gelu_pytorch_tanh for gemma3 (GeGLU), silu for the others.
    - attention_bias (q/k/v biases): qwen2 only; a bias tensor in another architecture's file is then an
      unused tensor, which the weight loader refuses.
    - attention scale: gemma3's query_pre_attn_scalar is hidden_size / num_attention_heads for the 27B
      (62 blocks: 5376 / 32 = 168, head_dim 128) and head_dim for every other size (270M, 1B, 4B, 12B:
      256), as llama.cpp keys it on the 27B and gemma_pytorch's configs set it; the others use head_dim ** -0.5.
    - gemma3 sliding attention: every 6th layer is full attention (sliding_window_pattern 6) and sliding
      layers use rope theta 10000 without scaling (rope_local_base_freq); the window itself is
      attention.sliding_window, required (512 for 270M / 1B, 1024 for 4B and up: no default fits all).
    - mistral: attention.sliding_window, when present, applies to every layer (HF's Mistral); absent, full
      attention. The other architectures ignore the key (HF's Llama / Qwen2 / Qwen3 default to full attention).
    - rope scaling: rope.scaling.type 'linear' (with rope.scaling.factor) maps to HF's linear rope_scaling;
      absent or 'none' is unscaled; another type (yarn, ...) is refused. Llama 3's frequency bands are not
      metadata but the ``rope_freqs.weight`` tensor, which the model loader applies.
    - rotary dims: rope.dimension_count, when present, must equal head_dim (partial rotary is refused).
    - value head dim: attention.value_length, when present, must equal head_dim.

    Raises UnsupportedArchitectureError for an architecture outside GGUF_ARCHITECTURES, ModelLoadError for
    missing shape keys, a numeric key that is not a positive number, or refused values (each named)."""
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(GGUF_ARCHITECTURES))}")

    def m(key: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{key}", default)

    def num(key: str, default: Any = None, kind: type = int) -> Any:
        """``{arch}.key`` as ``kind``; ModelLoadError naming the key for a value that is not a number >= 1
        (a float key: > 0)."""
        v = m(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and v != int(v)) \
                or (v < 1 if kind is int else not v > 0):
            raise ModelLoadError(f"GGUF metadata has {arch}.{key}={v!r}; it must be a "
                                 f"{'positive integer' if kind is int else 'positive number'}")
        return kind(v)

    if any(m(k) is None for k in ("embedding_length", "attention.head_count", "block_count")):
        raise ModelLoadError(f"GGUF metadata lacks the {arch} shape keys (embedding_length, attention.head_count, "
                             "block_count)")
    hidden, n_heads, n_layers = num("embedding_length"), num("attention.head_count"), num("block_count")
    vocab = ((num("vocab_size") if m("vocab_size") is not None else None)
             or metadata.get("tokenizer.ggml.tokens.length")
             or len(metadata.get("tokenizer.ggml.tokens", [])) or None)
    if vocab is None:
        raise ModelLoadError("GGUF metadata gives no vocab size (no vocab_size, no tokenizer.ggml.tokens)")
    head_dim = num("attention.key_length", hidden // n_heads)
    for key in ("attention.value_length", "rope.dimension_count"):
        if m(key) is not None and num(key) != head_dim:
            raise ModelLoadError(f"GGUF metadata has {arch}.{key}={m(key)} for head_dim {head_dim}; sparrow "
                                 "needs them equal")
    cfg: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": {"gemma3": "gemma3_text"}.get(arch, arch),
        "hidden_size": hidden,
        "intermediate_size": num("feed_forward_length", 1) if m("feed_forward_length") else 0,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": num("attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "rms_norm_eps": num("attention.layer_norm_rms_epsilon", 1e-6, float),
        "max_position_embeddings": num("context_length", 4096),
        "vocab_size": int(vocab),
        "rope_theta": num("rope.freq_base", 10000.0, float),
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "hidden_act": "gelu_pytorch_tanh" if arch == "gemma3" else "silu",
        "attention_bias": arch == "qwen2",
    }
    if tensor_names is not None:
        cfg["tie_word_embeddings"] = "output.weight" not in tensor_names
    if arch == "gemma3":
        if m("attention.sliding_window") is None:
            raise ModelLoadError("GGUF metadata lacks gemma3.attention.sliding_window (Gemma 3's window differs "
                                 "by size)")
        cfg.update(
            query_pre_attn_scalar=hidden // n_heads if n_layers == GEMMA3_27B_BLOCKS else head_dim,
            sliding_window=num("attention.sliding_window"),
            sliding_window_pattern=6,
            rope_local_base_freq=10000.0,
        )
    elif arch == "mistral" and m("attention.sliding_window") is not None:
        cfg["sliding_window"] = num("attention.sliding_window")
    scaling = m("rope.scaling.type")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": num("rope.scaling.factor", 1.0, float)}
    elif scaling not in (None, "none"):
        raise ModelLoadError(f"GGUF metadata has {arch}.rope.scaling.type={scaling!r}; sparrow supports 'linear' "
                             "and 'none'")
    return cfg


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
        from sparrow.quant.gguf import dequantize

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
