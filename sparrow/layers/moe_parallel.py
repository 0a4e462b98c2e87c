"""Routed experts over several ranks: which experts / which width a rank holds, the loaders that take its share of
each checkpoint tensor, and the combine of the ranks' outputs.

Shapes: R = rows, H = hidden, E = experts (E' this rank's), K = top-k, I = expert width (I' this rank's),
P = pairs, T = ranks, r = this rank.

Three ways (``FusedMoE`` picks one when built, from ``sparrow.distributed``):
- tensor parallel (no expert parallelism): every rank holds all E experts at width I' = I / T (gate_up rows
  [r I', (r + 1) I') of the gate and of the up block, down columns the same), computes every pair, and one
  all-reduce sums the partial outputs;
- expert parallel, ``all_reduce`` dispatch: rank r holds experts [r E', (r + 1) E') at full width; every rank
  routes all rows (the inputs and the router are the same on every rank), computes its experts' pairs (the other
  pairs get weight 0 on a local expert: they add exact zeros), and one all-reduce after the weighted sum;
- expert parallel, ``all_to_all`` dispatch: rank r is the source of rows [r c, (r + 1) c) (c = ceil(R / T)); their
  pairs go (``Communicator.all_to_all``) to the ranks holding their experts, are computed there, come back, and
  the source sums them with their weights; an all-gather of the sources' rows gives every rank all R rows.
Attention, dense MLPs and shared experts stay tensor parallel under expert parallelism (split over the ranks, so
a shared expert or Gemma 4's dense MLP is added exactly once; ``MoEBlock`` sums a shared expert's partial output
with the routed one before the single all-reduce).
"""
from __future__ import annotations

import torch
from torch import nn

from sparrow.distributed import divide, expert_parallel, get_tp
from sparrow.quant.weight_loaders import narrow_shard


