"""Triton body of the small-row GEMV (launcher and torch twin: ``sparrow.kernels.gemv``).

Shapes: R = rows (<= 16), K = input width, N = output width; x [R, K], w [N, K] (row-major, the
nn.Linear layout), y [R, N]; FP8 weights carry block scales s [ceil(N/128), ceil(K/128)] fp32.
One program owns BLOCK_N output columns for *all* R rows and walks K in BLOCK_K steps, so each weight
element is read from memory exactly once per call (decode is bound by those bytes).
"""
import triton
import triton.language as tl


@triton.jit
def gemv_kernel(
    x_ptr,  # [R, K], unit stride on K
    w_ptr,  # [N, K], unit stride on K; x's dtype, or e4m3 when FP8_W
    s_ptr,  # [ceil(N/128), ceil(K/128)] fp32 contiguous, or dummy when not FP8_W
    y_ptr,  # [R, N] contiguous, x's dtype
    R,
    N,
    K,
    stride_xr,
    stride_wn,
    stride_sn,
    FP8_W: tl.constexpr,
    USE_DOT: tl.constexpr,  # tensor-core tl.dot on a [BLOCK_R >= 16, BLOCK_K] x [BLOCK_K, BLOCK_N] tile
    IEEE: tl.constexpr,  # fp32 operands: exact fp32 products in tl.dot, not tf32
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides 128 when FP8_W, so a K step stays inside one scale block
):
    pid = tl.program_id(0)
    rr = tl.arange(0, BLOCK_R)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    r_mask = rr < R
    n_mask = rn < N
    acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_mask = kk < K
        x = tl.load(x_ptr + rr[:, None] * stride_xr + kk[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if FP8_W:
            w = w.to(x.dtype)  # e4m3 -> bf16 / fp16 / fp32 is exact; the block scale is applied per K step
        if USE_DOT:
            if IEEE:
                part = tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                part = tl.dot(x, tl.trans(w))
        else:
            part = tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        if FP8_W:
            s = tl.load(s_ptr + (rn // 128) * stride_sn + k0 // 128, mask=n_mask, other=0.0)
            part = part * s[None, :]
        acc += part
    tl.store(y_ptr + rr[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=r_mask[:, None] & n_mask[None, :])
