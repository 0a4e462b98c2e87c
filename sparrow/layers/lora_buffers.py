"""The adapter slots' device buffers of one module, and the delta that module adds for rows of many adapters
(multi-LoRA, ``sparrow.lora``: the manager fills these buffers; ``Linear``, ``Router`` and ``FusedMoE`` add the delta).

Shapes: R = rows of the step, K = in features, N = out features, S = slots (``max_loras``), W = rank width
(``max_lora_rank`` x the PEFT modules packed into the sparrow module: 3 for ``qkv_proj``, 2 for a dense
``gate_up_proj`` or per-expert gate + up), E = experts, Kt = top-k, P = R x Kt (row, expert) pairs.

A slot's factors are zero-padded to W (``ranks``: the width each slot uses) and carry the LoRA scaling in B.
Row r runs slot ``adapter_ids[r]`` (-1: the base model, no delta). Routed experts hold a weight set per
(slot, expert), numbered slot x E + expert: pair p (row p // Kt, expert topk_ids[p]) uses its row's slot.
"""
from __future__ import annotations

import torch

from sparrow.kernels.lora.lora import MAX_SEGMENTS, lora_delta, lora_index


class LoRABuffers:
    """Slot buffers of one weight: ``a`` [S E, W, K], ``b`` [S E, W, N] (rank-major; E = 1 for a linear or a
    router), ``ranks`` [S] int32, and per output segment (``out_sizes``: a packed projection's shard sizes, default
    one segment of N) ``seg_cols`` [S, G, 2] int32: the (first rank row, rank rows) of B a slot's segment uses.
    Raises ValueError for out_sizes not summing to n or more than ``MAX_SEGMENTS`` of them."""

    def __init__(self, slots: int, experts: int, width: int, k: int, n: int, dtype: torch.dtype,
                 device: torch.device, out_sizes: tuple[int, ...] | list[int] | None = None):
        self.experts, self.width = experts, width
        self.out_sizes = tuple(int(v) for v in out_sizes) if out_sizes else (n,)
        if sum(self.out_sizes) != n or len(self.out_sizes) > MAX_SEGMENTS:
            raise ValueError(f"LoRABuffers: out_sizes {self.out_sizes} must be at most {MAX_SEGMENTS} sizes "
                             f"summing to {n}")
        self.a = torch.zeros(slots * experts, width, k, dtype=dtype, device=device)
        self.b = torch.zeros(slots * experts, width, n, dtype=dtype, device=device)
        self.ranks = torch.zeros(slots, dtype=torch.int32, device=device)
        self.seg_cols = torch.zeros(slots, len(self.out_sizes), 2, dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes

    def write(self, slot: int, factors: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Put (A [(E,) r, K], B [(E,) N, r]) into ``slot`` (B transposed; zeros past r); None clears the slot.
        Each segment's rank rows: from its first to its last rank row holding a nonzero of B in the segment's
        outputs (a block-diagonal B of side-by-side shards: that shard's own rows), none if all zero."""
        e = self.experts
        a = self.a[slot * e:(slot + 1) * e]
        b = self.b[slot * e:(slot + 1) * e]
        a.zero_()
        b.zero_()
        r = 0
        cols = [(0, 0)] * len(self.out_sizes)
        if factors is not None:
            fa, fb = factors
            if e == 1:
                fa, fb = fa[None], fb[None]
            r = fa.shape[1]
            a[:, :r].copy_(fa)
            b[:, :r].copy_(fb.transpose(1, 2))
            lo = 0
            for g, size in enumerate(self.out_sizes):
                used = (b[:, :r, lo:lo + size] != 0).any(dim=2).any(dim=0).nonzero().flatten().tolist()
                if used:
                    cols[g] = (used[0], used[-1] + 1 - used[0])
                lo += size
        self.ranks[slot] = r
        self.seg_cols[slot] = torch.tensor(cols, dtype=torch.int32)

    def add(self, x: torch.Tensor, out: torch.Tensor, slots: torch.Tensor, **kw) -> torch.Tensor:
        """out[p] (+)= B[w(p)]^T @ (A[w(p)] @ x[..]) in place (``sparrow.kernels.lora.lora.lora_delta`` with the
        buffers' segments, whose keywords ``kw`` are); returns out."""
        return lora_delta(x, self.a, self.b, slots, self.ranks, out, out_sizes=self.out_sizes,
                          seg_cols=self.seg_cols, **kw)


def add_linear_delta(lora: LoRABuffers, x: torch.Tensor, y: torch.Tensor, adapter_ids: torch.Tensor) -> torch.Tensor:
    """y [R, N] (+)= each row's adapter delta of x [R, K]; returns y (a contiguous copy if y was not)."""
    if x.shape[0] != adapter_ids.shape[0]:
        raise ValueError(f"LoRA: {x.shape[0]} rows but {adapter_ids.shape[0]} adapter ids")
    y = y if y.is_contiguous() else y.contiguous()
    return lora.add(x.reshape(x.shape[0], -1), y, adapter_ids)


class ExpertDelta:
    """One step's expert deltas of a FusedMoE (``FusedMoE.lora`` bound to the step's rows): what the experts'
    paths add per (row, expert) pair before the weighted reduce, so the routing weight multiplies base + delta.
    Pair p (row p // Kt, expert topk_ids[p]) uses weight set adapter_ids[p // Kt] x E + topk_ids[p].

    gate_up(x [R, H]) -> [P, 2I] fp32 in pair order (gate columns first; zeros for rows without an adapter), added
    to gate_up_proj's output before the activation; down(a [P, I], y [P, H], order=None) adds the down_proj delta
    of the activations into y in place, rows in pair order or, with ``order`` [P] (the torch grouped path's
    sorted pairs), row j = pair order[j]."""

    def __init__(self, gate_up: LoRABuffers, down: LoRABuffers, adapter_ids: torch.Tensor, topk_ids: torch.Tensor):
        self.top_k, self.experts = topk_ids.shape[1], gate_up.experts
        self.slots, self.expert_ids = adapter_ids, topk_ids.reshape(-1)
        self.gate_up_buffers, self.down_buffers = gate_up, down

    def _pairs(self, x_div: int) -> dict:
        return dict(expert_ids=self.expert_ids, num_experts=self.experts, slot_div=self.top_k, x_div=x_div)

    def gate_up(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.expert_ids.numel(), self.gate_up_buffers.b.shape[2], dtype=torch.float32,
                          device=x.device)
        return self.gate_up_buffers.add(x, out, self.slots, accumulate=False, **self._pairs(self.top_k))

    def down(self, a: torch.Tensor, y: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
        if order is None:
            return self.down_buffers.add(a, y, self.slots, **self._pairs(1))
        idx = lora_index(self.slots, self.expert_ids, self.experts, self.top_k)[order]
        return self.down_buffers.add(a, y, idx, rank_div=self.experts)


class ExpertLoRA:
    """The slot buffers of a FusedMoE's ``gate_up_proj`` and ``down_proj`` (``FusedMoE.lora``)."""

    def __init__(self, gate_up: LoRABuffers, down: LoRABuffers):
        self.gate_up, self.down = gate_up, down

    def bind(self, adapter_ids: torch.Tensor, topk_ids: torch.Tensor) -> ExpertDelta:
        if adapter_ids.shape[0] != topk_ids.shape[0]:
            raise ValueError(f"LoRA: {topk_ids.shape[0]} routed rows but {adapter_ids.shape[0]} adapter ids")
        return ExpertDelta(self.gate_up, self.down, adapter_ids, topk_ids)
