"""Multi-LoRA: PEFT adapters applied per row of a batch that mixes adapters and the base model.

- ``request``: LoRARequest (vLLM's name), the adapter a request runs with;
- ``adapter``: reading and validating a PEFT folder, its tensors mapped onto sparrow's modules;
- ``manager``: the slots (``max_loras``), loading on demand with LRU eviction, the per-row slot ids.
The per-module device buffers of every adapter slot and the delta each module adds are the layers'
(``sparrow.layers.lora_buffers``); the shrink / expand kernels are ``sparrow.kernels.lora.lora``.
"""
