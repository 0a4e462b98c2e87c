"""Random GGUF blocks for the named model shapes: ``quantization="gguf-q4_k_m"`` / ``"gguf-q8_0"`` of
``model_shapes.random_llm`` and ``sparrow bench --model-shape``.

GGUF has no on-load quantizer, so a random-block model's weights ARE random ggml blocks: every weight a recipe
quantizes is generated as packed rows, uint8 [..., K // B * T] carrying ``ggml_type`` (B elements of T bytes a
block), the form ``loader.gguf.GGUFCheckpoint.tensors(packed=True)`` yields a ``.gguf`` file's tensors in, under
HF names, and loads in the "gguf" format (``sparrow.quant.gguf``) as such a file does.

Recipes (``RECIPES``): the tensor types llama.cpp's ``llama-quantize`` gives each weight for a file type, read
from llama.cpp src/llama-quant.cpp (``llama_tensor_get_type_impl``; the counters of
``init_quantize_state_counters``; ``tensor_type_fallback``; ``tensor_allows_quantization`` for what stays float):
- gguf-q8_0 (LLAMA_FTYPE_MOSTLY_Q8_0): Q8_0 everywhere.
- gguf-q4_k_m (LLAMA_FTYPE_MOSTLY_Q4_K_M): Q4_K, except: the LM head (``output``; the embedding too when tied)
  Q6_K; the i-th of the n V projections (``attn_v``; Gemma 4's K=V layers have none) Q6_K where
  ``use_more_bits(i, n)``; every down projection (dense, shared and routed experts: ``ffn_down*``) of layer i of n
  Q6_K where ``use_more_bits(i, n)``; with exactly 8 experts (Mixtral's rule) ``attn_v`` and ``attn_k`` Q8_0 and
  ``attn_output`` Q5_K. ``use_more_bits(i, n)``: i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2, integer division.
- both: a type whose block does not divide the row (K, the in features) falls back as llama.cpp's does: Q4_K ->
  Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0 (gemma4-26b-a4b's expert width 704, dense width 2112); a row no fallback
  divides stays float (llama.cpp: F16).
Not quantized (left to ``model_shapes.random_weights``' floats): 1-D tensors (norms, biases, router scales) and the
routers (``mlp.gate``, ``router.proj``, ``shared_expert_gate``: llama.cpp's ``ffn_gate_inp``).

Blocks (``random_blocks``): random bytes, then each block's fp16 scale ``d`` set to a positive finite value drawn
around ``d_scale(type)`` (x U(0.5, 1.5)) and its fp16 min (``dmin`` of Q2_K / Q4_K / Q5_K, ``m`` of Q4_1 / Q5_1) to
the value that centres the block's codes, so the dequantized weights have about ``STD`` (0.02, ``random_weights``'
std) and the activations stay finite in bf16.
"""
from __future__ import annotations

import functools
import re
from typing import Callable, Iterator

import torch
from gguf.constants import GGMLQuantizationType as T

from sparrow.errors import InvalidRequestError
from sparrow.kernels.common.gguf_blocks import block_bytes, dequantize

STD = 0.02
"""Target standard deviation of a random block's dequantized weights (that of ``random_weights``' floats)."""

