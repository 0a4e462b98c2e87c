"""Triton body of the fused MoE router (launcher and torch twin: ``sparrow.kernels.moe.router``).

Shapes: R = rows, E = experts, K = top-k, G = expert groups (1 without grouped top-k), E / G = experts per
group. One program routes one row: its logits are held as a [G_PAD, PER_PAD] tile (expert
e = g * (E / G) + j), so grouped top-k needs no reshape. Formulas: ``sparrow.layers.router``.
"""
import triton
import triton.language as tl

from sparrow.kernels.common._pdl_jit import pdl_enter
from sparrow.kernels.common._split_k_jit import split_k_and, split_k_arrive, split_k_range, split_k_store, split_k_sum

SOFTMAX = 0
SIGMOID = 1
SQRTSOFTPLUS = 2


@triton.jit
def router_kernel(
    logits_ptr,  # [R, E], unit stride on E, any float dtype
    bias_ptr,  # [E] fp32 e_score_correction_bias, or dummy
    scale_ptr,  # [E] per_expert_scale, or dummy
    w_ptr,  # [R, K] fp32 out
    ids_ptr,  # [R, K] int32 / int64 out
    stride_lr,
    routed_scaling,
    SCORING: tl.constexpr,  # SOFTMAX / SIGMOID / SQRTSOFTPLUS
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    RENORM: tl.constexpr,
    TOPK: tl.constexpr,
    K_PAD: tl.constexpr,
    N_GROUP: tl.constexpr,  # 1: no grouped top-k
    TOPK_GROUP: tl.constexpr,
    PER_GROUP: tl.constexpr,  # E // N_GROUP
    G_PAD: tl.constexpr,
    PER_PAD: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # launched with launch_pdl (sparrow.kernels.use_pdl)
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, G_PAD)
    j = tl.arange(0, PER_PAD)
    e = g[:, None] * PER_GROUP + j[None, :]  # [G_PAD, PER_PAD] expert id
    valid = (g[:, None] < N_GROUP) & (j[None, :] < PER_GROUP)
    x = tl.load(logits_ptr + row * stride_lr + e, mask=valid, other=0.0).to(tl.float32)
    if SCORING == 0:
        xm = tl.where(valid, x, float("-inf"))
        m = tl.max(tl.max(xm, axis=1), axis=0)
        p = tl.where(valid, tl.exp(xm - m), 0.0)
        s = p / tl.sum(tl.sum(p, axis=1), axis=0)
    elif SCORING == 1:
        s = 1.0 / (1.0 + tl.exp(-x))
    else:
        # softplus with torch's threshold 20; log1p(u) = log(1 + u) * u / ((1 + u) - 1) keeps full precision
        # for tiny u (Goldberg's trick), where log(1 + u) alone would round 1 + u away.
        u = tl.exp(tl.minimum(x, 20.0))
        v = 1.0 + u
        lp = tl.where(v == 1.0, u, tl.log(v) * (u / tl.where(v == 1.0, 1.0, v - 1.0)))
        s = tl.sqrt(tl.where(x > 20.0, x, lp))
    s = tl.where(valid, s, 0.0)
    choice = s
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    if N_GROUP > 1:
        # a group scores the sum of its top-2 choices; keep the best TOPK_GROUP groups (lowest index on ties)
        top1 = tl.max(choice, axis=1)  # [G_PAD]
        arg1 = tl.min(tl.where(choice == top1[:, None], j[None, :], PER_PAD), axis=1)
        if PER_GROUP > 1:
            top2 = tl.max(tl.where(j[None, :] == arg1[:, None], float("-inf"), choice), axis=1)
            gscore = top1 + top2
        else:
            gscore = top1
        gscore = tl.where(g < N_GROUP, gscore, float("-inf"))
        keep = g < 0
        for _t in tl.static_range(TOPK_GROUP):
            gs = tl.where(keep, float("-inf"), gscore)
            best = tl.max(gs, axis=0)
            gi = tl.min(tl.where(gs == best, g, G_PAD), axis=0)
            keep = keep | (g == gi)
        choice = tl.where(keep[:, None], choice, float("-inf"))
    kk = tl.arange(0, K_PAD)
    ids = tl.zeros([K_PAD], dtype=tl.int32)
    wts = tl.zeros([K_PAD], dtype=tl.float32)
    big = G_PAD * PER_PAD
    for t in tl.static_range(TOPK):
        best = tl.max(tl.max(choice, axis=1), axis=0)
        idx = tl.min(tl.min(tl.where(choice == best, e, big), axis=1), axis=0)  # lowest id among ties
        hit = e == idx
        wt = tl.sum(tl.sum(tl.where(hit, s, 0.0), axis=1), axis=0)
        choice = tl.where(hit, float("-inf"), choice)
        ids = tl.where(kk == t, idx, ids)
        wts = tl.where(kk == t, wt, wts)
    kmask = kk < TOPK
    if RENORM:
        wts = wts / (tl.sum(tl.where(kmask, wts, 0.0), axis=0) + 1e-20)
    wts = wts * routed_scaling
    if HAS_SCALE:
        wts = wts * tl.load(scale_ptr + ids, mask=kmask, other=0.0).to(tl.float32)
    tl.store(w_ptr + row * TOPK + kk, wts, mask=kmask)
    tl.store(ids_ptr + row * TOPK + kk, ids.to(ids_ptr.dtype.element_ty), mask=kmask)


