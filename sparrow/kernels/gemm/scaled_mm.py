"""Block-scaled FP8 GEMM through cuBLAS (``torch.nn.functional.scaled_mm``, DeepSeek-V3 recipe: activations
scaled per 1 x 128 group, weights per 128 x 128 block), and the standalone activation quantizer it needs.

Shapes: M = rows, K = input width, N = output width, G = ceil(K / 128), NB = ceil(N / 128), M4 = M rounded
up to a multiple of 4, L4 = G rounded up to a multiple of 4.

    quantize_fp8_per_group(x [M, K], m_pad=M, scales_m_major=False) -> (q e4m3 [m_pad, K], scales fp32 [m_pad, G])
    scaled_mm_weight_scale(w_scale [NB, G]) -> [L4, NB] fp32 view (cuBLAS's 128 x 128 scale operand)
    fp8_scaled_mm(x [M, K] float, w [N, K] e4m3, w_scale_mm [L4, NB], out_dtype=x.dtype) -> [M, N]

The quantizer gives the numbers of ``fp8.quantize_fp8_per_group_ref`` (Triton kernel ``_quant_jit``, the
reference on CPU); rows past M are zero with the smallest scale. ``fp8_scaled_mm`` quantizes x, then runs
cuBLASLt's block-scaled e4m3 GEMM (CUDA >= 12.9, compute capability 9.0 only: ``scaled_mm_supported``), so
its numbers are those of ``fp8_gemm.fp8_gemm_ref`` up to fp32 summation order. cuBLAS's layout rules
(PyTorch's test_scaled_mm_block_wise_numerics): the 1 x 128 scales M-major (stride (1, M)), the 128 x 128
scales [L4, NB] with stride (1, L4), and M a multiple of 4 (rows are padded here). K and N must be multiples
of 16 (``scaled_mm_fits``); other shapes stay on the Triton ``fp8_gemm``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sparrow.kernels import device_capability, interpreting, pdl_kwargs, use_triton
from sparrow.kernels.gemm.fp8 import AMAX_EPS, FP8_DTYPE, FP8_MAX, GROUP, quantize_fp8_per_group_ref

_QUANT_BLOCK_M = 16
SCALED_MM_OUT_DTYPES = (torch.bfloat16, torch.float32)
"""Output dtypes of ``fp8_scaled_mm`` (those PyTorch tests cuBLAS's block-scaled GEMM with); fp16 models keep
the Triton kernels."""
_CUDA_VERSION = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])


def quantize_fp8_per_group_triton(x: torch.Tensor, m_pad: int | None = None,
                                  scales_m_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher of ``quantize_fp8_per_group`` (same contract)."""
    from sparrow.kernels.gemm._quant_jit import quant_fp8_groups_kernel

    m, k, m_pad = _check_quant(x, m_pad)
    groups = -(-k // GROUP)
    emulate = interpreting()  # the interpreter rounds fp32 -> e4m3 wrongly: emulate, store fp32, cast here
    q = torch.empty(m_pad, k, dtype=torch.float32 if emulate else FP8_DTYPE, device=x.device)
    if scales_m_major:
        scales = torch.empty(groups, m_pad, dtype=torch.float32, device=x.device).t()
    else:
        scales = torch.empty(m_pad, groups, dtype=torch.float32, device=x.device)
    if m_pad == 0 or k == 0:
        return q.to(FP8_DTYPE), scales
    grid = (-(-m_pad // _QUANT_BLOCK_M), groups)
    quant_fp8_groups_kernel[grid](x, q, scales, m, m_pad, k, x.stride(0), q.stride(0), scales.stride(1),
                                  scales.stride(0), BLOCK_M=_QUANT_BLOCK_M, GROUP=GROUP, EMULATE_FP8=emulate,
                                  **pdl_kwargs(x))
    return (q.to(FP8_DTYPE) if emulate else q), scales


def quantize_fp8_per_group(x: torch.Tensor, m_pad: int | None = None,
                           scales_m_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x [M, K] (fp32 / bf16 / fp16, unit stride on K) per row and 128-column group: (q e4m3
    [m_pad, K], scales fp32 [m_pad, G]) with the numbers of ``fp8.quantize_fp8_per_group_ref`` for the first
    M rows; rows M..m_pad-1 (m_pad >= M, default M) are q = 0, scale = 1e-10 / 448. ``scales_m_major``: the
    scales tensor has strides (1, m_pad) (cuBLAS's 1 x 128 layout), else it is contiguous. Triton where
    ``use_triton(x)``, else torch. Raises ValueError for a bad x or m_pad < M."""
    if use_triton(x):
        return quantize_fp8_per_group_triton(x, m_pad, scales_m_major)
    m, k, m_pad = _check_quant(x, m_pad)
    q, s = quantize_fp8_per_group_ref(x, GROUP)
    groups = s.shape[1]
    q_out = torch.zeros(m_pad, k, dtype=FP8_DTYPE, device=x.device)
    s_out = (torch.empty(groups, m_pad, dtype=torch.float32, device=x.device).t() if scales_m_major
             else torch.empty(m_pad, groups, dtype=torch.float32, device=x.device))
    q_out[:m] = q
    s_out.fill_(AMAX_EPS / FP8_MAX)
    s_out[:m] = s
    return q_out, s_out


def _check_quant(x: torch.Tensor, m_pad: int | None) -> tuple[int, int, int]:
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or (x.numel() and x.stride(1) != 1):
        raise ValueError(f"quantize_fp8_per_group: x must be a 2-D fp32 / bf16 / fp16 tensor with unit stride on K, "
                         f"got {tuple(x.shape)} {x.dtype} strides {x.stride()}")
    m, k = x.shape
    m_pad = m if m_pad is None else m_pad
    if m_pad < m:
        raise ValueError(f"quantize_fp8_per_group: m_pad {m_pad} < rows {m}")
    return m, k, m_pad


def scaled_mm_supported(device: torch.device) -> bool:
    """Whether cuBLAS's block-scaled FP8 GEMM runs on ``device``: CUDA >= 12.9, compute capability 9.x,
    ``torch.nn.functional.scaled_mm`` present, Triton not the interpreter."""
    if device.type != "cuda" or interpreting() or not hasattr(F, "scaled_mm") or _CUDA_VERSION < (12, 9):
        return False
    return device_capability(device)[0] == 9


def scaled_mm_fits(k: int, n: int) -> bool:
    """Whether a [N, K] FP8 weight takes ``fp8_scaled_mm``: K and N multiples of 16 (cuBLASLt's 16-byte
    alignment of e4m3 rows). A ragged last 128-group of K has its own scales on both sides (H200: K = 2112
    matched ``fp8_gemm_ref`` to NMSE 4.8e-7, ``kernels_micro.py fp8_linears``)."""
    return k > 0 and k % 16 == 0 and n > 0 and n % 16 == 0


def scaled_mm_weight_scale(w_scale: torch.Tensor) -> torch.Tensor:
    """w_scale [NB, G] fp32 (``weight_scale_inv``) -> the [L4, NB] operand cuBLAS reads: G padded with ones to
    a multiple of 4, stored [NB, L4] row-major and returned transposed (strides (1, L4)). Made once at load."""
    if w_scale.dim() != 2 or w_scale.dtype != torch.float32:
        raise ValueError(f"scaled_mm_weight_scale: w_scale must be 2-D fp32, got {tuple(w_scale.shape)} {w_scale.dtype}")
    nb, groups = w_scale.shape
    padded = torch.ones(nb, -(-groups // 4) * 4, dtype=torch.float32, device=w_scale.device)
    padded[:, :groups] = w_scale
    return padded.t()


def fp8_scaled_mm(x: torch.Tensor, w: torch.Tensor, w_scale_mm: torch.Tensor,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = quant(x) @ dequant(w).T on cuBLAS (see the module doc): x [M, K] float, w [N, K] e4m3, w_scale_mm
    from ``scaled_mm_weight_scale`` -> [M, N] ``out_dtype`` (default x's dtype; bf16 or fp32). Raises ValueError
    on shapes cuBLAS does not take (``scaled_mm_fits``), a non-float x, a w_scale_mm not in that layout or
    another out_dtype, and RuntimeError where ``scaled_mm_supported`` is False."""
    if x.dim() != 2 or w.dim() != 2 or w.shape[1] != x.shape[1] or w.dtype != FP8_DTYPE \
            or not scaled_mm_fits(x.shape[1], w.shape[0]):
        raise ValueError(f"fp8_scaled_mm: need x [M, K], w [N, K] e4m3 with K and N multiples of 16, got "
                         f"x {tuple(x.shape)}, w {tuple(w.shape)} {w.dtype}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"fp8_scaled_mm: x must be fp32 / bf16 / fp16 (it is quantized here), got {x.dtype}")
    groups = -(-x.shape[1] // GROUP)
    want = (-(-groups // 4) * 4, -(-w.shape[0] // GROUP))  # [L4, NB]
    if tuple(w_scale_mm.shape) != want or w_scale_mm.dtype != torch.float32 or w_scale_mm.stride(0) != 1:
        raise ValueError(f"fp8_scaled_mm: w_scale_mm must be fp32 {want} with stride (1, {want[0]}) (make it with "
                         f"scaled_mm_weight_scale(weight_scale_inv)), got {tuple(w_scale_mm.shape)} "
                         f"{w_scale_mm.dtype} strides {w_scale_mm.stride()}")
    out_dtype = out_dtype or x.dtype
    if out_dtype not in SCALED_MM_OUT_DTYPES:
        raise ValueError(f"fp8_scaled_mm: out_dtype {out_dtype} not supported (bf16, fp32)")
    if not scaled_mm_supported(x.device):
        raise RuntimeError(f"fp8_scaled_mm: cuBLAS block-scaled FP8 GEMM is not available on {x.device} "
                           f"(needs compute capability 9.x and CUDA >= 12.9, torch {torch.__version__})")
    m = x.shape[0]
    m4 = max(4, -(-m // 4) * 4)
    q, xs = quantize_fp8_per_group(x, m4, scales_m_major=True)
    y = F.scaled_mm(q, w.t(), xs, F.ScalingType.BlockWise1x128, w_scale_mm, F.ScalingType.BlockWise128x128,
                    output_dtype=out_dtype)
    return y if m4 == m else y[:m]