# type -> (byte offset of d, byte offset of the min or None, min / d): ggml-common.h's block structs. The min
# centres the codes: y = d * q + m (Q4_1, Q5_1: m = -mid * d), y = d * sc * q - dmin * mn (K-quants: dmin = mid * d)
_FP16_FIELDS: dict[T, tuple[int, int | None, float]] = {
    T.Q4_0: (0, None, 0.0), T.Q4_1: (0, 2, -7.5), T.Q5_0: (0, None, 0.0), T.Q5_1: (0, 2, -15.5),
    T.Q8_0: (0, None, 0.0), T.Q2_K: (80, 82, 1.5), T.Q3_K: (108, None, 0.0), T.Q4_K: (0, 2, 7.5),
    T.Q5_K: (0, 2, 15.5), T.Q6_K: (208, None, 0.0),
}
_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}  # tensor_type_fallback, the types we use
_CATEGORY = {  # HF module / stacked parameter -> llama.cpp tensor category (tensor_get_category)
    "embed_tokens": "token_embd", "lm_head": "output", "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
    "o_proj": "attn_output", "gate_proj": "ffn_gate", "up_proj": "ffn_up", "gate_up_proj": "ffn_gate",
    "down_proj": "ffn_down",
}
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _use_more_bits(i: int, n: int) -> bool:
    """llama_tensor_get_type_impl's ``use_more_bits``: the first and last eighth of n, and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _q4_k_m(category: str, i: int, n: int, num_experts: int) -> T:
    """LLAMA_FTYPE_MOSTLY_Q4_K_M's type for a tensor of ``category``: ``i`` of ``n`` is the V projection's rank among
    the V projections for ``attn_v``, the layer for ``ffn_down``."""
    if category == "output":
        return T.Q6_K
    if category == "attn_v":
        return T.Q8_0 if num_experts == 8 else T.Q6_K if _use_more_bits(i, n) else T.Q4_K
    if num_experts == 8 and category in ("attn_k", "attn_output"):
        return T.Q8_0 if category == "attn_k" else T.Q5_K
    if category == "ffn_down" and _use_more_bits(i, n):
        return T.Q6_K
    return T.Q4_K


def _q8_0(category: str, i: int, n: int, num_experts: int) -> T:
    return T.Q8_0


RECIPES: dict[str, tuple[str, Callable[[str, int, int, int], T]]] = {
    "gguf-q4_k_m": ("Q4_K_M", _q4_k_m),
    "gguf-q8_0": ("Q8_0", _q8_0),
}
"""Random-block quantization name -> (llama.cpp file type, its type rule)."""


def is_recipe(quantization: str | None) -> bool:
    """Whether ``quantization`` names a random-block GGUF recipe (any case)."""
    return isinstance(quantization, str) and quantization.lower() in RECIPES


def describe(quantization: str) -> str:
    """A phrase for the run's banner: "random GGUF blocks in llama.cpp's Q4_K_M type mix"."""
    return f"random GGUF blocks in llama.cpp's {RECIPES[quantization.lower()][0]} type mix"


def shape_quant_config(quantization: str | None):
    """The weight-format config a random-weight shape loads in for ``quantization``: None (float), a format that
    quantizes at load ("fp8", "int4", ...), or a recipe of ``RECIPES``: the registry's "gguf" (``sparrow.quant.gguf``).
    Raises InvalidRequestError naming the accepted values for any other."""
    from sparrow.quant import check_quantization, config_for_quantization, get_quantization

    if is_recipe(quantization):
        return get_quantization("gguf")()
    try:
        check_quantization(quantization)
        return config_for_quantization(quantization)
    except InvalidRequestError as e:
        raise InvalidRequestError(f"{e}; a random-weight shape also takes random GGUF blocks: "
                                  f"{', '.join(map(repr, RECIPES))}") from None


def _category(name: str) -> str | None:
    parts = name.split(".")
    leaf = parts[-2] if parts[-1] == "weight" and len(parts) > 1 else parts[-1]
    return _CATEGORY.get(leaf)


def plan_types(quantization: str, weights: list[tuple[str, tuple[int, ...]]], num_layers: int, num_experts: int,
               tied: bool) -> dict[str, int]:
    """{HF name: ggml type} of every weight of ``weights`` ((name, shape), in the model's order; a stacked expert
    parameter [E, N, K] counts once) that recipe ``quantization`` quantizes (module doc); a name left out stays
    float. ``num_layers``, ``num_experts`` (0: dense), ``tied`` (the embedding is the LM head): the model's.
    Raises InvalidRequestError naming the recipes for an unknown ``quantization``."""
    if not is_recipe(quantization):
        raise InvalidRequestError(f"quantization={quantization!r} is no random-block GGUF recipe (known: "
                                  f"{', '.join(RECIPES)})")
    rule = RECIPES[quantization.lower()][1]
    sites = [(name, shape, _category(name)) for name, shape in weights if len(shape) >= 2]
    sites = [(n, s, "output" if c == "token_embd" and tied else c) for n, s, c in sites if c is not None]
    v_names = [n for n, _, c in sites if c == "attn_v"]
    plan: dict[str, int] = {}
    for name, shape, category in sites:
        m = _LAYER.search(name)
        layer = int(m.group(1)) if m else 0
        i, n = (v_names.index(name), len(v_names)) if category == "attn_v" else (layer, num_layers)
        ggml_type = rule(category, i, n, num_experts)
        if shape[-1] % block_bytes(ggml_type)[0]:
            ggml_type = _FALLBACK.get(ggml_type, ggml_type)
        if shape[-1] % block_bytes(ggml_type)[0] == 0:
            plan[name] = int(ggml_type)
    return plan


