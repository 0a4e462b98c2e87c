"""Gated activations of a fused gate|up projection: y = act(gate) * up, math in fp32, one rounding.

Shapes: R = rows, I = intermediate width. x [R, 2I] = [gate | up] (the ``gate_up_proj`` output),
y [R, I] in x's dtype.

    silu_and_mul(x)       act = silu(g) = g * sigmoid(g)                       (Llama, Qwen, Mixtral, DeepSeek)
    gelu_tanh_and_mul(x)  act = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))  (Gemma: gelu_pytorch_tanh)

Each has a torch twin (``*_ref``, the CPU path and the oracle), a Triton launcher (``*_triton``) with the
same signature, and a dispatcher: Triton for CUDA tensors or under ``sparrow.kernels.backend("triton")``, else the twin.
Unlike HF's ``act(gate) * up`` in bf16 (two roundings), these round once, as vLLM's kernels do.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sparrow.kernels import pdl_kwargs, use_triton


# (largest I, BLOCK_I, num_warps): one program per (row, BLOCK_I outputs).
ACT_CONFIGS: tuple[tuple[int, int, int], ...] = ((512, 512, 2), (2048, 1024, 4), (1 << 62, 2048, 8))

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [R, 2I] -> silu(x[:, :I]) * x[:, I:] as [R, I] in x's dtype (fp32 math). Raises ValueError."""
    gate, up = _split(x, "silu_and_mul")
    return (F.silu(gate.float()) * up.float()).to(x.dtype)


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [R, 2I] -> gelu_tanh(x[:, :I]) * x[:, I:] as [R, I] in x's dtype (fp32 math). Raises ValueError."""
    gate, up = _split(x, "gelu_tanh_and_mul")
    return (F.gelu(gate.float(), approximate="tanh") * up.float()).to(x.dtype)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton launcher of ``silu_and_mul_ref`` (same contract)."""
    from sparrow.kernels._act_jit import SILU

    return _launch(x, SILU, "silu_and_mul")


def gelu_tanh_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton launcher of ``gelu_tanh_and_mul_ref`` (same contract)."""
    from sparrow.kernels._act_jit import GELU_TANH

    return _launch(x, GELU_TANH, "gelu_tanh_and_mul")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x [R, 2I] -> [R, I]; Triton by use_triton (CUDA, or forced), else the twin."""
    return silu_and_mul_triton(x) if use_triton(x) else silu_and_mul_ref(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up of x [R, 2I] -> [R, I]; Triton by use_triton (CUDA, or forced), else the twin."""
    return gelu_tanh_and_mul_triton(x) if use_triton(x) else gelu_tanh_and_mul_ref(x)


def _split(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2 or x.shape[1] % 2 != 0:
        raise ValueError(f"{name}: x must be [R, 2I] with an even last dim, got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: x dtype {x.dtype} not supported (fp32, bf16, fp16)")
    if x.stride(1) != 1:
        raise ValueError(f"{name}: x must have unit stride on its last dim, got strides {x.stride()}")
    half = x.shape[1] // 2
    return x[:, :half], x[:, half:]


def _launch(x: torch.Tensor, act: int, name: str) -> torch.Tensor:
    from sparrow.kernels._act_jit import act_and_mul_kernel

    _split(x, name)
    rows, inter = x.shape[0], x.shape[1] // 2
    y = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    if rows == 0 or inter == 0:
        return y
    _, block, num_warps = next(c for c in ACT_CONFIGS if inter <= c[0])
    block = min(block, _next_pow2(inter))
    grid = (rows, -(-inter // block))
    act_and_mul_kernel[grid](x, y, inter, x.stride(0), ACT=act, BLOCK_I=block, num_warps=num_warps, **pdl_kwargs(x))
    return y


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
