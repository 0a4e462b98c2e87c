"""Read a PEFT LoRA adapter folder and map its tensors onto sparrow's modules.

A folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (or, as PEFT's
``save_pretrained(..., safe_serialization=False)`` writes it, ``adapter_model.bin``: ``torch.save`` of the state dict;
the safetensors file is read when both exist) with ``<module>.lora_A.weight`` [r, in] and ``<module>.lora_B.weight``
[out, r] per adapted module, ``<module>`` under ``base_model.model.``.
PEFT computes y = W x + s B (A x), s = lora_alpha / r (``use_rslora``: lora_alpha / sqrt(r); ``alpha_pattern``
overrides alpha per module); here s is folded into B.

Targets (sparrow module <- PEFT module):
- dense linears (``Linear``): q / k / v / o, gate / up / down of dense MLPs and of shared experts; a packed
  sparrow linear (``qkv_proj``, ``gate_up_proj``) takes its shards' factors side by side: A = [A_q; A_k; A_v]
  [r_q + r_k + r_v, K], B block-diagonal [N, r_q + r_k + r_v];
- the router (``Router``, HF ``mlp.gate``: PEFT ``target_parameters`` on ``mlp.gate.weight``): a delta on the
  logits, A [r, H], B [E, r];
- routed experts (``FusedMoE``): PEFT ``target_parameters`` on the fused 3-D ``experts.gate_up_proj`` [E, 2I, H] /
  ``experts.down_proj`` [E, H, I] (PEFT's ParamWrapper: lora_A [E r, in] with expert e's rows e r .. e r + r - 1,
  lora_B [out, r E] with expert e's rank j in column j E + e; which parameter a wrapper adapts is told by its
  shapes, as nested wrappers of one module are saved as ``experts.lora_A`` / ``experts.base_layer.lora_A``), or
  per-expert modules ``experts.N.gate_proj`` / ``up_proj`` / ``down_proj`` (Mixtral ``w1`` / ``w3`` / ``w2``),
  gate and up side by side as for a packed linear.
Per target the result is (A [.., R, K], B [.., N, R]) with s folded into B, a leading expert dim for experts: built in
fp32, then rounded once to the dtype asked for (the slot buffers' dtype: a slot filled from these holds the values a
copy of the fp32 factors into it would).
"""
from __future__ import annotations

import json
import math
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sparrow.errors import LoRAAdapterError, LoRAAdapterNotFoundError
from sparrow.lora.request import LoRARequest

_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.(lora_A|lora_B)\.weight$")
_BASE_LAYER = ".base_layer"
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)$")


@dataclass
class Adapter:
    """A loaded adapter: ``targets`` maps (sparrow module path, buffer name) to (A, B) CPU tensors in the slot
    buffers' dtype with the scaling folded into B (buffer names: ``weight`` for linears and routers,
    ``gate_up_proj`` / ``down_proj`` for experts); ``rank``: the adapter's largest per-module rank."""

    request: LoRARequest
    targets: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    rank: int = 0