@functools.lru_cache(maxsize=None)
def d_scale(ggml_type: int) -> float:
    """The fp16 scale ``d`` that gives dequantized weights of std ``STD``: ``STD`` over the std of 64 random blocks
    dequantized with d = 1 (and the centring min) on the CPU."""
    gen = torch.Generator().manual_seed(0)
    elems = block_bytes(ggml_type)[0]
    blocks = _blocks(ggml_type, 64, gen, "cpu", 1.0)
    return STD / dequantize(blocks, ggml_type, (64 * elems,)).std().item()


def _blocks(ggml_type: int, n: int, gen: torch.Generator, device, scale: float) -> torch.Tensor:
    """``n`` random blocks uint8 [n, T], fp16 fields set (module doc) with d around ``scale``."""
    d_at, min_at, min_per_d = _FP16_FIELDS[T(ggml_type)]
    blocks = torch.randint(0, 256, (n, block_bytes(ggml_type)[1]), dtype=torch.uint8, device=device, generator=gen)
    d = (torch.rand(n, 1, device=device, generator=gen) + 0.5) * scale
    blocks[:, d_at:d_at + 2] = d.half().view(torch.uint8)
    if min_at is not None:
        blocks[:, min_at:min_at + 2] = (d * min_per_d).half().view(torch.uint8)
    return blocks


def random_blocks(ggml_type: int, shape: tuple[int, ...], gen: torch.Generator, device) -> torch.Tensor:
    """Random ggml blocks of type ``ggml_type`` for a weight of logical shape ``shape`` (..., K): uint8
    [..., K // B * T] on ``device`` (``gen`` on that device) with attribute ``ggml_type``, whose dequantized values
    have std about ``STD`` (module doc). Raises ValueError when B does not divide K or the type is not one of
    Q4_0 .. Q8_0, Q2_K .. Q6_K."""
    if T(ggml_type) not in _FP16_FIELDS:
        raise ValueError(f"random_blocks: {T(ggml_type).name} is not a ggml block type sparrow's kernels read")
    elems, nbytes = block_bytes(ggml_type)
    *lead, k = shape
    if k % elems:
        raise ValueError(f"random_blocks: rows of {k} elements are not whole {T(ggml_type).name} blocks of {elems}")
    rows = 1
    for s in lead:
        rows *= s
    out = _blocks(ggml_type, rows * (k // elems), gen, device, d_scale(ggml_type)).view(*lead, k // elems * nbytes)
    out.ggml_type = int(ggml_type)
    return out


def _pieces(name: str, blocks: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, packed rows) as the GGUF loader yields them: a stacked expert parameter ``...experts.gate_up_proj``
    [E, 2I, bytes] / ``...experts.down_proj`` [E, H, bytes] as per-expert ``experts.N.{gate,up,down}_proj.weight``
    views (gate rows first), anything else whole."""
    base, _, leaf = name.rpartition(".")
    if blocks.dim() == 2 or not base.endswith(".experts"):
        yield name, blocks
        return
    parts = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
    rows = blocks.shape[1] // len(parts)
    for e in range(blocks.shape[0]):
        for j, part in enumerate(parts):
            w = blocks[e, j * rows:(j + 1) * rows]
            w.ggml_type = blocks.ggml_type
            yield f"{base}.{e}.{part}.weight", w


def block_maker(plan: dict[str, int], device) -> Callable:
    """The ``blocks`` hook of ``model_shapes.random_weights`` for ``plan`` (``plan_types``): (name, shape, gen) ->
    the (HF name, random packed rows) pairs of that weight (``_pieces``), or None for a weight the plan keeps float."""
    def make(name: str, shape: tuple[int, ...], gen: torch.Generator):
        ggml_type = plan.get(name)
        if ggml_type is None:
            return None
        return list(_pieces(name, random_blocks(ggml_type, shape, gen, device)))
    return make
