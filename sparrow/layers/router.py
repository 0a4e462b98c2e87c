"""MoE routers: the router modules of every scoring function (the router stays unquantized).

Shapes: R = rows, H = hidden, E = experts, K = top-k (experts per row), G = expert groups, V = vocab.

``select_experts`` (``sparrow.kernels.moe.router``: the torch twin of the fused router kernel, beside it) turns
router logits [R, E] into (weights [R, K] fp32, ids [R, K] int64):

    scores  = softmax(logits) | sigmoid(logits) | sqrt(softplus(logits))        (fp32)
    choice  = scores + e_score_correction_bias          (the bias only *selects*; weights use ``scores``)
    grouped top-k (optional): a group's score is the sum of its top-2 ``choice``; keep ``topk_group`` of
              the ``n_group`` groups, mask the others' experts to -inf
    ids     = top-k of choice (sorted by choice, descending)
    weights = scores[ids]; / their sum if ``renormalize``; x routed_scaling_factor; x per_expert_scale[ids]

Which family uses what (the transformers modules these match, tested in tests/layers/test_router.py;
routed_scaling = routed_scaling_factor, a hash layer's ids are tid2eid[input_ids]):

| family | module | scoring | bias | groups | renormalize | scale |
|---|---|---|---|---|---|---|
| Mixtral | MixtralTopKRouter | softmax | - | - | always | - |
| Qwen2-MoE, Qwen3-MoE | Qwen{2,3}MoeTopKRouter | softmax | - | - | norm_topk_prob | - |
| Gemma 4 | Gemma4TextRouter (``Gemma4Router``) | softmax | - | - | always | per_expert_scale |
| DeepSeek-V3 | DeepseekV3TopkRouter | sigmoid | yes | n_group / topk_group | norm_topk_prob | routed_scaling |
| MiniMax-M2 | MiniMaxM2TopKRouter | sigmoid | yes (on the block) | - | always | - |
| DeepSeek-V4 | DeepseekV4TopKRouter | scoring_func (sqrtsoftplus) | yes | - | always | routed_scaling |
| DeepSeek-V4 hash | DeepseekV4HashRouter (``HashRouter``) | scoring_func | - | tid2eid[ids] | always | routed_scaling |

Renormalization divides by ``sum + 1e-20`` (DeepSeek's guard; below one ulp of any sum of K probabilities,
so it is exact for the families that divide by the bare sum).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparrow.kernels.moe.router import SCORING_FUNCS, score_logits, select_experts, weigh_experts
from sparrow.layers.lora_buffers import add_linear_delta


class Router(nn.Module):
    """Linear gate + ``select_experts``: the router of Mixtral, Qwen2/3-MoE, DeepSeek-V3/V4, MiniMax-M2.

    Parameters (HF names under ``mlp.gate.``): ``weight`` [E, H]; with ``use_correction_bias``,
    ``e_score_correction_bias`` [E] fp32 (MiniMax-M2 checkpoints keep it on the block,
    ``mlp.e_score_correction_bias``: the model's weight table renames it here). Logits are computed in fp32
    whatever the weight and input dtypes. forward(x [R, H]) -> (weights [R, K] fp32, ids [R, K] int64).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        scoring: str = "softmax",
        renormalize: bool = False,
        use_correction_bias: bool = False,
        n_group: int | None = None,
        topk_group: int | None = None,
        routed_scaling_factor: float = 1.0,
        params_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if scoring not in SCORING_FUNCS:
            raise ValueError(f"unknown router scoring function {scoring!r}; expected one of {SCORING_FUNCS}")
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.scoring, self.renormalize = scoring, renormalize
        self.n_group, self.topk_group = n_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=params_dtype), requires_grad=False)
        self.register_parameter("e_score_correction_bias", None)
        if use_correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits [R, E] fp32 of x [R, H]."""
        from sparrow.kernels.moe.router import router_logits

        return router_logits(x, self.weight)

    lora = None
    """The adapter slots' buffers (``layers.lora_buffers.LoRABuffers``, a delta [E] per row on the logits)."""

    def forward(self, x: torch.Tensor, batch=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch``: the step's ForwardBatch; rows with an adapter add its router delta to the fp32 logits
        before the scoring and top-k (PEFT's ``target_parameters`` on ``mlp.gate.weight``)."""
        logits = self.logits(x)
        if self.lora is not None and batch is not None and batch.adapter_ids is not None:
            logits = add_linear_delta(self.lora, x, logits, batch.adapter_ids)
        return _selector(x)(
            logits, self.top_k, self.scoring, self.renormalize, self.e_score_correction_bias,
            self.n_group, self.topk_group, self.routed_scaling_factor,
        )

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden_size}, experts={self.num_experts}, top_k={self.top_k}, "
                f"scoring={self.scoring}, renormalize={self.renormalize}, n_group={self.n_group}, "
                f"topk_group={self.topk_group}, routed_scaling_factor={self.routed_scaling_factor}")