def _read_config(folder: Path, name: str) -> dict:
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise LoRAAdapterNotFoundError(f"LoRA adapter {name!r}: {path} does not exist")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: cannot read {path}: {e}") from None
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {path} holds a JSON {type(cfg).__name__}, not an object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not supported "
                               "(only LORA)")
    unsupported = [("use_dora", "DoRA"), ("use_qalora", "QALoRA"), ("use_bdlora", "BD-LoRA"),
                   ("alora_invocation_tokens", "aLoRA"),
                   ("fan_in_fan_out", "fan_in_fan_out"), ("modules_to_save", "modules_to_save"),
                   ("lora_bias", "lora_bias"), ("trainable_token_indices", "trainable_token_indices")]
    for key, what in unsupported:
        if cfg.get(key):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {what} ({key}={cfg[key]!r}) is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAAdapterError(f"LoRA adapter {name!r}: bias={cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("layer_replication"):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: layer_replication is not supported")
    if not _is_number(cfg.get("lora_alpha", 8)):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: lora_alpha={cfg['lora_alpha']!r} in {path} is not a number")
    for key in ("alpha_pattern", "rank_pattern"):
        pattern = cfg.get(key) or {}
        if not isinstance(pattern, dict):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {key} in {path} is not an object")
        for module, value in pattern.items():
            try:
                re.compile(module)
            except re.error as e:
                raise LoRAAdapterError(f"LoRA adapter {name!r}: {key} key {module!r} in {path} is not a regular "
                                       f"expression ({e})") from None
            if not _is_number(value):
                raise LoRAAdapterError(f"LoRA adapter {name!r}: {key}[{module!r}]={value!r} in {path} is not a "
                                       "number")
    return cfg


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _alpha(cfg: dict, module: str) -> float:
    """lora_alpha of PEFT ``module`` (``alpha_pattern``'s first key matching the name's end, as PEFT; a module's
    name for target_modules, ``<module>.<parameter>`` for target_parameters: ``mlp.experts.gate_up_proj``,
    ``mlp.gate.weight``)."""
    for key, alpha in (cfg.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return float(alpha)
    return float(cfg.get("lora_alpha", 8))


def _scaling(cfg: dict, module: str, r: int) -> float:
    alpha = _alpha(cfg, module)
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def _side_by_side(parts: list[tuple[int, torch.Tensor, torch.Tensor]], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shards (first output row, A [r_i, K], B [n_i, r_i]) -> A [sum r_i, K], B [n, sum r_i] block-diagonal."""
    a = torch.cat([p[1] for p in parts])
    b = torch.zeros(n, a.shape[0])
    col = 0
    for row, _, bi in parts:
        b[row:row + bi.shape[0], col:col + bi.shape[1]] = bi
        col += bi.shape[1]
    return a, b


def load_adapter(request: LoRARequest, model: torch.nn.Module, max_lora_rank: int,
                 dtype: torch.dtype = torch.float32) -> Adapter:
    """Read ``request``'s folder and map it onto ``model`` (a sparrow CausalLM), the factors in ``dtype``. Raises
    LoRAAdapterNotFoundError when the folder does not exist or holds no adapter_config.json or weights file, and
    LoRAAdapterError for a malformed folder (an ``adapter_model.bin`` holding objects other than tensors among them),
    an unsupported PEFT feature (DoRA, biases, modules_to_save, ...), a tensor that is not a lora_A / lora_B weight or
    not a finite floating-point one, factors of rank 0, a rank over ``max_lora_rank``, or a target sparrow cannot
    adapt (naming it). Reads only ``model``'s structure: safe to call on a thread beside the one stepping it."""
    name, folder = request.lora_name, Path(request.lora_path)
    if not folder.is_dir():
        raise LoRAAdapterNotFoundError(f"LoRA adapter {name!r}: {folder} is not a folder")
    cfg = _read_config(folder, name)
    path, tensors = _read_tensors(folder, name)
    pairs, stray = _lora_pairs(tensors, name)
    mapper = _Mapper(name, cfg, model, max_lora_rank)
    for module, ab in sorted(pairs.items()):
        mapper.add(module, ab)
    adapter = Adapter(request)
    mapper.finish(adapter)
    if stray:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: tensor {stray[0]!r} is not supported (only lora_A / lora_B "
                               "weights: no DoRA magnitudes, biases, embeddings or saved modules)")
    if not adapter.targets:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {path} holds no LoRA weights")
    adapter.targets = {key: (a.to(dtype), b.to(dtype)) for key, (a, b) in adapter.targets.items()}
    return adapter


def _lora_pairs(tensors: dict[str, torch.Tensor], name: str) -> tuple[dict[str, dict[str, torch.Tensor]], list[str]]:
    """PEFT module -> {'lora_A': fp32 tensor, 'lora_B': ...}, and the keys that are no lora_A / lora_B weight (refused
    after the targets are mapped: a bad target names itself first). Raises LoRAAdapterError for a factor that is not
    a finite floating-point tensor."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    stray = []
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            stray.append(key)
            continue
        if not t.is_floating_point():
            raise LoRAAdapterError(f"LoRA adapter {name!r}: tensor {key!r} is {t.dtype}, not floating point")
        if not torch.isfinite(t).all():
            raise LoRAAdapterError(f"LoRA adapter {name!r}: tensor {key!r} holds NaN or infinite values")
        pairs.setdefault(m.group(1), {})[m.group(2)] = t.float()
    return pairs, stray


class _Mapper:
    """PEFT factor pairs -> sparrow targets, one module at a time (``add``), assembled by ``finish``: a packed linear's
    shards side by side, per-expert factors stacked [E, ...]. Scalings are folded into B as each pair is read."""

    def __init__(self, name: str, cfg: dict, model: torch.nn.Module, max_lora_rank: int):
        self.name, self.cfg, self.model, self.max_lora_rank = name, cfg, model, max_lora_rank
        self.targets: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.rank = 0
        self.linear_parts: dict[str, list] = {}
        """sparrow linear path -> [(first output row, A [r, K], B [n_i, r])] per shard."""
        self.expert_parts: dict[tuple[str, str], dict[int, list]] = {}
        """(FusedMoE path, stacked name) -> expert -> [(first output row, A, B)]."""

    def fail(self, module: str, why: str):
        raise LoRAAdapterError(f"LoRA adapter {self.name!r}: target module {module!r} {why}")

    def check_rank(self, module: str, r: int) -> None:
        if r > self.max_lora_rank:
            raise LoRAAdapterError(f"LoRA adapter {self.name!r}: rank {r} of {module!r} exceeds max_lora_rank="
                                   f"{self.max_lora_rank}")

    def add(self, module: str, ab: dict[str, torch.Tensor]) -> None:
        """Map PEFT ``module``'s lora_A / lora_B (``base_layer`` wrappers unwrapped) onto its sparrow module."""
        from sparrow.layers.linear import Linear
        from sparrow.layers.moe import FusedMoE
        from sparrow.layers.router import Router

        if set(ab) != {"lora_A", "lora_B"}:
            self.fail(module, "lacks its lora_A or lora_B weight")
        a, b = ab["lora_A"], ab["lora_B"]
        if a.dim() != 2 or b.dim() != 2:
            self.fail(module, f"has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}: both must be 2-D")
        if a.shape[0] == 0 or b.shape[1] == 0:
            self.fail(module, f"has rank 0 (lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)})")
        hf = module
        while hf.endswith(_BASE_LAYER):
            hf = hf[: -len(_BASE_LAYER)]
        resolved = self.model.resolve_weight(hf + ".weight")
        if resolved is None:
            self.fail(hf, "is not part of the text decoder")
        pname, shard = resolved
        mpath = pname.rpartition(".")[0]
        target = _submodule(self.model, mpath)
        if target is None:
            self.fail(hf, "does not exist in the model")
        if isinstance(target, Linear):
            self._linear(hf, mpath, target, shard, a, b)
        elif isinstance(target, Router):
            self._router(hf, mpath, target, a, b)
        elif isinstance(target, FusedMoE):
            self._experts(hf, mpath, target, a, b)
        else:
            self.fail(hf, f"is a {type(target).__name__}, which LoRA cannot adapt here (supported: dense linears, "
                          "the router mlp.gate, routed and shared experts)")

    def _linear(self, hf: str, mpath: str, target, shard: int | None, a: torch.Tensor, b: torch.Tensor) -> None:
        r = a.shape[0]
        self.check_rank(hf, r)
        n_i = target.full_output_sizes[shard or 0]  # the checkpoint's sizes (a parallel layer holds a share)
        k = target.in_features * (target.tp_size if target.parallel == "row" else 1)
        if tuple(a.shape) != (r, k) or tuple(b.shape) != (n_i, r):
            self.fail(hf, f"has lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}, expected "
                          f"({r}, {k}) / ({n_i}, {r})")
        if target.parallel == "column":  # this rank's rows of B: the delta of its output rows
            start, size = target.shard_ranges[shard or 0]
            b = b[start:start + size]
        elif target.parallel == "row":  # this rank's columns of A: a partial delta, summed with the output's
            a = a[:, target.tp_rank * target.in_features:(target.tp_rank + 1) * target.in_features]
        row = sum(target.output_sizes[: shard or 0])
        self.linear_parts.setdefault(mpath, []).append((row, a, b * _scaling(self.cfg, hf, r)))

    def _router(self, hf: str, mpath: str, target, a: torch.Tensor, b: torch.Tensor) -> None:
        r = a.shape[0]
        self.check_rank(hf, r)
        if tuple(a.shape) != (r, target.hidden_size) or tuple(b.shape) != (target.num_experts, r):
            self.fail(hf, f"(router) has lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}, expected "
                          f"({r}, {target.hidden_size}) / ({target.num_experts}, {r})")
        self.targets[mpath, "weight"] = (a, b * _scaling(self.cfg, hf + ".weight", r))
        self.rank = max(self.rank, r)

    def _experts(self, hf: str, mpath: str, target, a: torch.Tensor, b: torch.Tensor) -> None:
        from sparrow.models.base import EXPERT_TENSORS

        part = target.shards  # this rank's experts / width (sparrow.layers.moe_parallel); factors are cut to it
        e, h, i = part.global_experts, target.hidden_size, part.global_width
        per_expert = _PER_EXPERT.match(hf)
        if per_expert is not None and per_expert.group(3) in EXPERT_TENSORS:  # experts.N.gate_proj: one expert's
            stacked, block = EXPERT_TENSORS[per_expert.group(3)]
            r, expert = a.shape[0], int(per_expert.group(2))
            self.check_rank(hf, r)
            k, n_i = (h, i) if stacked == "gate_up_proj" else (i, h)
            if expert >= e or tuple(a.shape) != (r, k) or tuple(b.shape) != (n_i, r):
                self.fail(hf, f"has lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}, expected ({r}, {k}) / "
                              f"({n_i}, {r}) for one of {e} experts")
            expert -= part.expert_start
            if not 0 <= expert < target.num_experts:
                return  # another rank's expert
            if part.mode == "tp" and stacked == "gate_up_proj":
                b = b[part.width_start:part.width_start + target.intermediate_size]
            elif part.mode == "tp":
                a = a[:, part.width_start:part.width_start + target.intermediate_size]
            self.expert_parts.setdefault((mpath, stacked), {}).setdefault(expert, []).append(
                (block * target.intermediate_size, a, b * _scaling(self.cfg, hf, r)))
            return
        # fused 3-D parameter (PEFT target_parameters): which one, by the factors' shapes
        stacked = {(h, 2 * i): "gate_up_proj", (i, h): "down_proj"}.get((a.shape[1], b.shape[0]))
        if stacked is None or a.shape[0] % e or b.shape[1] != a.shape[0]:
            self.fail(hf, f"(experts) has lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}, which fit neither "
                          f"gate_up_proj ({e} experts x [{2 * i}, {h}]) nor down_proj ({e} x [{h}, {i}])")
        r = a.shape[0] // e
        self.check_rank(f"{hf}.{stacked}", r)
        a3 = a.reshape(e, r, a.shape[1])  # [E, r, in]
        b3 = b.reshape(b.shape[0], r, e).permute(2, 0, 1).contiguous()  # [E, out, r]
        a3, b3 = a3[part.expert_start:part.expert_start + target.num_experts], \
            b3[part.expert_start:part.expert_start + target.num_experts]
        if part.mode == "tp":
            cut = slice(part.width_start, part.width_start + target.intermediate_size)
            if stacked == "gate_up_proj":  # the gate's and the up's rows of this rank's width
                b3 = torch.cat([half[:, cut] for half in b3.chunk(2, dim=1)], dim=1).contiguous()
            else:
                a3 = a3[:, :, cut].contiguous()
        self.targets[mpath, stacked] = (a3, b3 * _scaling(self.cfg, f"{hf}.{stacked}", r))
        self.rank = max(self.rank, r)

    def finish(self, adapter: Adapter) -> None:
        """Assemble the packed linears and the per-expert factors; put every target and the rank into ``adapter``."""
        for mpath, parts in self.linear_parts.items():
            target = self.model.get_submodule(mpath)
            self.targets[mpath, "weight"] = _side_by_side(sorted(parts, key=lambda p: p[0]), target.out_features)
            self.rank = max(self.rank, max(p[1].shape[0] for p in parts))
        for (mpath, stacked), experts in self.expert_parts.items():
            target = self.model.get_submodule(mpath)
            n = 2 * target.intermediate_size if stacked == "gate_up_proj" else target.hidden_size
            k = target.hidden_size if stacked == "gate_up_proj" else target.intermediate_size
            built = {ex: _side_by_side(sorted(p, key=lambda q: q[0]), n) for ex, p in experts.items()}
            width = max(a.shape[0] for a, _ in built.values())
            a3 = torch.zeros(target.num_experts, width, k)
            b3 = torch.zeros(target.num_experts, n, width)
            for ex, (a, b) in built.items():
                a3[ex, : a.shape[0]], b3[ex, :, : b.shape[1]] = a, b
            self.targets[mpath, stacked] = (a3, b3)
            self.rank = max(self.rank, max(p[1].shape[0] for ps in experts.values() for p in ps))
        adapter.targets, adapter.rank = self.targets, self.rank


def _read_tensors(folder: Path, name: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """The adapter's state dict and the file it came from: ``adapter_model.safetensors``, else ``adapter_model.bin``
    read with ``torch.load(weights_only=True)`` (tensors and plain containers only: a pickle of any other object is
    refused, never run). Raises LoRAAdapterError naming the file when neither exists or the file cannot be read."""
    from safetensors.torch import load_file

    path = folder / "adapter_model.safetensors"
    if path.is_file():
        try:
            return path, load_file(str(path))
        except Exception as e:  # a truncated or foreign file
            raise LoRAAdapterError(f"LoRA adapter {name!r}: cannot read {path}: {_one_line(str(e))}") from None
    path = folder / "adapter_model.bin"
    if not path.is_file():
        raise LoRAAdapterNotFoundError(f"LoRA adapter {name!r}: {folder} holds neither adapter_model.safetensors "
                                       "nor adapter_model.bin")
    try:
        tensors = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # an object weights_only does not allow, or not a pickle at all
        text = str(e)
        detail = text.partition(_UNPICKLER)[2] or text
        detail = _one_line(detail).split(" Please use ")[0].split(" Check the documentation")[0]
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {path} is refused: torch.load(weights_only=True) reads "
                               f"tensors only ({detail.rstrip('.')})") from None
    except Exception as e:  # a truncated zip, an empty file
        raise LoRAAdapterError(f"LoRA adapter {name!r}: cannot read {path}: {_one_line(str(e))}") from None
    if not isinstance(tensors, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                for k, v in tensors.items()):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {path} holds a {type(tensors).__name__} that is not a state "
                               "dict (names -> tensors)")
    return path, tensors


_UNPICKLER = "WeightsUnpickler error:"
"""Where torch's weights_only error names what it refused (the text before it tells how to load unsafely)."""


def _one_line(text: str) -> str:
    return " ".join(re.sub(r"\x1b\[[0-9;]*m", "", text).split())


def _submodule(model: torch.nn.Module, path: str):
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None
