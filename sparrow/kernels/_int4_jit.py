"""Triton bodies of the int4 W4A16 kernels (launchers: ``sparrow.kernels.int4``, ``sparrow.kernels.int4_moe``).

Weights are ``sparrow.kernels.int4``'s layout: codes u packed 8 per int32 along K, scale / zero per ``group``
columns; each tile is dequantized in registers, w = (u - zero) * scale in fp32, rounded as the torch twin
rounds it (to the scale dtype, then to the activation dtype: W_ROUND 0 none, 1 bf16, 2 fp16, 3 fp16 then
bf16), and multiplied with fp32 accumulation. Under TRITON_INTERPRET (``RNE``, ``RNE_OUT`` for bf16 outputs) bf16
rounding is done in fp32 arithmetic and dots run on fp32 operands (``_fp8_jit``'s note on the interpreter).
"""
import triton
import triton.language as tl

from sparrow.kernels._fp8_jit import rne_bf16 as _rne_bf16
from sparrow.kernels._moe_jit import _epilogue


@triton.jit
def _round_w(w, W_ROUND: tl.constexpr, RNE: tl.constexpr):
    if W_ROUND >= 2:
        w = w.to(tl.float16).to(tl.float32)
    if W_ROUND == 1 or W_ROUND == 3:
        if RNE:
            w = _rne_bf16(w)
        else:
            w = w.to(tl.bfloat16).to(tl.float32)
    return w


@triton.jit
def _dequant_tile(w_ptr, s_ptr, z_ptr, rn, n_mask, rk, k_mask, stride_w, stride_s, stride_z, group,
                  HAS_ZERO: tl.constexpr, W_ROUND: tl.constexpr, RNE: tl.constexpr):
    """The weight tile [BN, BK] (rows rn, columns rk) in fp32, rounded as the twin rounds it."""
    mask = n_mask[:, None] & k_mask[None, :]
    rows = rn[:, None].to(tl.int64)
    words = tl.load(w_ptr + rows * stride_w + (rk // 8)[None, :], mask=mask, other=0)
    u = (words >> ((rk % 8) * 4)[None, :]) & 0xF
    gi = (rk // group)[None, :]
    scale = tl.load(s_ptr + rows * stride_s + gi, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZERO:
        zero = tl.load(z_ptr + rows * stride_z + gi, mask=mask, other=8).to(tl.float32)
    else:
        zero = 8.0
    return _round_w((u.to(tl.float32) - zero) * scale, W_ROUND, RNE)


@triton.jit
def int4_matmul_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, R, N, K, stride_x, stride_w, stride_s, stride_z, stride_y,
                       group, HAS_ZERO: tl.constexpr, W_ROUND: tl.constexpr, RNE: tl.constexpr,
                       RNE_OUT: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y [R, N] = x [R, K] @ w.T; grid (cdiv(N, BLOCK_N), cdiv(R, BLOCK_M)). At R <= 16 (one M tile, the GEMV
    configs) every weight element is read once for all rows."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = rn < N
    m_mask = rm < R
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < K
        a = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_x + rk[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = _dequant_tile(w_ptr, s_ptr, z_ptr, rn, n_mask, rk, k_mask, stride_w, stride_s, stride_z, group,
                          HAS_ZERO, W_ROUND, RNE)
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w.to(x_ptr.dtype.element_ty)))
    out = acc
    if RNE_OUT:
        out = _rne_bf16(out)
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_y + rn[None, :], out.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def int4_moe_pair_kernel(a_ptr, w_ptr, s_ptr, z_ptr, c_ptr, ids_ptr, N, K, a_row_div, stride_a,
                         stride_we, stride_wn, stride_se, stride_sn, group, limit,
                         GATED: tl.constexpr, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_ZERO: tl.constexpr,
                         W_ROUND: tl.constexpr, RNE: tl.constexpr, RNE_OUT: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """The small MoE path, one program per (pair, N tile): c[p, n] = act(gate) * up (GATED, rows n and N + n of
    expert ids[p]) or the plain product, of a's row p // a_row_div; grid (P, cdiv(N, BLOCK_N)). Zero points share
    the scales' strides."""
    p = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    e = tl.load(ids_ptr + p).to(tl.int64)
    w_e = w_ptr + e * stride_we
    s_e = s_ptr + e * stride_se
    z_e = z_ptr + e * stride_se
    row = (p // a_row_div).to(tl.int64)
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < K
        a = tl.load(a_ptr + row * stride_a + rk, mask=k_mask, other=0.0).to(tl.float32)
        w = _dequant_tile(w_e, s_e, z_e, rn, n_mask, rk, k_mask, stride_wn, stride_sn, stride_sn, group,
                          HAS_ZERO, W_ROUND, RNE)
        acc_g += tl.sum(w * a[None, :], axis=1)
        if GATED:
            w = _dequant_tile(w_e, s_e, z_e, rn + N, n_mask, rk, k_mask, stride_wn, stride_sn, stride_sn, group,
                              HAS_ZERO, W_ROUND, RNE)
            acc_u += tl.sum(w * a[None, :], axis=1)
    pair = p + tl.arange(0, 1)
    _epilogue(acc_g[None, :], acc_u[None, :], c_ptr, pair, pair >= 0, rn, n_mask, N, limit, GATED, ACT,
              HAS_LIMIT, RNE_OUT, c_ptr, False)


@triton.jit
def int4_dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, stride_w, stride_s, group,
                        HAS_ZERO: tl.constexpr, W_ROUND: tl.constexpr, RNE: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out [N, K] (the activation dtype) = the dequantized rows of a contiguous [N, K / 8] weight (stacked experts
    flattened to E N rows); grid (cdiv(N, BLOCK_N), cdiv(K, BLOCK_K))."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask = rn < N
    k_mask = rk < K
    w = _dequant_tile(w_ptr, s_ptr, z_ptr, rn, n_mask, rk, k_mask, stride_w, stride_s, stride_s, group,
                      HAS_ZERO, W_ROUND, RNE)
    tl.store(out_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], w.to(out_ptr.dtype.element_ty),
             mask=n_mask[:, None] & k_mask[None, :])
