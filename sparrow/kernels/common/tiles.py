"""Tile-config helpers shared by the kernel families (tile configs are data).

``CONFIG_DIR`` holds the tuned config files (``moe_configs.config_file``, ``int4.config_file``); ``FMA_ROWS`` the
row counts of one 4-bit FMA GEMV program, read by the dense and the routed 4-bit kernels alike.
"""
from __future__ import annotations

import pathlib

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"
"""sparrow/kernels/configs: the tuned tile files, shipped as package data (pyproject.toml)."""

FMA_ROWS = (1, 2, 4)
"""Rows one FMA program computes (``int4.Int4Config.fma``'s block_m, ``Tile.fma_rows``): one accumulator
each (``_w4_fma_jit.FMA_MAX_ROWS``, their largest, is the kernels' limit). Here, in a module without Triton
bodies, so that the launchers and the Triton modules read it without an import cycle."""


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton block sizes."""
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints: tiles and grid sizes."""
    return -(-a // b)
