"""What the kernel families share: the Triton helpers every family calls (``_pdl_jit``: the PDL prologue;
``_fp8_jit``: e4m3 rounding, activation quantization and the interpreter's dot / bf16 workarounds;
``_split_k_jit``: split-K with an in-kernel reduce), the split-K workspace (``split_k``) and the tile-config
helpers (``tiles``: where the tuned config files live, the FMA row counts, power-of-two and ceil-div)."""