@triton.jit
def router_logits_kernel(
    x_ptr,  # [R, H], unit stride on H, any float dtype
    w_ptr,  # [E, H], unit stride on H, any float dtype (read as fp32)
    out_ptr,  # [R, E] fp32 contiguous
    ws_ptr,  # SPLIT_K > 1: fp32 partials, (1 + RMS_NORM) * SPLIT_K * BLOCK_R * BLOCK_E per tile; else dummy
    lock_ptr,  # SPLIT_K > 1: int32 [tiles] counters, 0 on entry and on exit; else dummy
    R,
    E,
    H,
    stride_xr,
    stride_we,
    eps,
    RMS_NORM: tl.constexpr,  # scale-free RMSNorm of x first (Gemma 4): logits * rsqrt(mean(x^2) + eps)
    BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SPLIT_K: tl.constexpr = 1,  # programs per (row tile, expert tile) (grid axis 2), each over a contiguous H range
    USE_PDL: tl.constexpr = False,  # launched with launch_pdl (sparrow.kernels.use_pdl)
):
    """logits[r, e] = sum_h x[r, h] * w[e, h] in fp32 for a [BLOCK_R, BLOCK_E] tile; grid (E / BLOCK_E,
    R / BLOCK_R, SPLIT_K). Products go into a [BLOCK_R, BLOCK_E, BLOCK_H] fp32 accumulator summed over H once,
    after the loop. With RMS_NORM the per-row factor rsqrt(mean(x^2) + eps) multiplies the dot (norm(x) . w
    = rsqrt(..) * (x . w)), its sum of squares taken in the same pass over x. With SPLIT_K > 1 the H splits
    (dot and sum of squares) are reduced in the kernel (``_split_k_jit``) before the factor is applied."""
    pdl_enter(USE_PDL)
    pid_e = tl.program_id(0)
    pid_r = tl.program_id(1)
    pid_k = tl.program_id(2)
    re = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    rr = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rh = tl.arange(0, BLOCK_H)
    r_mask = rr < R
    e_mask = re < E
    acc3 = tl.zeros([BLOCK_R, BLOCK_E, BLOCK_H], dtype=tl.float32)
    ss2 = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    h_start, h_end = split_k_range(H, pid_k, SPLIT_K, BLOCK_H)
    for h0 in range(h_start, h_end, BLOCK_H):
        hh = h0 + rh
        h_mask = hh < h_end
        x = tl.load(x_ptr + rr[:, None].to(tl.int64) * stride_xr + hh[None, :],
                    mask=r_mask[:, None] & h_mask[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + re[:, None] * stride_we + hh[None, :],
                    mask=e_mask[:, None] & h_mask[None, :], other=0.0).to(tl.float32)
        acc3 += x[:, None, :] * w[None, :, :]
        if RMS_NORM:
            ss2 += x * x
    acc = tl.sum(acc3, axis=2)
    ss = tl.sum(ss2, axis=1)
    mask = r_mask[:, None] & e_mask[None, :]
    if SPLIT_K > 1:
        tile = pid_r * tl.num_programs(0) + pid_e
        NACC: tl.constexpr = 2 if RMS_NORM else 1
        split_k_store(acc, ws_ptr, (tile * SPLIT_K + pid_k) * NACC, BLOCK_R, BLOCK_E)
        if RMS_NORM:  # each row's partial sum of squares, in every column of a second partial tile
            split_k_store(ss[:, None] + tl.zeros([BLOCK_R, BLOCK_E], dtype=tl.float32), ws_ptr,
                          (tile * SPLIT_K + pid_k) * NACC + 1, BLOCK_R, BLOCK_E)
        last = split_k_arrive(lock_ptr, tile, SPLIT_K)
        acc = split_k_sum(ws_ptr, tile * SPLIT_K * NACC, last, SPLIT_K, NACC, BLOCK_R, BLOCK_E)
        if RMS_NORM:
            ss = tl.max(split_k_sum(ws_ptr, tile * SPLIT_K * NACC + 1, last, SPLIT_K, NACC, BLOCK_R, BLOCK_E), axis=1)
        mask = split_k_and(mask, last)
    if RMS_NORM:
        acc = acc * (1.0 / tl.sqrt_rn(ss / H + eps))[:, None]
    tl.store(out_ptr + rr[:, None].to(tl.int64) * E + re[None, :], acc, mask=mask)
