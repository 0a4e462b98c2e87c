"""MoE align: sort the (row, expert) pairs by expert and pad each expert's segment to BLOCK_M (the
grouped path, the input of the grouped GEMMs of ``sparrow.kernels.moe.moe``).

Shapes: R = rows, K = top-k, E = experts, P = R * K pairs, BM = block_m, S = padded sorted length,
NB = S // BM. ``moe_align_ref`` is the torch twin, ``moe_align_triton`` the launcher (device-only, fixed-size
buffers, CUDA-graph safe), ``moe_align`` the dispatcher. Errors: ValueError naming the bad argument.
"""
from __future__ import annotations

import torch

from sparrow.kernels import dispatch
from sparrow.kernels.common.tiles import next_pow2


def align_sizes(pairs: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """(S, NB): worst-case padded length and block count for P pairs over E experts, BM-aligned.
    At most min(E, P) experts are non-empty, each padded by < BM: S = ceil((P + min(E, P)(BM-1)) / BM) BM."""
    nb = -(-(pairs + min(num_experts, pairs) * (block_m - 1)) // block_m)
    return nb * block_m, nb


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort pairs by expert and pad each expert's segment to a multiple of ``block_m``.

    topk_ids [R, K] int (each in [0, E)) -> (sorted_ids [S] int32: pair ids, stable within an expert,
    padding = P; block_expert [NB] int32: expert of each BM block, -1 past the padded total;
    total [1] int32: the padded total). S, NB from ``align_sizes``.
    """
    _check_align(topk_ids, num_experts, block_m)
    flat = topk_ids.reshape(-1).long()
    pairs = flat.numel()
    size, nblocks = align_sizes(pairs, num_experts, block_m)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    end = torch.cumsum(padded, 0)
    start = end - padded
    order = torch.argsort(flat, stable=True)
    first_sorted = torch.cumsum(counts, 0) - counts  # [E] sorted index of each expert's first pair
    e_sorted = flat[order]
    pos = start[e_sorted] + torch.arange(pairs, device=flat.device) - first_sorted[e_sorted]
    sorted_ids = torch.full((size,), pairs, dtype=torch.int32, device=flat.device)
    sorted_ids[pos] = order.to(torch.int32)
    total = padded.sum()
    block_pos = torch.arange(nblocks, device=flat.device) * block_m
    owner = torch.searchsorted(end, block_pos, right=True)
    block_expert = torch.where(block_pos < total, owner, -1).to(torch.int32)
    return sorted_ids, block_expert, total.reshape(1).to(torch.int32)


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton launcher of ``moe_align_ref`` (same contract): three launches, no host sync."""
    from sparrow.kernels.moe._align_jit import align_count_kernel, align_offsets_kernel, align_scatter_kernel

    _check_align(topk_ids, num_experts, block_m)
    flat = topk_ids.reshape(-1)
    pairs = flat.numel()
    dev = flat.device
    size, nblocks = align_sizes(pairs, num_experts, block_m)
    e_pad = next_pow2(num_experts)
    block_p = max(16, min(128, 8192 // e_pad))
    chunks = max(1, -(-pairs // block_p))
    counts = torch.empty(chunks, e_pad, dtype=torch.int32, device=dev)
    chunk_off = torch.empty_like(counts)
    rank = torch.empty(max(pairs, 1), dtype=torch.int32, device=dev)
    start = torch.empty(e_pad, dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(size, dtype=torch.int32, device=dev)
    block_expert = torch.empty(nblocks, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    warps = 8 if e_pad >= 256 else 4
    align_count_kernel[(chunks,)](flat, counts, rank, pairs, BLOCK_P=block_p, E_PAD=e_pad, num_warps=warps)
    align_offsets_kernel[(1,)](counts, chunk_off, start, sorted_ids, block_expert, total, chunks, pairs, size,
                               nblocks, BLOCK_M=block_m, E_PAD=e_pad, BLOCK_S=256, num_warps=warps)
    if pairs:
        align_scatter_kernel[(chunks,)](flat, rank, chunk_off, start, sorted_ids, pairs, BLOCK_P=block_p,
                                        E_PAD=e_pad, num_warps=warps)
    return sorted_ids, block_expert, total


moe_align = dispatch("moe_align", moe_align_triton, moe_align_ref,
                     """``moe_align_triton`` where ``use_triton(topk_ids)``, else ``moe_align_ref``.""")


def _check_align(topk_ids, num_experts, block_m) -> None:
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"moe_align: topk_ids must be int32 / int64, got {topk_ids.dtype}")
    if num_experts < 1 or block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"moe_align: need num_experts >= 1 and a power-of-two block_m, got {num_experts}, {block_m}")
