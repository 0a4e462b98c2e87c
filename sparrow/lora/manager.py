"""The adapter slots: ``max_loras`` device slots per adaptable module, filled on demand, LRU eviction.

At start every adaptable module of the decoder (``model.model``; not the LM head) gets its slot buffers
(``LoRABuffers``, zeros) as its ``lora`` attribute, so CUDA graphs captured then read them: dense ``Linear`` layers
(attention, dense MLPs, shared experts), ``Router`` (the ``mlp.gate`` logits) and ``FusedMoE`` (``ExpertLoRA``:
gate_up_proj and down_proj per expert). Adapters are read and checked when a request names them (``load``, cached
on the host by lora_int_id) and copied into a slot when a step needs them (``assign``): a free slot, else the least
recently used one whose adapter the step does not run. The scheduler never runs more distinct adapters in a step
than there are slots.
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict

import torch

from sparrow.lora.adapter import Adapter, load_adapter
from sparrow.lora.request import LoRARequest
from sparrow.lora.weights import ExpertLoRA, LoRABuffers

log = logging.getLogger(__name__)


class LoRAManager:
    """Slots of ``max_loras`` adapters of rank <= ``max_lora_rank`` for ``model`` (buffers in ``dtype`` on
    ``device``)."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_lora_rank: int, dtype: torch.dtype,
                 device: torch.device):
        from sparrow.layers.linear import Linear
        from sparrow.layers.moe import FusedMoE
        from sparrow.layers.router import Router

        self.model, self.max_loras, self.max_lora_rank, self.dtype = model, max_loras, max_lora_rank, dtype
        self.buffers: dict[tuple[str, str], LoRABuffers] = {}
        r, s = max_lora_rank, max_loras
        # the decoder's modules: the LM head (a Linear with quantize_lm_head) is not adaptable
        for path, m in model.model.named_modules(prefix="model"):
            if isinstance(m, Linear):
                buf = LoRABuffers(s, 1, r * len(m.output_sizes), m.in_features, m.out_features, dtype, device,
                                  m.output_sizes)
                self.buffers[path, "weight"] = m.lora = buf
            elif isinstance(m, Router):
                self.buffers[path, "weight"] = m.lora = LoRABuffers(s, 1, r, m.hidden_size, m.num_experts, dtype,
                                                                    device)
            elif isinstance(m, FusedMoE):
                e, h, i = m.num_experts, m.hidden_size, m.intermediate_size
                gate_up = LoRABuffers(s, e, 2 * r, h, 2 * i, dtype, device, (i, i))
                down = LoRABuffers(s, e, r, i, h, dtype, device)
                self.buffers[path, "gate_up_proj"], self.buffers[path, "down_proj"] = gate_up, down
                m.lora = ExpertLoRA(gate_up, down)
        self.adapters: dict[int, Adapter] = {}
        self.folders: dict[int, str] = {}
        """lora_int_id -> the real path of its folder when it was loaded."""
        self.slots: OrderedDict[int, int] = OrderedDict()
        """lora_int_id -> slot, least recently used first."""
        log.info("LoRA: %d slots of rank %d, %.1f MiB of buffers", max_loras, max_lora_rank,
                 sum(b.nbytes for b in self.buffers.values()) / 2**20)

    def load(self, request: LoRARequest) -> Adapter:
        """The adapter of ``request``, read and checked once per lora_int_id (LoRAAdapterError when it cannot be
        used; a folder already loaded under another id shares its host copy). Folders are compared as real paths
        (``os.path.realpath`` when first seen: a trailing slash, a relative path or a link name the same folder).
        An id seen before with another folder is an error too. Host copies (in the buffers' dtype) stay for every
        adapter seen."""
        from sparrow.errors import LoRAAdapterError

        folder = os.path.realpath(request.lora_path)
        known = self.adapters.get(request.lora_int_id)
        if known is not None:
            if self.folders[request.lora_int_id] != folder:
                raise LoRAAdapterError(f"lora_int_id {request.lora_int_id} is already the adapter at "
                                       f"{known.request.lora_path!r}, not {request.lora_path!r}")
            return known
        same = next((lid for lid, f in self.folders.items() if f == folder), None)
        if same is not None:  # the folder is loaded under another id: share its factors
            adapter = Adapter(request, self.adapters[same].targets, self.adapters[same].rank)
        else:
            adapter = load_adapter(request, self.model, self.max_lora_rank, self.dtype)
            for key, (a, b) in adapter.targets.items():
                buf = self.buffers.get(key)
                if buf is None or a.shape[-2] > buf.width:
                    raise LoRAAdapterError(f"LoRA adapter {request.lora_name!r}: {key[0]}.{key[1]} cannot take its "
                                           f"factors {tuple(a.shape)}")
        self.adapters[request.lora_int_id] = adapter
        self.folders[request.lora_int_id] = folder
        return adapter

    def assign(self, lora_ids: set[int]) -> dict[int, int]:
        """Slots for the adapters ``lora_ids`` of a step (each loaded before): those in a slot stay, the others
        take free slots or evict the least recently used adapters not in ``lora_ids``. Returns
        lora_int_id -> slot. Raises ValueError for more ids than slots (the scheduler prevents it)."""
        if len(lora_ids) > self.max_loras:
            raise ValueError(f"a step runs {len(lora_ids)} adapters, more than max_loras={self.max_loras}")
        for lid in lora_ids:
            if lid in self.slots:
                self.slots.move_to_end(lid)
        for lid in lora_ids:
            if lid in self.slots:
                continue
            used = set(self.slots.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(v for v in self.slots if v not in lora_ids)
                slot = self.slots.pop(victim)
            self._write(slot, self.adapters[lid])
            self.slots[lid] = slot
        return {lid: self.slots[lid] for lid in lora_ids}

    def _write(self, slot: int, adapter: Adapter) -> None:
        log.info("LoRA: adapter %r (id %d) -> slot %d", adapter.request.lora_name, adapter.request.lora_int_id, slot)
        for key, buf in self.buffers.items():
            buf.write(slot, adapter.targets.get(key))
