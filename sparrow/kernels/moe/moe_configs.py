"""Tile configs of the fused MoE kernels, as data.

Shapes: R = rows, E = experts, H = hidden, I = expert width, P = R * K pairs.

A ``MoeConfig`` holds BLOCK_M (sorted pairs per program of the grouped path, also the alignment padding;
the small-batch path ignores it) and one ``Tile`` per GEMM (gate|up, down). ``pick_config`` returns, in
order: the config forced by ``forced_config`` (tests, tuning); the entry with the nearest row count in
``configs/E{E}_H{H}_I{I}_{kind}_{device}.json`` (kind = the element type of the expert weights the kernels
stream: ``bf16`` for float weights, ``fp8`` for e4m3, ``int4`` / ``nvfp4`` for the 4-bit kernels of
``int4_moe`` (their own files and ``default_w4_config``); device = ``torch.cuda.get_device_name()`` with spaces as underscores), written by
``benchmarks/moe_layer.py --tune``; else ``default_config``.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

from sparrow.kernels import ForcedConfig
from sparrow.kernels.common.tiles import CONFIG_DIR


@dataclasses.dataclass(frozen=True)
class Tile:
    block_n: int
    """Output columns per program (power of two, >= 16)."""
    block_k: int
    """Reduction elements per loop step (power of two, >= 16); FP8 weights need a multiple of 128."""
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    """Small path only: programs per (pair, N tile) over contiguous K ranges, reduced in the kernel; 0:
    automatic (``split_k.choose_split``). The grouped path ignores it."""
    swap_ab: bool = False
    """Each dot is weight tile [block_n, K step] @ rows^T, so the weight fills the MMA's M side (Hopper wgmma
    needs M >= 64: block_n >= 64) and the few rows (or block_m sorted pairs) its N side. With e4m3 weights
    this keeps the dot on e4m3 wgmma; Triton lowers a 16-row e4m3 dot to f16 mma.sync after converting both
    operands."""
    fma_rows: int = 0
    """4-bit weights (``int4_moe``), small path: 0 - dots (rows padded to 16); n (a power of two) - no dots, each
    expert's pairs n at a time as fp32 FMAs on the decoded weights (``_w4_fma_jit._w4_fma_rows``; an expert with
    more pairs reads its weights again for each n; int4 steps of at most one group: block_k is cut to it). Other
    kernels and the grouped path ignore it."""
    a_fp8: bool = False
    """FP8 weights, grouped path: the GEMM's activations (x, the intermediate) are quantized per 128-column
    group by a launch of their own before it, so the kernel loads e4m3 rows and their scales instead of
    quantizing the same rows again in each of its N tiles (pays at prefill sizes). Same numbers either way;
    the small path and bf16 weights ignore it."""


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    block_m: int
    """Sorted pairs per program on the grouped path and the per-expert padding (power of two, >= 16)."""
    gate_up: Tile
    down: Tile

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "MoeConfig":
        return cls(int(d["block_m"]), Tile(**d["gate_up"]), Tile(**d["down"]))


forced_config = ForcedConfig()  # ``with forced_config(MoeConfig(...)):`` overrides the heuristic



def default_config(rows: int, pairs: int, num_experts: int, small: bool, fp8: bool) -> MoeConfig:
    """Heuristic: small path - GEMV-like tiles (narrow N, long K); grouped path - BLOCK_M from the mean
    pairs per expert (padding waste vs weight reuse). FP8 grouped: the tiles ``moe_layer.py --tune`` chose at
    Gemma 4's shape on the H200 (E 128, H 2816, I 704; the only shape measured): swapped dots (K steps of one
    128-wide scale block), BLOCK_M 16 up to 16 pairs an expert, else 32, and from 64 pairs an expert the
    activations quantized by their own launch (``a_fp8``, faster at 1,024-8,192 rows; plain 128 x 128 tiles with
    BLOCK_M 64 are far slower there)."""
    if small:
        tile = Tile(block_n=32, block_k=256, num_warps=4, num_stages=3)
        return MoeConfig(16, tile, tile)
    per_expert = pairs / max(num_experts, 1)
    if fp8:
        if per_expert <= 16:
            return MoeConfig(16, Tile(128, 128, swap_ab=True), Tile(64, 128, swap_ab=True))
        a_fp8 = per_expert >= 64
        return MoeConfig(32, Tile(64, 128, swap_ab=True, a_fp8=a_fp8), Tile(128, 128, swap_ab=True, a_fp8=a_fp8))
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64
    tile = Tile(block_n=128 if block_m >= 64 else 64, block_k=64, num_warps=4, num_stages=4)
    return MoeConfig(block_m, tile, tile)


def default_w4_config(rows: int, pairs: int, num_experts: int, small: bool) -> MoeConfig:
    """Heuristic of the 4-bit expert kernels (``int4_moe``; tuned files, which ``moe_layer.py --dtypes
    int4 nvfp4 --tune`` writes, take precedence), from the sm_90 SASS of their loops (no spills, wgmma): small path -
    swapped 64 x 128 tiles with automatic split-K (gemma4's shape at one row: 8 experts x 11 gate|up tiles x 4
    splits = 352 programs, 8 x 44 down tiles); grouped path - BLOCK_M from the mean pairs per expert as for
    float weights, swapped 64-wide tiles up to 32 pairs a block, else 128 x 64 tiles on 8 warps, the scales on
    the weight tiles."""
    if small:
        tile = Tile(block_n=64, block_k=128, num_warps=4, num_stages=3, split_k=0, swap_ab=True)
        return MoeConfig(16, tile, tile)
    per_expert = pairs / max(num_experts, 1)
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64
    if block_m >= 64:
        tile = Tile(block_n=128, block_k=64, num_warps=8, num_stages=3)
    else:
        tile = Tile(block_n=64, block_k=128, num_warps=4, num_stages=3, swap_ab=True)
    return MoeConfig(block_m, tile, tile)


def config_file(num_experts: int, hidden: int, width: int, fp8: bool, device_name: str,
                kind: str | None = None) -> pathlib.Path:
    """The tuned-config data file of this shape, expert-weight kind (``fp8``: e4m3; ``kind`` names another:
    "int4", "nvfp4") and device."""
    kind = kind or ("fp8" if fp8 else "bf16")  # the kernels' expert-weight element type (float weights: bf16)
    return CONFIG_DIR / f"E{num_experts}_H{hidden}_I{width}_{kind}_{device_name.replace(' ', '_')}.json"


@functools.lru_cache(maxsize=64)
def _load(path: pathlib.Path) -> dict[int, MoeConfig]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return {int(rows): MoeConfig.from_json(c) for rows, c in data["configs"].items()}


def tuned_configs(num_experts: int, hidden: int, width: int, fp8: bool, device_name: str,
                  kind: str | None = None) -> dict[int, MoeConfig]:
    """Row count -> config from the data file of this shape and device ({} when there is none)."""
    return _load(config_file(num_experts, hidden, width, fp8, device_name, kind))


def pick_config(rows: int, top_k: int, num_experts: int, hidden: int, width: int, small: bool, fp8: bool,
                device_name: str | None, kind: str | None = None) -> MoeConfig:
    """The forced config, else the tuned entry of the nearest row count, else ``default_config`` (``kind``
    "int4" / "nvfp4": ``default_w4_config``). A tuned entry is used on either path (its block_m only matters on
    the grouped one), except an entry of FMA tiles (``Tile.fma_rows``, swept on the small path): the grouped
    path, which has no FMA mode, skips it (its default tiles ran gemma4's int4 layer at 64 rows faster than a
    1-row FMA entry's tiles)."""
    if forced_config.value is not None:
        return forced_config.value
    if device_name is not None:
        table = tuned_configs(num_experts, hidden, width, fp8, device_name, kind)
        if not small:
            table = {r: c for r, c in table.items() if not (c.gate_up.fma_rows or c.down.fma_rows)}
        if table:
            return table[min(table, key=lambda r: (abs(r - rows), r))]
    if kind in ("int4", "nvfp4"):
        return default_w4_config(rows, rows * top_k, num_experts, small)
    return default_config(rows, rows * top_k, num_experts, small, fp8)
