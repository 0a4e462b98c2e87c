"""RMSNorm and its fusions (``norm``), and RoPE fused with the per-head norms and the KV write (``rope``)."""
