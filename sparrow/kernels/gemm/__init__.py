"""Linear layers' kernels, one module per weight format: FP8 block-scaled (``fp8`` references, ``fp8_gemm``,
``scaled_mm`` and its activation quantizer ``_quant_jit``, ``gemv`` for few rows), int4 W4A16 (``int4``) and NVFP4
(``nvfp4`` references, ``nvfp4_linear``). The 4-bit Triton bodies: ``_w4_jit`` (the decoders and dot steps),
``_w4_fma_jit`` (the FMA GEMV rows) and ``_int4_jit`` (the dense linear and dequantize kernels); the routed 4-bit
experts in ``kernels.moe`` use the first two."""
