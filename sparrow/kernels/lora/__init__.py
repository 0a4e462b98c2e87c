"""Multi-adapter LoRA shrink / expand kernels, per row (``lora``)."""