class ExpertShards:
    """This rank's part of a FusedMoE of ``num_experts`` experts of width ``intermediate_size`` (module doc).
    ``mode``: None (one rank), "tp", "all_reduce" or "all_to_all"; ``num_experts`` / ``intermediate_size``: the
    local sizes; ``expert_start`` / ``width_start``: where they start in the checkpoint's. Raises ModelLoadError
    when the experts or the width do not split over the ranks."""

    def __init__(self, num_experts: int, intermediate_size: int):
        tp = get_tp()
        self.rank, self.world = tp.rank, tp.world_size
        self.global_experts, self.global_width = num_experts, intermediate_size
        enabled, dispatch = expert_parallel()
        self.mode = None if self.world == 1 else (dispatch if enabled else "tp")
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.expert_start = self.width_start = 0
        if self.mode == "tp":
            self.intermediate_size = divide(intermediate_size, self.world, "moe_intermediate_size")
            self.width_start = self.rank * self.intermediate_size
        elif self.mode is not None:
            self.num_experts = divide(num_experts, self.world, "num_experts (expert parallel)")
            self.expert_start = self.rank * self.num_experts

    # ---- loading -------------------------------------------------------------------------------------------

    def bind_loaders(self, layer: nn.Module) -> None:
        """Wrap the loaders of the expert parameters ``layer``'s method just made so that they take this rank's
        share of each checkpoint tensor (per-expert (expert, block) or fused [E, ...]); under expert parallelism
        another rank's experts are read and dropped, and the parameters expect every expert's tensors."""
        if self.mode is None:
            return
        table = getattr(layer.quant_method, "checkpoint_tensors", ())
        stacked_of = {param: stacked for _, _, stacked, param in table}
        for pname in getattr(layer, "_quant_param_names", ()):
            param = layer._parameters.get(pname)
            if param is None or getattr(param, "tp_sharded", False):
                continue
            stacked = stacked_of.get(pname, "gate_up_proj" if pname.startswith(("gate_up", "w13")) else "down_proj")
            if hasattr(param, "weight_loader"):
                param.weight_loader = self._loader(param.weight_loader, "n" if stacked == "gate_up_proj" else "k")
            param.tp_sharded = True
            shards = getattr(param, "expected_shards", None)
            if self.mode != "tp" and shards:
                blocks = sorted({b for _, b in shards})
                param.expected_shards = [(e, b) for e in range(self.global_experts) for b in blocks]

    def _loader(self, inner, axis: str):
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id, name: str) -> None:
            if shard_id is not None:
                expert, block = shard_id
                if self.mode == "tp":
                    loaded = narrow_shard(param, loaded, axis, self.width_start, self.intermediate_size, name)
                else:
                    expert -= self.expert_start
                    if not 0 <= expert < self.num_experts:
                        return  # another rank's expert
                return inner(param, loaded, (expert, block), name)
            inner(param, self.fused_share(param, loaded, axis, name), None, name)

        return load

    def fused_share(self, param: nn.Parameter, loaded: torch.Tensor, axis: str, name: str) -> torch.Tensor:
        """This rank's share of a fused [E, blocks * rows, cols] expert tensor: its experts, or each block's rows
        (gate_up: the gate's and the up's) / columns (down) of its width."""
        if self.mode != "tp":
            return loaded.narrow(0, self.expert_start, self.num_experts)
        if axis == "k":
            return narrow_shard(param, loaded, "k", self.width_start, self.intermediate_size, name, dim_offset=1)
        n_dim = (getattr(param, "shard_layout", ((0, 1),))[0] or (0, 1))[0] + 1
        blocks = loaded.chunk(2, dim=n_dim)
        return torch.cat([narrow_shard(param, b, "n", self.width_start, self.intermediate_size, name, dim_offset=1)
                          for b in blocks], dim=n_dim)

    # ---- compute ---------------------------------------------------------------------------------------------

    def local_routing(self, topk_weights: torch.Tensor, topk_ids: torch.Tensor):
        """all_reduce dispatch: (weights [R, K] with 0 on other ranks' experts, local ids [R, K] (0 there))."""
        local = topk_ids - self.expert_start
        mine = (local >= 0) & (local < self.num_experts)
        return torch.where(mine, topk_weights, 0.0), torch.where(mine, local, 0)

    def all_to_all(self, compute, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   adapter_ids: torch.Tensor | None = None) -> torch.Tensor:
        """all_to_all dispatch (module doc): ``compute(x [P, H], ids [P, 1], adapters [P] or None) -> [P, H]`` runs
        this rank's experts on the pairs it receives (each with weight 1; ``adapter_ids`` [R]: each row's LoRA slot,
        sent with its pairs). Returns the combined [R, H] in x's dtype, equal on every rank."""
        comm, world = get_tp(), self.world
        rows, k = topk_ids.shape
        chunk = -(-rows // world)
        first, last = min(rows, self.rank * chunk), min(rows, (self.rank + 1) * chunk)
        ids = topk_ids[first:last].reshape(-1)  # this rank's source pairs, row-major
        dest = torch.div(ids, self.num_experts, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)
        send = torch.bincount(dest, minlength=world)
        recv = comm.all_to_all(send.reshape(world, 1), [1] * world, [1] * world).reshape(-1)
        send_counts, recv_counts = send.tolist(), recv.tolist()
        pair_rows = torch.arange(first, last, device=x.device).repeat_interleave(k)[order]
        got_x = comm.all_to_all(x[pair_rows], send_counts, recv_counts)
        got_ids = comm.all_to_all((ids[order] - dest[order] * self.num_experts).reshape(-1, 1), send_counts,
                                  recv_counts)
        got_adapters = None if adapter_ids is None else \
            comm.all_to_all(adapter_ids[pair_rows].reshape(-1, 1), send_counts, recv_counts).reshape(-1)
        y = compute(got_x, got_ids, got_adapters) if got_x.shape[0] else got_x.new_zeros(0, x.shape[1])
        back = comm.all_to_all(y, recv_counts, send_counts)  # [pairs of this rank's rows, H], in ``order``
        pairs = torch.empty_like(back)
        pairs[order] = back
        w = topk_weights[first:last].reshape(-1, 1).float()
        own = (pairs.float() * w).reshape(last - first, k, -1).sum(1).to(x.dtype)
        padded = x.new_zeros(chunk, x.shape[1])
        padded[:last - first] = own
        return comm.all_gather(padded, dim=0)[:rows]
