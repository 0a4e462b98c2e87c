"""Fused MoE router: logits -> scores -> (grouped) top-k -> renormalize -> scales, one launch for all rows.

Shapes: R = rows, E = experts, K = top-k, G = n_group.

    fused_router(router_logits [R, E], top_k, scoring, renormalize, e_score_correction_bias [E] | None,
                 n_group, topk_group, routed_scaling_factor, per_expert_scale [E] | None, ids_dtype)
        -> (weights [R, K] fp32, ids [R, K] ids_dtype)

Same contract and formulas as ``select_experts``, the torch routing every router's CPU path runs
(softmax, sigmoid with a selection-only bias and optional grouped top-k, sqrt-softplus; Gemma 4 = softmax +
renormalize + per_expert_scale on logits from ``Gemma4Router.logits``). ids are ordered by descending (biased) score;
ties go to the lowest expert id. ``fused_router_ref`` is the torch twin (it calls ``select_experts``),
``fused_router_triton`` the launcher, ``fused_router`` picks by ``use_triton(router_logits)``.

The logits themselves: ``router_logits(x [R, H], weight [E, H], rms_eps=None) -> [R, E] fp32`` (twin
``router_logits_ref``, launcher ``router_logits_triton``), fp32 x . weight with Gemma 4's scale-free
RMSNorm of x folded in; the kernel serves decode-sized R. Logits and routing: ``router_topk(x, weight,
top_k, rms_eps, scoring, renormalize, per_expert_scale, ids_dtype)`` (Gemma 4's router): ``router_logits``
then ``fused_router``, two launches (one fused launch is slower).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from sparrow.kernels import ForcedConfig, dispatch, pdl_kwargs
from sparrow.kernels.common import split_k
from sparrow.kernels.common.tiles import next_pow2

MAX_EXPERTS = 4096  # one row's logits live in one program's registers
SCORING_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")


def score_logits(router_logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """Per-expert scores of logits [R, E] in fp32: softmax over E, sigmoid, or sqrt(softplus)."""
    logits = router_logits.float()
    if scoring == "softmax":
        return torch.softmax(logits, dim=-1)
    if scoring == "sigmoid":
        return logits.sigmoid()
    if scoring == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    raise ValueError(f"unknown router scoring function {scoring!r}; expected one of {SCORING_FUNCS}")


def _group_mask(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """``choice`` [R, E] with the experts of all but the best ``topk_group`` of ``n_group`` groups set to -inf.
    A group scores the sum of its top-2 experts (DeepSeek-V3's ``group_scores``)."""
    rows, num_experts = choice.shape
    per_group = num_experts // n_group
    grouped = choice.view(rows, n_group, per_group)
    group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)  # [R, G]
    keep_groups = group_scores.topk(topk_group, dim=-1).indices  # [R, topk_group]
    keep = torch.zeros(rows, n_group, dtype=torch.bool, device=choice.device).scatter_(1, keep_groups, True)
    return choice.masked_fill(~keep.unsqueeze(-1).expand(rows, n_group, per_group).reshape(rows, num_experts),
                              float("-inf"))


def weigh_experts(
    scores: torch.Tensor,
    topk_ids: torch.Tensor,
    renormalize: bool = False,
    routed_scaling_factor: float = 1.0,
    per_expert_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weights [R, K] fp32 of the chosen experts ``topk_ids`` [R, K] from unbiased scores [R, E] fp32."""
    weights = scores.gather(1, topk_ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    if per_expert_scale is not None:
        weights = weights * per_expert_scale.float()[topk_ids]
    return weights


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = False,
    e_score_correction_bias: torch.Tensor | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
    per_expert_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route each row: logits [R, E] (any float dtype) -> (weights [R, K] fp32, ids [R, K] int64).

    ``scoring`` in SCORING_FUNCS; ``e_score_correction_bias`` [E] only shifts the selection; ``n_group`` /
    ``topk_group`` enable grouped top-k (both or neither; E % n_group == 0); ``per_expert_scale`` [E]
    multiplies each chosen expert's weight (Gemma 4). ids are ordered by descending (biased) score.
    Raises ValueError for an unknown scoring function or inconsistent top-k / group sizes.
    """
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"router top_k={top_k} must be in [1, num_experts={num_experts}]")
    scores = score_logits(router_logits, scoring)
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    groups, keep = _groups(num_experts, top_k, n_group, topk_group)
    if groups > 1:
        choice = _group_mask(choice, groups, keep)
    topk_ids = choice.topk(top_k, dim=-1).indices
    return weigh_experts(scores, topk_ids, renormalize, routed_scaling_factor, per_expert_scale), topk_ids


