"""Weight formats: one module per format with its pack / unpack / dequantize torch reference (design.md 4)."""