def _selector(x: torch.Tensor):
    """select_experts, or its one-launch Triton kernel (sparrow/kernels/moe/router.py) where use_triton(x)."""
    from sparrow.kernels import use_triton

    if use_triton(x):
        from sparrow.kernels.moe.router import fused_router

        return fused_router
    return select_experts


class Gemma4Router(nn.Module):
    """Gemma 4's router (transformers ``Gemma4TextRouter``); reads the raw residual, not the experts' input.

    x -> scale-free RMSNorm (fp32, eps) -> x ``scale`` x H^-0.5 -> ``proj`` -> softmax -> top-k ->
    renormalize -> x ``per_expert_scale``[ids]. Parameters (HF names under ``router.``): ``proj.weight``
    [E, H], ``scale`` [H], ``per_expert_scale`` [E]; ``norm`` has none. Computed in fp32 throughout
    (transformers runs ``proj`` in the model dtype). forward(x [R, H]) -> (weights [R, K] fp32, ids [R, K]).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, eps: float = 1e-6,
                 params_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.hidden_size, self.num_experts, self.top_k, self.eps = hidden_size, num_experts, top_k, eps
        self.proj = nn.Linear(hidden_size, num_experts, bias=False, dtype=params_dtype)
        self.proj.weight.requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts, dtype=params_dtype), requires_grad=False)

    def folded_weight(self) -> torch.Tensor:
        """proj.weight x scale x H^-0.5 in fp32 [E, H] (the pre-projection scaling folded into the weight, so
        a step runs no per-step scaling or weight cast); rebuilt whenever either parameter changes."""
        key = (self.proj.weight._version, self.scale._version, self.proj.weight.device, self.proj.weight.data_ptr())
        cached = self.__dict__.get("_folded")
        if cached is None or cached[0] != key:
            w = self.proj.weight.float() * (self.scale.float() * self.hidden_size**-0.5)[None, :]
            self.__dict__["_folded"] = cached = (key, w)  # plain attribute: not a parameter or buffer
        return cached[1]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits [R, E] fp32 of the raw residual x [R, H]."""
        from sparrow.kernels.moe.router import router_logits

        # Gemma4RMSNorm(with_scale=False) in fp32 (rsqrt where HF uses pow(-0.5): the same value up to an fp32
        # ulp), then the folded projection; at decode sizes one Triton launch (sparrow.kernels.moe.router)
        return router_logits(x, self.folded_weight(), rms_eps=self.eps)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from sparrow.kernels.moe.router import router_topk

        # self.logits' steps, then softmax top-k (Triton kernels where use_triton(x), else torch)
        return router_topk(x, self.folded_weight(), self.top_k, self.eps, "softmax", renormalize=True,
                           per_expert_scale=self.per_expert_scale)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden_size}, experts={self.num_experts}, top_k={self.top_k}, eps={self.eps}"


class HashRouter(nn.Module):
    """DeepSeek-V4's hash routing (transformers ``DeepseekV4HashRouter``, the ``hash_moe`` layers).

    The experts are fixed per token id: ids = ``tid2eid``[input_ids]; the learned gate only weighs them:
    weights = scores(x . weight^T)[ids], renormalized, x routed_scaling_factor. Parameters (HF names under
    ``mlp.gate.``): ``weight`` [E, H], ``tid2eid`` [V, K] int64.
    forward(x [R, H], input_ids [R]) -> (weights [R, K] fp32, ids [R, K] int64).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, vocab_size: int,
                 scoring: str = "sqrtsoftplus", routed_scaling_factor: float = 1.0,
                 params_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if scoring not in SCORING_FUNCS:
            raise ValueError(f"unknown router scoring function {scoring!r}; expected one of {SCORING_FUNCS}")
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.scoring, self.routed_scaling_factor = scoring, routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=params_dtype), requires_grad=False)
        self.tid2eid = nn.Parameter(torch.zeros(vocab_size, top_k, dtype=torch.long), requires_grad=False)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = score_logits(F.linear(x.float(), self.weight.float()), self.scoring)
        topk_ids = self.tid2eid[input_ids.reshape(-1)].long()
        return weigh_experts(scores, topk_ids, True, self.routed_scaling_factor), topk_ids

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden_size}, experts={self.num_experts}, top_k={self.top_k}, "
                f"scoring={self.scoring}, routed_scaling_factor={self.routed_scaling_factor}")
