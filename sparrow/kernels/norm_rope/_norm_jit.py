"""Triton body of the fused RMSNorm (launcher and torch twin: ``sparrow.kernels.norm_rope.norm``).

Shapes: R = rows, nH = heads per row (1 for a plain [R, H] norm), H = normalized width,
G = ceil(H / GROUP) column groups per row. One program normalizes one (row, head) vector of H elements,
held in registers as a [BLOCK_G, GROUP] tile.
Under PDL the norm weights and post_scale are read before ``pdl_enter``: they must be tensors that the kernel
launched just before this one does not write (model parameters). Every other input is read right after it.
"""
import triton
import triton.language as tl

from sparrow.kernels.common._pdl_jit import pdl_enter


@triton.jit
def _weighted(xhat, w, dt: tl.constexpr, GEMMA: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """The normalized fp32 xhat times the fp32 weight w, rounded to dt by the convention (module doc)."""
    if GEMMA:
        if UNIT_OFFSET:
            return (xhat * (1.0 + w)).to(dt)
        else:
            return (xhat * w).to(dt)
    else:
        return (xhat.to(dt).to(tl.float32) * w).to(dt)


@triton.jit
def rms_norm_kernel(
    x_ptr,  # [R, nH, H] any strides with unit stride on H; dtype = output dtype
    res_ptr,  # [R, H] contiguous, or dummy when not HAS_RESIDUAL
    w_ptr,  # [H] any float dtype, or dummy when not HAS_WEIGHT
    y_ptr,  # [R, nH, H] contiguous, x's dtype
    res_out_ptr,  # [R, H] contiguous x + residual in x's dtype, or dummy
    post_add_ptr,  # [R, H] contiguous, x's dtype, or dummy when not HAS_POST_ADD
    post_scale_ptr,  # [1] float, or dummy when not HAS_POST_SCALE
    pre_w_ptr,  # [H] any float dtype, or dummy when not HAS_PRE
    pre_add_ptr,  # [R, H] contiguous, x's dtype, or dummy when not HAS_PRE
    pre_add_w_ptr,  # [H] any float dtype, or dummy when not PRE_ADD_NORM
    next_w1_ptr,  # [H] any float dtype, or dummy when NUM_NEXT < 1
    next_w2_ptr,  # [H] any float dtype, or dummy when NUM_NEXT < 2
    next_y1_ptr,  # [R, H] contiguous, x's dtype, or dummy when NUM_NEXT < 1
    next_y2_ptr,  # [R, H] contiguous, x's dtype, or dummy when NUM_NEXT < 2
    pair_w_ptr,  # [R, TOPK] routing weights, unit stride on TOPK, or dummy when TOPK == 0
    stride_pw,
    H,
    NUM_HEADS,
    stride_xr,
    stride_xh,
    eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    GEMMA: tl.constexpr,  # fp32 multiply then cast (Gemma) vs cast then multiply (Llama)
    UNIT_OFFSET: tl.constexpr,  # with GEMMA: multiply by (1 + w) (Gemma 1-3) instead of w (Gemma 4)
    HAS_POST_ADD: tl.constexpr,  # y = post_add + y (rounded), the post-norm residual add (Gemma 2-4)
    HAS_POST_SCALE: tl.constexpr,  # y = y * post_scale (rounded), Gemma 4's layer_scalar
    HAS_PRE: tl.constexpr,  # x = pre_add + norm(x, pre_w) (rounded) first: a second sandwich norm (Gemma 4)
    PRE_ADD_NORM: tl.constexpr,  # with HAS_PRE: pre_add is normalized too, norm(pre_add, pre_add_w) (rounded)
    NUM_NEXT: tl.constexpr,  # 0-2 further norms of the output y, norm(y, next_w_i) -> next_y_i (same eps)
    TOPK: tl.constexpr,  # > 0: x is [R * TOPK, H] per-pair expert outputs, x = sum_k w[r, k] x[r TOPK + k] (moe_reduce)
    BLOCK_G: tl.constexpr,
    GROUP: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # launched with launch_pdl (sparrow.kernels.use_pdl)
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    dt = x_ptr.dtype.element_ty
    g = tl.arange(0, BLOCK_G)
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [BLOCK_G, GROUP]
    mask = cols < H
    # The norm weights and post_scale are parameters no kernel writes: loaded before the PDL wait, so their
    # memory latency overlaps the previous kernel's tail instead of following the reductions one by one.
    if HAS_WEIGHT:
        w_raw = tl.load(w_ptr + cols, mask=mask, other=0.0)
    if HAS_PRE:
        pre_w_raw = tl.load(pre_w_ptr + cols, mask=mask, other=0.0)
        if PRE_ADD_NORM:
            a_w_raw = tl.load(pre_add_w_ptr + cols, mask=mask, other=0.0)
    if HAS_POST_SCALE:
        post_scale = tl.load(post_scale_ptr).to(tl.float32)
    if NUM_NEXT > 0:
        w1_raw = tl.load(next_w1_ptr + cols, mask=mask, other=0.0)
        if NUM_NEXT > 1:
            w2_raw = tl.load(next_w2_ptr + cols, mask=mask, other=0.0)
    pdl_enter(USE_PDL)
    # The addends earlier kernels wrote: all loaded right after the wait, before the first reduction (whose
    # barriers would otherwise put each load's latency after the one before it).
    if HAS_PRE:
        a_raw = tl.load(pre_add_ptr + row * H + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r_raw = tl.load(res_ptr + row * H + cols, mask=mask, other=0.0)
    if HAS_POST_ADD:
        b_raw = tl.load(post_add_ptr + row * H + cols, mask=mask, other=0.0)

    if TOPK > 0:
        # the experts' weighted reduce, as moe_reduce_kernel: fp32 in slot order, rounded once
        x = tl.zeros([BLOCK_G, GROUP], dtype=tl.float32)
        for k in tl.static_range(TOPK):
            wk = tl.load(pair_w_ptr + row * stride_pw + k).to(tl.float32)
            x += wk * tl.load(x_ptr + (row * TOPK + k) * stride_xr + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(dt).to(tl.float32)
    else:
        x = tl.load(x_ptr + row * stride_xr + head * stride_xh + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_PRE:
        pre_hat = x * tl.rsqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / H + eps)
        pre_w = pre_w_raw.to(tl.float32)
        t = _weighted(pre_hat, pre_w, dt, GEMMA, UNIT_OFFSET)
        a = a_raw.to(tl.float32)
        if PRE_ADD_NORM:
            a_hat = a * tl.rsqrt(tl.sum(tl.sum(a * a, axis=1), axis=0) / H + eps)
            a_w = a_w_raw.to(tl.float32)
            a = _weighted(a_hat, a_w, dt, GEMMA, UNIT_OFFSET).to(tl.float32)
        x = (a + t.to(tl.float32)).to(dt).to(tl.float32)
    if HAS_RESIDUAL:
        # HF adds the residual in the model dtype: round the sum, store it, normalize the rounded value.
        r = r_raw.to(tl.float32)
        s = (x + r).to(dt)
        tl.store(res_out_ptr + row * H + cols, s, mask=mask)
        x = s.to(tl.float32)

    var = tl.sum(tl.sum(x * x, axis=1), axis=0) / H
    xhat = x * tl.rsqrt(var + eps)

    if HAS_WEIGHT:
        w = w_raw.to(tl.float32)
        y = _weighted(xhat, w, dt, GEMMA, UNIT_OFFSET)
    else:
        y = xhat.to(dt)

    if HAS_POST_ADD:
        b = b_raw.to(tl.float32)
        y = (y.to(tl.float32) + b).to(dt)
    if HAS_POST_SCALE:
        y = (y.to(tl.float32) * post_scale).to(dt)

    out_row = row * NUM_HEADS + head
    tl.store(y_ptr + out_row * H + cols, y, mask=mask)
    if NUM_NEXT > 0:
        # the next sandwich norms read the stored (rounded) y; they share its mean square, not their weights
        yf = y.to(tl.float32)
        y_hat = yf * tl.rsqrt(tl.sum(tl.sum(yf * yf, axis=1), axis=0) / H + eps)
        w1 = w1_raw.to(tl.float32)
        tl.store(next_y1_ptr + out_row * H + cols, _weighted(y_hat, w1, dt, GEMMA, UNIT_OFFSET), mask=mask)
        if NUM_NEXT > 1:
            w2 = w2_raw.to(tl.float32)
            tl.store(next_y2_ptr + out_row * H + cols, _weighted(y_hat, w2, dt, GEMMA, UNIT_OFFSET), mask=mask)
