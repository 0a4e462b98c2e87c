"""Mixture-of-Experts kernels: the router (``router``), the pair sort (``moe_align``), the fused experts on float
and FP8 weights (``moe``, twins in ``moe_ref``) and on 4-bit weights (``int4_moe``, ``nvfp4_moe``), the weighted
reduce (``moe_reduce``) and their tile configs (``moe_configs``). Triton bodies: ``_moe_jit`` (the experts' GEMMs,
their shared small- and grouped-path helpers, the reduce), ``_w4_moe_jit`` (4-bit experts), ``_align_jit`` (the
sort), ``_router_jit``."""
