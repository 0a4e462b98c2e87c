"""The MoE layer: routed experts stored stacked, a shared expert, and their composition.

Shapes: R = rows, H = hidden, E = experts, K = top-k (experts per row), I = expert width,
P = R * K (row, expert) pairs.

Expert weights, stacked from load time in transformers 5's fused layout (``mlp.experts.`` / Gemma 4's
``experts.``): ``gate_up_proj`` [E, 2I, H] (rows :I the gate, rows I: the up projection) and
``down_proj`` [E, H, I]; expert e computes ``down_proj[e] @ act(gate_up_proj[e] @ x)``.

On the GPU the experts run ``sparrow.kernels.moe.moe.fused_moe`` (Triton); on CPU its torch twins of
``sparrow.kernels.moe.moe_ref``: the grouped path (P > ``pair_threshold``, prefill) or the per-pair path
(P <= threshold, decode / speculative verify), matmuls in x's dtype, fp32 weighted reduce.

Weight formats: the layer's ``quant_method`` (``docs/architecture.md``, "The quant-method contract") creates the
expert parameters, finishes them after loading and computes the layer;
``sparrow.quant.unquantized.UnquantizedFusedMoEMethod`` holds them in the model dtype and runs the Triton kernels or
the torch paths above; quantized formats live in ``sparrow.quant`` (FP8:
``sparrow.quant.fp8_moe``). A FusedMoE built inside ``sparrow.quant.quant_config_scope`` takes the config's
method, as a ``Linear`` does.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from sparrow.distributed import get_tp
from sparrow.kernels.activation.act import get_activation
from sparrow.layers.moe_parallel import ExpertShards
from sparrow.kernels.moe.moe_ref import gate_up_act
from sparrow.quant.base import FusedMoEMethodBase, set_layer_method
from sparrow.quant.scope import current_quant_config

log = logging.getLogger(__name__)


class FusedMoE(nn.Module):
    """Routed experts, stacked. Parameters (HF 5 names under ``experts.``), made by ``quant_method``:
    ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I] (plus the format's scales). ``activation``: HF
    ``hidden_act`` name (see activation.ACTIVATIONS); ``swiglu_limit``: DeepSeek-V4's clamp (None = off);
    ``pair_threshold``: more than this many (row, expert) pairs take the grouped path, otherwise the per-pair
    path; ``params_dtype``: the model dtype; ``quant_method``: the weight format (default: the one of the
    enclosing ``quant_config_scope``, unquantized outside any).

    forward(x [R, H], topk_weights [R, K], topk_ids [R, K], reduce=True) -> [R, H] in x's dtype; with
    ``reduce=False`` the unweighted per-pair outputs [R K, H] in pair order, for a consumer that fuses the
    weighted reduce (``RMSNorm.norm_add(pair_weights=...)``, Gemma 4).
    """

    quant_kind = "moe"
    lora = None
    """The adapter slots' expert buffers (``sparrow.layers.lora_buffers.ExpertLoRA``) when LoRA is enabled."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: str = "silu",
        pair_threshold: int = 64,
        swiglu_limit: float | None = None,
        params_dtype: torch.dtype | None = None,
        quant_method: FusedMoEMethodBase | None = None,
    ) -> None:
        super().__init__()
        get_activation(activation)  # fail at build time on an unknown name
        self.shards = ExpertShards(num_experts, intermediate_size)  # this rank's experts / width
        num_experts, intermediate_size = self.shards.num_experts, self.shards.intermediate_size
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.reduce_results = True
        self.activation, self.pair_threshold, self.swiglu_limit = activation, pair_threshold, swiglu_limit
        self.params_dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
        self.prefix = ""
        self.set_quant_method(quant_method or current_quant_config().get_moe_method(None))

    def set_quant_method(self, method: FusedMoEMethodBase) -> None:
        """(Re)create the expert parameters with ``method`` on the device of the previous ones (dropped)."""
        set_layer_method(self, method)
        self.shards.bind_loaders(self)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                reduce: bool = True, batch=None) -> torch.Tensor:
        """``batch``: the step's ForwardBatch (per-row facts), when called inside a model step: rows with an
        adapter add its expert deltas per (row, expert) pair, before the activation (gate_up_proj) and before
        the weighted reduce (down_proj). Over several ranks (``sparrow.layers.moe_parallel``) the outputs are
        combined here (``reduce=True`` only); ``reduce_results=False`` leaves the all-reduce of the tp / all_reduce
        ways to the caller (``MoEBlock`` sums a shared expert in first)."""
        adapters = batch.adapter_ids if self.lora is not None and batch is not None else None
        mode = self.shards.mode
        if mode is not None:
            if not reduce:
                raise ValueError("FusedMoE over several ranks combines its outputs itself: call it with reduce=True")
            if mode == "all_to_all":  # each pair's adapter travels with it
                def compute(xs, ids, pair_adapters):
                    ones = torch.ones(ids.shape, dtype=torch.float32, device=xs.device)
                    lora = None if pair_adapters is None else self.lora.bind(pair_adapters, ids)
                    return self.quant_method.apply(self, xs, ones, ids, lora=lora)

                return self.shards.all_to_all(compute, x, topk_weights, topk_ids, adapters)
            if mode == "all_reduce":
                topk_weights, topk_ids = self.shards.local_routing(topk_weights, topk_ids)
            lora = None if adapters is None else self.lora.bind(adapters, topk_ids)
            out = self.quant_method.apply(self, x, topk_weights, topk_ids, lora=lora)
            return get_tp().all_reduce(out) if self.reduce_results else out
        if self.lora is not None and batch is not None and batch.adapter_ids is not None:
            lora = self.lora.bind(batch.adapter_ids, topk_ids)
            return self.quant_method.apply(self, x, topk_weights, topk_ids, reduce, lora=lora)
        return self.quant_method.apply(self, x, topk_weights, topk_ids, reduce)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, width={self.intermediate_size}, "
                f"activation={self.activation}, pair_threshold={self.pair_threshold}, "
                f"swiglu_limit={self.swiglu_limit}, quant_method={type(self.quant_method).__name__}")


