"""The MoE layer: routed experts stored stacked, a shared expert, and their composition (design §3).

Shapes: R = rows, H = hidden, E = experts, K = top-k (experts per row), I = expert width,
P = R * K (row, expert) pairs.

Expert weights, stacked from load time in transformers 5's fused layout (``mlp.experts.`` / Gemma 4's
``experts.``): ``gate_up_proj`` [E, 2I, H] (rows :I the gate, rows I: the up projection) and
``down_proj`` [E, H, I]; expert e computes ``down_proj[e] @ act(gate_up_proj[e] @ x)``.

Two torch paths with one signature (the twins of the Triton kernels), chosen by P vs ``pair_threshold``:
- grouped (P > threshold, prefill): stable-sort the pairs by expert, per-expert offsets, one matmul per
  expert over its contiguous slice (each expert's weights read once), activation, down matmul, then an
  unpermute with a weighted reduce (index_add) back to row order;
- per-pair (P <= threshold, decode / speculative verify): gather each pair's expert weights, batched
  GEMVs, weighted sum over K; no sort.
Matmuls run in x's dtype; the weighted reduce accumulates in fp32; the result is cast back to x's dtype.

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

from sparrow.layers.activation import get_activation

log = logging.getLogger(__name__)


def _gate_up_act(h: torch.Tensor, activation: str, swiglu_limit: float | None) -> torch.Tensor:
    """act(gate) * up of h [P, 2I] -> [P, I]; DeepSeek-V4 clamps gate <= limit and |up| <= limit first."""
    if swiglu_limit is not None:
        gate, up = h.chunk(2, dim=-1)
        h = torch.cat([gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)], dim=-1)
    return get_activation(activation)(h)


def fused_moe_grouped_ref(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    swiglu_limit: float | None = None,
    reduce: bool = True,
) -> torch.Tensor:
    """Sorted / grouped expert path. x [R, H], gate_up_proj [E, 2I, H], down_proj [E, H, I],
    topk_weights [R, K] (any float dtype), topk_ids [R, K] int (each in [0, E)) -> [R, H] in x's dtype.
    ``reduce=False``: the per-pair outputs [R K, H] in pair order (pair p = row p // K, slot p % K), x's
    dtype, unweighted (the caller reduces them, as ``sparrow.kernels.moe.moe_reduce``)."""
    num_rows, top_k = topk_ids.shape
    num_experts = gate_up_proj.shape[0]
    flat_ids = topk_ids.reshape(-1).long()  # [P], pair p = row p // K, slot p % K
    order = torch.argsort(flat_ids, stable=True)  # pairs sorted by expert
    rows = order // top_k  # [P] row of each sorted pair
    counts = torch.bincount(flat_ids, minlength=num_experts)  # [E]
    offsets = [0, *torch.cumsum(counts, 0).tolist()]  # expert e owns sorted pairs offsets[e]:offsets[e+1]
    xs = x[rows]  # [P, H]
    h = xs.new_empty(xs.shape[0], gate_up_proj.shape[1])  # [P, 2I]
    active = [e for e in range(num_experts) if offsets[e + 1] > offsets[e]]
    for e in active:
        s, t = offsets[e], offsets[e + 1]
        h[s:t] = xs[s:t] @ gate_up_proj[e].t()
    a = _gate_up_act(h, activation, swiglu_limit)  # [P, I]
    y = xs.new_empty(xs.shape[0], down_proj.shape[1])  # [P, H]
    for e in active:
        s, t = offsets[e], offsets[e + 1]
        y[s:t] = a[s:t] @ down_proj[e].t()
    if not reduce:
        pairs = torch.empty_like(y)
        pairs[order] = y
        return pairs
    w = topk_weights.reshape(-1)[order].float()  # [P]
    out = torch.zeros(num_rows, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, rows, y.float() * w[:, None])
    return out.to(x.dtype)


def fused_moe_per_pair_ref(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    swiglu_limit: float | None = None,
    reduce: bool = True,
) -> torch.Tensor:
    """Per-pair GEMV path, no sort: same signature and result as ``fused_moe_grouped_ref``."""
    num_rows, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1).long()  # [P]
    xp = x.repeat_interleave(top_k, dim=0)  # [P, H]
    h = torch.bmm(gate_up_proj[flat_ids], xp.unsqueeze(-1)).squeeze(-1)  # [P, 2I, H] @ [P, H, 1] -> [P, 2I]
    a = _gate_up_act(h, activation, swiglu_limit)  # [P, I]
    y = torch.bmm(down_proj[flat_ids], a.unsqueeze(-1)).squeeze(-1)  # [P, H]
    if not reduce:
        return y
    out = (y.float().view(num_rows, top_k, -1) * topk_weights.float().unsqueeze(-1)).sum(dim=1)  # [R, H]
    return out.to(x.dtype)


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
        return self.down_proj(_gate_up_act(h, self.activation, self.swiglu_limit))


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
