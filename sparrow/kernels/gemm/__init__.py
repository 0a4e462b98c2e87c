"""Linear layers' kernels, one module per weight format: FP8 block-scaled (``fp8`` references, ``fp8_gemm``,
``scaled_mm`` and its activation quantizer, ``gemv`` for few rows), int4 W4A16 (``int4``) and NVFP4
(``nvfp4`` references, ``nvfp4_linear``). The 4-bit Triton bodies also serve the routed 4-bit experts in
``kernels.moe``."""