class SharedExpert(nn.Module):
    """A dense gated MLP beside the routed experts (Qwen2-MoE ``shared_expert``, DeepSeek ``shared_experts``).
    Parameters: ``gate_proj.weight`` [I, H], ``up_proj.weight`` [I, H], ``down_proj.weight`` [H, I].
    forward(x [R, H]) -> [R, H]."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu",
                 swiglu_limit: float | None = None, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        get_activation(activation)
        self.activation, self.swiglu_limit = activation, swiglu_limit
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=params_dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=params_dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=params_dtype)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor, batch=None) -> torch.Tensor:
        h = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)  # [R, 2I]
        return self.down_proj(gate_up_act(h, self.activation, self.swiglu_limit))


class MoEBlock(nn.Module):
    """Router + routed experts (+ shared expert): the ``mlp`` of Mixtral / Qwen2-MoE / Qwen3-MoE /
    DeepSeek-V3/V4 / MiniMax-M2 decoder layers, with HF names ``gate``, ``experts``, ``shared_expert``,
    ``shared_expert_gate`` (DeepSeek's ``shared_experts.`` maps onto ``shared_expert.``).

    out = experts(expert_input or x, gate(x)) [+ sigmoid(x . shared_expert_gate) * shared_expert(x)]
    (the sigmoid gate only with ``shared_expert_gate=True``, Qwen2-MoE). Over several ranks the shared expert is
    tensor parallel and the routed and shared partial sums are all-reduced once (``sparrow.layers.moe_parallel``);
    with all_to_all dispatch the routed output arrives combined and the shared expert reduces its own. ``shared_expert`` is any
    [R, H] -> [R, H] module (SharedExpert, or a quantizable dense MLP). ``gate`` is a Router, or a
    HashRouter, in which case forward needs ``input_ids``. forward(x [R, H]) -> [R, H].
    """

    def __init__(self, gate: nn.Module, experts: FusedMoE, shared_expert: nn.Module | None = None,
                 shared_expert_gate: bool = False) -> None:
        super().__init__()
        self.gate, self.experts, self.shared_expert = gate, experts, shared_expert
        self.shared_expert_gate = None
        if shared_expert_gate:
            if shared_expert is None:
                raise ValueError("MoEBlock: shared_expert_gate=True needs a shared_expert")
            self.shared_expert_gate = nn.Linear(experts.hidden_size, 1, bias=False, dtype=experts.params_dtype)
            self.shared_expert_gate.weight.requires_grad_(False)
        # over several ranks (tp / all_reduce experts, a row-parallel shared expert): one all-reduce of the sum
        down = getattr(shared_expert, "down_proj", None)
        self.reduce_once = experts.shards.mode in ("tp", "all_reduce") and (
            shared_expert is None or getattr(down, "parallel", None) == "row")
        if self.reduce_once:
            experts.reduce_results = False
            if down is not None:
                down.reduce_results = False

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None,
                expert_input: torch.Tensor | None = None, batch=None) -> torch.Tensor:
        """``batch``: the step's ForwardBatch, handed to the experts and the shared expert."""
        topk_weights, topk_ids = self.gate(x, batch=batch) if input_ids is None else self.gate(x, input_ids)
        out = self.experts(x if expert_input is None else expert_input, topk_weights, topk_ids, batch=batch)
        if self.shared_expert is not None:
            shared = self.shared_expert(x, batch)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return get_tp().all_reduce(out) if self.reduce_once else out
