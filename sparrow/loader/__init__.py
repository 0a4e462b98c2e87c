"""Checkpoint readers (GGUF, safetensors) and the generic weight loader."""