def fused_router_ref(router_logits, top_k, scoring="softmax", renormalize=False, e_score_correction_bias=None,
                     n_group=None, topk_group=None, routed_scaling_factor=1.0, per_expert_scale=None,
                     ids_dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin: ``select_experts`` (its parameters and their types) with ids cast to ``ids_dtype`` (int32 or
    int64)."""
    _check(router_logits, top_k, scoring, e_score_correction_bias, per_expert_scale, ids_dtype)
    weights, ids = select_experts(router_logits, top_k, scoring, renormalize, e_score_correction_bias,
                                  n_group, topk_group, routed_scaling_factor, per_expert_scale)
    return weights, ids.to(ids_dtype)


def fused_router_triton(router_logits, top_k, scoring="softmax", renormalize=False, e_score_correction_bias=None,
                        n_group=None, topk_group=None, routed_scaling_factor=1.0, per_expert_scale=None,
                        ids_dtype=torch.int64):
    """Triton launcher of ``fused_router_ref`` (its parameters, types and contract); one program per row, no host
    sync."""
    from sparrow.kernels.moe._router_jit import SIGMOID, SOFTMAX, SQRTSOFTPLUS, router_kernel

    _check(router_logits, top_k, scoring, e_score_correction_bias, per_expert_scale, ids_dtype)
    rows, num_experts = router_logits.shape
    groups, keep = _groups(num_experts, top_k, n_group, topk_group)
    weights = torch.empty(rows, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(rows, top_k, dtype=ids_dtype, device=router_logits.device)
    if rows == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    bias = e_score_correction_bias.float().contiguous() if e_score_correction_bias is not None else None
    scale = per_expert_scale.contiguous() if per_expert_scale is not None else None
    per_group = num_experts // groups
    router_kernel[(rows,)](
        logits, bias if bias is not None else weights, scale if scale is not None else weights, weights, ids,
        logits.stride(0), float(routed_scaling_factor),
        SCORING={"softmax": SOFTMAX, "sigmoid": SIGMOID, "sqrtsoftplus": SQRTSOFTPLUS}[scoring],
        HAS_BIAS=bias is not None, HAS_SCALE=scale is not None, RENORM=bool(renormalize),
        TOPK=top_k, K_PAD=next_pow2(top_k), N_GROUP=groups, TOPK_GROUP=keep, PER_GROUP=per_group,
        G_PAD=next_pow2(groups), PER_PAD=next_pow2(per_group), num_warps=4 if num_experts >= 512 else 1,
        **pdl_kwargs(logits),
    )
    return weights, ids


fused_router = dispatch("fused_router", fused_router_triton, fused_router_ref,
                        """Route each row (module doc; ``fused_router_ref``'s signature); Triton where
    ``use_triton(router_logits)``, else the twin.""")


MAX_LOGIT_ROWS = 256  # above this, router_logits goes to torch's (cuBLAS) fp32 matmul (LOGITS_CONFIGS)


@dataclasses.dataclass(frozen=True)
class LogitsConfig:
    """Tile of ``router_logits_kernel``: BLOCK_R rows x BLOCK_E experts per program, BLOCK_H of H per step."""
    block_r: int
    block_e: int
    block_h: int
    """0: as much of H per step as registers allow (max(128, 4096 / block_r), at most H rounded up)."""
    split_k: int = 1
    """Programs per tile over contiguous H ranges, reduced in the kernel; 0: automatic (``split_k.choose_split``)."""
    num_warps: int = 4


# (largest R, config), the first entry whose bound covers R. Up to 16 rows: one expert per program, all E
# programs sharing the weight stream. Above: expert tiles, H split over programs (automatic: about
# split_k.FILL_PROGRAMS programs), since a program per expert walking all of H grew with the rows past torch.
# H200, Gemma 4's router (E 128, H 2816), kernels_micro.py router_logits / tune_router_logits (24 tiles x split
# automatic / none): this kernel beats torch's cast + norm + fp32 matmul up to 256 rows and loses at 1,024
# (benchmarks/README.md), so MAX_LOGIT_ROWS is 256.
LOGITS_CONFIGS: tuple[tuple[int, LogitsConfig], ...] = (
    (16, LogitsConfig(16, 1, 0)),
    (32, LogitsConfig(32, 8, 32, split_k=0)),
    (128, LogitsConfig(16, 16, 32, split_k=0)),
    (MAX_LOGIT_ROWS, LogitsConfig(16, 8, 64, split_k=0)),
)
forced_logits_config = ForcedConfig()  # ``with forced_logits_config(LogitsConfig(...)):`` overrides the table


def router_logits_ref(x: torch.Tensor, weight: torch.Tensor, rms_eps: float | None = None) -> torch.Tensor:
    """Router logits in fp32: x [R, H] (any float dtype) @ weight [E, H].T -> [R, E] fp32, with
    ``rms_eps`` the scale-free RMSNorm of x first (Gemma 4's router: x / sqrt(mean(x^2) + eps), transformers
    ``Gemma4RMSNorm(with_scale=False)``). Raises ValueError on bad shapes."""
    _check_logits(x, weight)
    h = x.float()
    if rms_eps is not None:
        h = F.rms_norm(h, (x.shape[1],), eps=rms_eps)
    return F.linear(h, weight.float())


def router_logits_triton(x: torch.Tensor, weight: torch.Tensor, rms_eps: float | None = None) -> torch.Tensor:
    """Triton launcher of ``router_logits_ref`` (same contract): one launch, no fp32 copy of x or weight;
    the norm's factor is applied to the dot (the same value up to fp32 rounding order)."""
    from sparrow.kernels.moe._router_jit import router_logits_kernel

    _check_logits(x, weight)
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    rows, hidden = x.shape
    num_experts = weight.shape[0]
    out = torch.empty(rows, num_experts, dtype=torch.float32, device=x.device)
    if rows == 0 or num_experts == 0:
        return out
    cfg = forced_logits_config.value or next((c for bound, c in LOGITS_CONFIGS if rows <= bound), LOGITS_CONFIGS[-1][1])
    block_r = min(next_pow2(rows), cfg.block_r)
    block_h = cfg.block_h or min(max(16, next_pow2(hidden)), max(128, 4096 // block_r))
    grid_e, grid_r = -(-num_experts // cfg.block_e), -(-rows // block_r)
    nacc = 2 if rms_eps is not None else 1
    split, ws, locks = split_k.plan(x.device, grid_e * grid_r, -(-hidden // block_h), cfg.split_k,
                                    nacc * block_r * cfg.block_e, out)
    router_logits_kernel[(grid_e, grid_r, split)](
        x, weight, out, ws, locks, rows, num_experts, hidden, x.stride(0), weight.stride(0), float(rms_eps or 0.0),
        RMS_NORM=rms_eps is not None, BLOCK_R=block_r, BLOCK_E=cfg.block_e, BLOCK_H=block_h, SPLIT_K=split,
        num_warps=cfg.num_warps, **pdl_kwargs(x),
    )
    return out


def _logit_rows_fit(x: torch.Tensor, *args, **kwargs) -> bool:
    return x.shape[0] <= MAX_LOGIT_ROWS


router_logits = dispatch("router_logits", router_logits_triton, router_logits_ref,
                         """``router_logits_ref``'s contract: the Triton kernel where ``use_triton(x)`` and R <=
    MAX_LOGIT_ROWS (decode: one launch instead of a cast, a norm and a cuBLAS GEMV), else the twin.""",
                         fits=_logit_rows_fit)


def router_topk(x: torch.Tensor, weight: torch.Tensor, top_k: int, rms_eps: float | None = None,
                scoring: str = "softmax", renormalize: bool = False, per_expert_scale: torch.Tensor | None = None,
                ids_dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    """Route x [R, H] with router weight [E, H] (any float dtype, read as fp32; ``router_logits``, then
    ``fused_router`` without bias or groups: Gemma 4's router) -> (weights [R, K] fp32, ids [R, K] ids_dtype),
    each step on its Triton kernel where ``use_triton(x)`` (the logits on torch's matmul above
    MAX_LOGIT_ROWS). Raises ValueError as ``router_logits`` and ``fused_router`` do."""
    return fused_router(router_logits(x, weight, rms_eps), top_k, scoring, renormalize,
                        per_expert_scale=per_expert_scale, ids_dtype=ids_dtype)


def _check_logits(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"router_logits: need x [R, H] and weight [E, H], got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if not (x.is_floating_point() and weight.is_floating_point()):
        raise ValueError(f"router_logits: x and weight must be float tensors, got {x.dtype} and {weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"router_logits: x on {x.device}, weight on {weight.device}")


def _groups(num_experts: int, top_k: int, n_group: int | None, topk_group: int | None) -> tuple[int, int]:
    """(groups, kept groups) for the kernel: (1, 1) without grouped top-k. Same checks as select_experts."""
    if (n_group is None) != (topk_group is None):
        raise ValueError(f"grouped top-k needs both n_group and topk_group, got {n_group=} {topk_group=}")
    if n_group is None or topk_group is None or n_group <= 1:
        return 1, 1
    if num_experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"grouped top-k: {num_experts} experts, {n_group=}, {topk_group=} is inconsistent")
    if top_k > topk_group * (num_experts // n_group):
        raise ValueError(f"grouped top-k: top_k={top_k} exceeds the {topk_group} kept groups' experts")
    return n_group, topk_group


def _check(logits, top_k, scoring, bias, scale, ids_dtype) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"fused_router: router_logits must be a 2-D float tensor [R, E], got "
                         f"{tuple(logits.shape)} {logits.dtype}")
    num_experts = logits.shape[1]
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"fused_router: {num_experts} experts, supported 1..{MAX_EXPERTS}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"router top_k={top_k} must be in [1, num_experts={num_experts}]")
    if scoring not in SCORING_FUNCS:
        raise ValueError(f"unknown router scoring function {scoring!r}; expected one of {SCORING_FUNCS}")
    for name, t in (("e_score_correction_bias", bias), ("per_expert_scale", scale)):
        if t is not None and (t.shape != (num_experts,) or t.device != logits.device):
            raise ValueError(f"fused_router: {name} must be [{num_experts}] on {logits.device}, got "
                             f"{tuple(t.shape)} on {t.device}")
    if ids_dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused_router: ids_dtype must be torch.int32 or torch.int64, got {ids_dtype}")
