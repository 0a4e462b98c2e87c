"""The MoE layer: routed experts stored stacked, a shared expert, and their composition (design §3).

Shapes: R = rows, H = hidden, E = experts, K = top-k (experts per row), I = expert width,
P = R * K (row, expert) pairs.

Expert weights, stacked from load time in transformers 5's fused layout (``mlp.experts.`` / Gemma 4's
``experts.``): ``gate_up_proj`` [E, 2I, H] (rows :I the gate, rows I: the up projection) and
``down_proj`` [E, H, I]; expert e computes ``down_proj[e] @ act(gate_up_proj[e] @ x)``.

On the GPU the experts run ``sparrow.kernels.moe.fused_moe`` (Triton); on CPU its torch twins of
``sparrow.kernels.moe_ref``: the grouped path (P > ``pair_threshold``, prefill) or the per-pair path
(P <= threshold, decode / speculative verify), matmuls in x's dtype, fp32 weighted reduce.

FP8 (on-load quantization, ``quantization="fp8"`` on a float checkpoint): after loading,
``FusedMoE.quantize_fp8()`` turns each stacked weight into e4m3 with 128 x 128 block scales
(``w13_scale`` [E, 2I/128, H/128], ``w2_scale`` [E, H/128, I/128] fp32, DeepSeek ``weight_scale_inv``
layout), one expert slice at a time; forward then runs ``sparrow.kernels.moe.fused_moe`` with the scales
(Triton) or its torch twin ``fused_moe_fp8_ref`` (W8A8: activations quantized per 128-column group).
Widths that are not multiples of 128 get partial last blocks. FP8 checkpoints fill the same parameters
directly (``create_fp8_weights``, then the loader; per-expert tensors need H and I multiples of 128).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from sparrow.kernels.act import get_activation
from sparrow.kernels.moe_ref import fused_moe_grouped_ref, fused_moe_per_pair_ref, gate_up_act

log = logging.getLogger(__name__)


class FusedMoE(nn.Module):
    """Routed experts, stacked. Parameters (HF 5 names under ``experts.``): ``gate_up_proj`` [E, 2I, H],
    ``down_proj`` [E, H, I]. ``activation``: HF ``hidden_act`` name (see activation.ACTIVATIONS);
    ``swiglu_limit``: DeepSeek-V4's clamp (None = off); ``pair_threshold``: more than this many
    (row, expert) pairs take the grouped path, otherwise the per-pair path.

    forward(x [R, H], topk_weights [R, K], topk_ids [R, K], reduce=True) -> [R, H] in x's dtype; with
    ``reduce=False`` the unweighted per-pair outputs [R K, H] in pair order, for a consumer that fuses the
    weighted reduce (``RMSNorm.norm_add(pair_weights=...)``, Gemma 4).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: str = "silu",
        pair_threshold: int = 64,
        swiglu_limit: float | None = None,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        get_activation(activation)  # fail at build time on an unknown name
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.activation, self.pair_threshold, self.swiglu_limit = activation, pair_threshold, swiglu_limit
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=params_dtype), requires_grad=False)
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=params_dtype), requires_grad=False)
        self.register_parameter("w13_scale", None)  # FP8 block scales [E, 2I/128, H/128], set by quantize_fp8()
        self.register_parameter("w2_scale", None)  # [E, H/128, I/128]

    @property
    def is_fp8(self) -> bool:
        return self.w13_scale is not None

    def fp8_checkpoint_aligned(self) -> bool:
        """Whether 128 x 128 block scales tile each checkpoint tensor exactly (H and I multiples of 128), which
        per-expert FP8 checkpoints need: a gate block and an up block must not share a scale row. On-load
        quantization has no such need: it scales the packed [2I, H] / [H, I] weights with ceil-sized blocks
        (the last row / column block partial), which the kernels and the torch twin read as such."""
        from sparrow.kernels.fp8 import GROUP

        return self.hidden_size % GROUP == 0 and self.intermediate_size % GROUP == 0

    def create_fp8_weights(self) -> None:
        """Replace the float expert weights by uninitialized e4m3 ones plus fp32 128 x 128 block scales,
        to be filled from an FP8 checkpoint (``weight`` e4m3 + ``weight_scale_inv``, per expert or fused).
        Raises ModelLoadError when H or I is not a multiple of 128 (the scales would straddle gate and up)."""
        from sparrow.errors import ModelLoadError
        from sparrow.kernels.fp8 import FP8_DTYPE, GROUP

        if not self.fp8_checkpoint_aligned():
            raise ModelLoadError(f"FP8 checkpoint: routed experts with hidden size {self.hidden_size} and expert "
                                 f"width {self.intermediate_size} are not tiled by {GROUP} x {GROUP} scale blocks")
        e, h, i, dev = self.num_experts, self.hidden_size, self.intermediate_size, self.gate_up_proj.device

        def param(*shape, dtype):
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=dev), requires_grad=False)

        self.gate_up_proj, self.down_proj = param(e, 2 * i, h, dtype=FP8_DTYPE), param(e, h, i, dtype=FP8_DTYPE)
        self.w13_scale = param(e, 2 * i // GROUP, h // GROUP, dtype=torch.float32)
        self.w2_scale = param(e, h // GROUP, i // GROUP, dtype=torch.float32)

    @torch.no_grad()
    def quantize_fp8(self, name: str = "") -> None:
        """Quantize the loaded float experts in place to e4m3 + fp32 128 x 128 block scales (on-load FP8;
        scales [E, ceil(2I/128), ceil(H/128)] and [E, ceil(H/128), ceil(I/128)]: with I = 704, as Gemma 4
        26B-A4B, one gate|up scale block spans the last gate rows and the first up rows). Each stacked weight
        is quantized one expert slice at a time into a new e4m3 tensor, then the float tensor is dropped, so
        the extra memory is one e4m3 copy of one weight plus one expert's fp32 temporaries."""
        from sparrow.kernels.fp8 import FP8_DTYPE, GROUP, quantize_fp8_block_ref

        if self.is_fp8:
            return
        scales = {}
        for pname in ("gate_up_proj", "down_proj"):
            w = getattr(self, pname)
            e, n, k = w.shape
            q = torch.empty(e, n, k, dtype=FP8_DTYPE, device=w.device)
            s = torch.empty(e, -(-n // GROUP), -(-k // GROUP), dtype=torch.float32, device=w.device)
            for i in range(e):
                qi, si = quantize_fp8_block_ref(w.data[i], GROUP)
                q[i].copy_(qi)
                s[i].copy_(si)
                del qi, si
            setattr(self, pname, nn.Parameter(q, requires_grad=False))  # the float tensor is freed here
            del w
            scales[pname] = s
        self.w13_scale = nn.Parameter(scales["gate_up_proj"], requires_grad=False)
        self.w2_scale = nn.Parameter(scales["down_proj"], requires_grad=False)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                reduce: bool = True) -> torch.Tensor:
        from sparrow.kernels import use_triton

        if use_triton(x):  # Triton grouped GEMM / per-expert GEMV (sparrow/kernels/moe.py)
            from sparrow.kernels.moe import fused_moe

            return fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, self.activation,
                             w13_scale=self.w13_scale, w2_scale=self.w2_scale,
                             pair_threshold=self.pair_threshold, swiglu_limit=self.swiglu_limit, reduce=reduce)
        if self.is_fp8:
            from sparrow.kernels.moe import fused_moe_fp8_ref

            return fused_moe_fp8_ref(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids,
                                     self.activation, self.swiglu_limit, w13_scale=self.w13_scale,
                                     w2_scale=self.w2_scale, reduce=reduce)
        path = fused_moe_grouped_ref if topk_ids.numel() > self.pair_threshold else fused_moe_per_pair_ref
        return path(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, self.activation,
                    self.swiglu_limit, reduce=reduce)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, width={self.intermediate_size}, "
                f"activation={self.activation}, pair_threshold={self.pair_threshold}, "
                f"swiglu_limit={self.swiglu_limit}" + (", fp8" if self.is_fp8 else ""))


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)  # [R, 2I]
        return self.down_proj(gate_up_act(h, self.activation, self.swiglu_limit))


class MoEBlock(nn.Module):
    """Router + routed experts (+ shared expert): the ``mlp`` of Mixtral / Qwen2-MoE / Qwen3-MoE /
    DeepSeek-V3/V4 / MiniMax-M2 decoder layers, with HF names ``gate``, ``experts``, ``shared_expert``,
    ``shared_expert_gate`` (DeepSeek's ``shared_experts.`` maps onto ``shared_expert.``).

    out = experts(expert_input or x, gate(x)) [+ sigmoid(x . shared_expert_gate) * shared_expert(x)]
    (the sigmoid gate only with ``shared_expert_gate=True``, Qwen2-MoE). ``shared_expert`` is any
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
            self.shared_expert_gate = nn.Linear(experts.hidden_size, 1, bias=False,
                                                dtype=experts.down_proj.dtype)
            self.shared_expert_gate.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None,
                expert_input: torch.Tensor | None = None) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x) if input_ids is None else self.gate(x, input_ids)
        out = self.experts(x if expert_input is None else expert_input, topk_weights, topk_ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out
