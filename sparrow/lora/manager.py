"""The adapters' memory: ``max_loras`` device slots per adaptable module and a host cache of ``max_cpu_loras``
adapters, both filled on demand, least recently used evicted.

At start every adaptable module of the decoder (``model.model``; not the LM head) gets its slot buffers
(``LoRABuffers``, zeros) as its ``lora`` attribute, so CUDA graphs captured then read them: dense ``Linear`` layers
(attention, dense MLPs, shared experts), ``Router`` (the ``mlp.gate`` logits) and ``FusedMoE`` (``ExpertLoRA``:
gate_up_proj and down_proj per expert). Adapters are read and checked when a request names them (``load``) and kept
on the host in the buffers' dtype, keyed by lora_int_id, and copied into a slot when a step needs them (``assign``):
a free slot, else the least recently used one whose adapter the step does not run. The scheduler never runs more
distinct adapters in a step than there are slots.

Host cache (vLLM's ``max_cpu_loras``, counted per lora_int_id; ids of one folder share one copy): an adapter read in
drops the least recently used (loaded or run by a step) host copies that no slot holds, until ``max_cpu_loras``
remain. A dropped adapter is read again from its folder (the real path its id was first seen with) when a request
names it or a step needs it; when that fails (the folder was removed or no longer holds a usable adapter) ``assign``
returns its LoRAAdapterError and gives it no slot. The cache holds at most ``max_cpu_loras`` adapters, with one
exception: with ``max_cpu_loras == max_loras``, an adapter read in while every other cached one sits in a slot is kept
for the step that will run it (dropping it would read it twice), so the cache holds up to ``max_loras + 1``.
``assign`` puts the step's cached adapters into slots before it reads any, and reads each in with the slot it takes
already given up, so a step never adds to that.

At run time (the server's /v1/load_lora_adapter) an adapter is ``read`` on another thread and ``install``-ed into the
host cache between steps; ``remove`` forgets an id and clears its slot once no request runs it.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from collections import OrderedDict

import torch

from sparrow.errors import LoRAAdapterError
from sparrow.layers.lora_buffers import ExpertLoRA, LoRABuffers
from sparrow.lora.adapter import Adapter, load_adapter
from sparrow.lora.request import LoRARequest

log = logging.getLogger(__name__)


class LoRAManager:
    """Slots of ``max_loras`` adapters of rank <= ``max_lora_rank`` for ``model`` (buffers in ``dtype`` on
    ``device``) and a host cache of ``max_cpu_loras`` adapters (None: max_loras; at least max_loras, as
    ``LoRAConfig`` checks)."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_lora_rank: int, dtype: torch.dtype,
                 device: torch.device, max_cpu_loras: int | None = None):
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
        self.max_cpu_loras = max_cpu_loras if max_cpu_loras is not None else max_loras
        self.adapters: OrderedDict[int, Adapter] = OrderedDict()
        """The host cache: lora_int_id -> its adapter, least recently used first."""
        self.folders: dict[int, str] = {}
        """lora_int_id -> the real path of its folder when it was first read (every id seen, cached or not)."""
        self.slots: OrderedDict[int, int] = OrderedDict()
        """lora_int_id -> slot, least recently used first."""
        self.slot_writes: list[tuple[int, LoRARequest | None]] | None = None
        """None, or on rank 0 of a tensor-parallel group (the model runner sets a list): (slot, the LoRARequest
        written there or None: cleared) in order since the runner last took them; it sends them with the next step
        and the other ranks ``replay_slot_writes`` them (each reads the adapter for its own model)."""
        log.info("LoRA: %d slots of rank %d, %.1f MiB of buffers; host cache of %d adapters", max_loras,
                 max_lora_rank, sum(b.nbytes for b in self.buffers.values()) / 2**20, self.max_cpu_loras)

    def load(self, request: LoRARequest) -> Adapter:
        """The adapter of ``request``: its host copy, read and checked when the id is new or its copy was dropped
        (LoRAAdapterError when it cannot be used; a folder cached under another id shares that copy). Folders are
        compared as real paths (``os.path.realpath`` when first seen: a trailing slash, a relative path or a link
        name the same folder). An id seen before with another folder is an error too."""
        folder = os.path.realpath(request.lora_path)
        known = self.folders.get(request.lora_int_id)
        if known is not None and known != folder:
            raise LoRAAdapterError(f"lora_int_id {request.lora_int_id} is already the adapter at {known!r}, not "
                                   f"{request.lora_path!r}")
        return self._host_copy(request, folder, keep=set(self.slots))

    def _host_copy(self, request: LoRARequest, folder: str, keep: set[int]) -> Adapter:
        """The cached copy of ``request``'s adapter (now the most recently used), else one shared with another id of
        ``folder`` or read from ``request.lora_path``; a new entry drops least recently used copies not in
        ``keep`` (nor itself) while more than max_cpu_loras are cached."""
        lid = request.lora_int_id
        adapter = self.adapters.get(lid)
        if adapter is not None:
            self.adapters.move_to_end(lid)
            return adapter
        same = next((other for other in self.adapters if self.folders[other] == folder), None)
        if same is not None:  # the folder is cached under another id: share its factors
            adapter = Adapter(request, self.adapters[same].targets, self.adapters[same].rank)
        else:
            adapter = self.read(request)
        self._cache(adapter, folder, keep)
        return adapter

    def read(self, request: LoRARequest) -> Adapter:
        """``request``'s adapter read from its folder and checked against the slot buffers, not cached (``install``
        caches it). LoRAAdapterError (LoRAAdapterNotFoundError: no adapter there) when it cannot be used. Touches no
        state of the manager: safe on a thread beside the engine's (the server reads runtime-loaded adapters so)."""
        adapter = load_adapter(request, self.model, self.max_lora_rank, self.dtype)
        for key, (a, b) in adapter.targets.items():
            buf = self.buffers.get(key)
            if buf is None or a.shape[-2] > buf.width:
                raise LoRAAdapterError(f"LoRA adapter {request.lora_name!r}: {key[0]}.{key[1]} cannot take its "
                                       f"factors {tuple(a.shape)}")
        return adapter

    def install(self, adapter: Adapter) -> None:
        """Cache ``adapter`` (from ``read``) under its lora_int_id, as ``load`` would have; call between steps. Raises
        LoRAAdapterError for an id already in use."""
        lid = adapter.request.lora_int_id
        if lid in self.folders:
            raise LoRAAdapterError(f"lora_int_id {lid} is already the adapter at {self.folders[lid]!r}")
        self._cache(adapter, os.path.realpath(adapter.request.lora_path), keep=set(self.slots))

    def remove(self, lora_int_id: int) -> bool:
        """Forget adapter ``lora_int_id``: its host copy, its folder and its slot (cleared: free for another adapter).
        Call between steps, when no request runs it (a later request naming the id reads its folder again). Returns
        whether the id was known."""
        known = self.folders.pop(lora_int_id, None) is not None
        self.adapters.pop(lora_int_id, None)
        slot = self.slots.pop(lora_int_id, None)
        if slot is not None:
            for buf in self.buffers.values():
                buf.write(slot, None)
            if self.slot_writes is not None:
                self.slot_writes.append((slot, None))
            log.info("LoRA: adapter id %d removed, slot %d free", lora_int_id, slot)
        return known

    def _cache(self, adapter: Adapter, folder: str, keep: set[int]) -> None:
        lid = adapter.request.lora_int_id
        self.adapters[lid] = adapter
        self.folders[lid] = folder
        for other in [o for o in self.adapters if o not in keep and o != lid]:
            if len(self.adapters) <= self.max_cpu_loras:
                break
            dropped = self.adapters.pop(other)
            log.info("LoRA: host copy of adapter %r (id %d) dropped (max_cpu_loras=%d)", dropped.request.lora_name,
                     other, self.max_cpu_loras)
        return adapter

    def assign(self, requests: dict[int, LoRARequest]) -> tuple[dict[int, int], dict[int, LoRAAdapterError]]:
        """Slots for the adapters of a step (lora_int_id -> its LoRARequest, each loaded before): those in a slot
        stay, the others take free slots or evict the least recently used adapters not in the step, the cached ones
        first. An adapter whose host copy was dropped is read again from its folder; one that cannot be read gets
        no slot. Returns (lora_int_id -> slot, lora_int_id -> its LoRAAdapterError). Raises ValueError for more
        adapters than slots (the scheduler prevents it)."""
        if len(requests) > self.max_loras:
            raise ValueError(f"a step runs {len(requests)} adapters, more than max_loras={self.max_loras}")
        for lid in requests:
            if lid in self.slots:
                self.slots.move_to_end(lid)
            if lid in self.adapters:
                self.adapters.move_to_end(lid)
        errors: dict[int, LoRAAdapterError] = {}
        for lid in sorted(set(requests) - set(self.slots), key=lambda i: i not in self.adapters):
            used = set(self.slots.values())
            free = [s for s in range(self.max_loras) if s not in used]
            victim = None if free else next(v for v in self.slots if v not in requests)
            folder = self.folders[lid]
            try:  # read in (if dropped) with the victim's slot given up: its host copy may go
                adapter = self._host_copy(dataclasses.replace(requests[lid], lora_path=folder), folder,
                                          keep=set(self.slots) - {victim})
            except LoRAAdapterError as e:
                errors[lid] = e
                continue
            slot = free[0] if free else self.slots.pop(victim)
            self._write(slot, adapter)
            self.slots[lid] = slot
        return {lid: self.slots[lid] for lid in requests if lid not in errors}, errors

    def _write(self, slot: int, adapter: Adapter) -> None:
        log.info("LoRA: adapter %r (id %d) -> slot %d", adapter.request.lora_name, adapter.request.lora_int_id, slot)
        for key, buf in self.buffers.items():
            buf.write(slot, adapter.targets.get(key))
        if self.slot_writes is not None:
            self.slot_writes.append((slot, adapter.request))

    def replay_slot_writes(self, writes: list[tuple[int, LoRARequest | None]]) -> None:
        """Make the slots what another rank's ``slot_writes`` made its own (a tensor-parallel worker, before it runs
        the step they came with): each adapter read through this manager's host cache (LoRAAdapterError when its
        folder cannot be read here), a None entry clears its slot."""
        for slot, request in writes:
            held = next((lid for lid, s in self.slots.items() if s == slot), None)
            if request is None:
                if held is not None:
                    self.remove(held)
                continue
            adapter = self.load(request)
            if held is not None:
                del self.slots[held]
            self._write(slot, adapter)
            self.slots[request.lora_int_id] = slot
