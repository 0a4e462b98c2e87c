"""Attention kernels: paged split-K decode and varlen tiled prefill (``attention``), the torch twins and the
KV-pool write (``paged_attention``)."""
