"""Triton bodies of the fused MoE experts (launchers, tile choice and torch twins: ``sparrow.kernels.moe.moe``).

Shapes: R = rows, H = hidden, E = experts, K = top-k, I = expert width, P = R * K (row, expert) pairs
(pair p = row p // K, slot p % K), S = padded sorted length, NB = S // BLOCK_M blocks.
Weights: gate_up [E, 2I, H] (rows :I gate, I: up), down [E, H, I]; FP8 weights are e4m3 with
fp32 scales per 128 x 128 block, ``s [E, ceil(rows / 128), ceil(cols / 128)]`` (fp8.py's layout).

Kernels, one launch each:
- ``_align_jit``'s three kernels (``moe_align``): the pairs sorted by expert for the grouped path.
- ``moe_gemm_kernel``: grouped GEMM, program per (block of BLOCK_M sorted pairs, BLOCK_N outputs); GATED
  computes gate and up of x[pair // K] and stores act(gate) * up [P, I]; otherwise y = act[pair] @ down^T
  [P, H]. Each block reads only its expert's weights, so every expert's weights are read once per N tile.
- ``moe_gemv_kernel``: the small-batch path, no sort: program per (pair, BLOCK_N outputs, K split); the
  first pair of each expert (its leader) gathers all pairs routed to that expert into BLOCK_R dot rows and
  streams the expert's weight tile once for all of them; the other programs exit at once. With SPLIT_K > 1
  the K splits are reduced in the kernel (``_split_k_jit``) before the epilogue.
- ``moe_reduce_kernel``: out[r] = sum_k w[r, k] * y[r * K + k] (+ sigmoid(gate[r]) * shared[r]).

FP8 activations are quantized per 128-column group when the consumer loads them (the numbers of
``fp8.quantize_fp8_per_group_ref``: scale = max(amax, 1e-10) / 448, q = clamp(a / scale) rounded to
e4m3), so no fp8 copy of x or of the intermediate is written; or, on the grouped path with A_FP8 (large
batches, where every N tile would quantize the same rows again), by a launch of their own before the GEMM
(``scaled_mm.quantize_fp8_per_group``, the same numbers). Accumulation is fp32; act(gate) * up is
computed in fp32 from the accumulators and rounded once.

UPCAST / EMULATE_FP8 / RNE_BF16: the interpreter's workarounds (``_fp8_jit``).
"""
import triton
import triton.language as tl

from sparrow.kernels.common._fp8_jit import dot_upcast as _dot, quant_fp8 as _quant_fp8, rne_bf16 as _rne_bf16
from sparrow.kernels.common._pdl_jit import pdl_enter
from sparrow.kernels.common._split_k_jit import split_k_and, split_k_arrive, split_k_range, split_k_store, split_k_sum

SILU = 0
GELU_TANH = 1
GELU = 2


# ---------------------------------------------------------------------------------------------- helpers


@triton.jit
def _mm_rows(
    a_ptr, arow, m_mask, stride_ar,  # A rows arow [BM] (int64) of a [*, K]
    a_s_ptr, stride_asr,  # A_FP8: per-group scales [*, ceil(K / 128)] fp32 of a (unit last stride); else unused
    w_ptr, stride_wn,  # this expert's weight [N_w, K]
    s_ptr, stride_sn,  # this expert's block scales [ceil(N_w / 128), ceil(K / 128)] (FP8_W)
    rn, n_mask, N_UP, k_start, k_end,  # output columns [BN] (the up half starts N_UP weight rows further,
    # GATED) and the K range, k_start a multiple of BLOCK_K
    GATED: tl.constexpr, FP8_W: tl.constexpr, EMULATE_FP8: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
    SWAP_AB: tl.constexpr = False,  # dots as W [BN, SUB_K] @ A^T (the weight tile fills the MMA's M side;
    # few rows become its N side), accumulators [BN, BM], transposed once at the end
    A_FP8: tl.constexpr = False,  # FP8_W with a already quantized (e4m3) and its scales at a_s_ptr
):
    """(acc_gate, acc_up) [BM, BN] fp32 = A @ W[rn]^T (and A @ W[N_UP + rn]^T when GATED) over k_start:k_end."""
    if SWAP_AB:
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    rk = tl.arange(0, SUB_K)
    a_rows = a_ptr + arow[:, None] * stride_ar
    if SWAP_AB:  # [BN, SUB_K] weight tiles
        wg_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
        wu_rows = w_ptr + (rn[:, None] + N_UP).to(tl.int64) * stride_wn
    else:  # [SUB_K, BN]
        wg_rows = w_ptr + rn[None, :].to(tl.int64) * stride_wn
        wu_rows = w_ptr + (rn[None, :] + N_UP).to(tl.int64) * stride_wn
    for k0 in range(k_start, k_end, BLOCK_K):
        for j in tl.static_range(BLOCK_K // SUB_K):
            ks = k0 + j * SUB_K
            kk = ks + rk
            k_mask = kk < k_end
            a = tl.load(a_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            if SWAP_AB:
                wmask = n_mask[:, None] & k_mask[None, :]
                wg = tl.load(wg_rows + kk[None, :], mask=wmask, other=0.0)
                if GATED:
                    wu = tl.load(wu_rows + kk[None, :], mask=wmask, other=0.0)
            else:
                wmask = k_mask[:, None] & n_mask[None, :]
                wg = tl.load(wg_rows + kk[:, None], mask=wmask, other=0.0)
                if GATED:
                    wu = tl.load(wu_rows + kk[:, None], mask=wmask, other=0.0)
            if FP8_W:
                kb = tl.minimum(ks, k_end - 1) // 128  # a sub-step wholly past K adds 0; keep the scale in bounds
                if A_FP8:
                    aq = a
                    a_s = tl.load(a_s_ptr + arow * stride_asr + kb, mask=m_mask, other=0.0)
                else:
                    aq, a_s = _quant_fp8(a.to(tl.float32), EMULATE_FP8)
                sg = tl.load(s_ptr + (rn // 128) * stride_sn + kb, mask=n_mask, other=0.0)
                if GATED:
                    su = tl.load(s_ptr + ((rn + N_UP) // 128) * stride_sn + kb, mask=n_mask, other=0.0)
                if SWAP_AB:
                    aqt = tl.trans(aq)
                    acc_g += _dot(wg, aqt, UPCAST) * (sg[:, None] * a_s[None, :])
                    if GATED:
                        acc_u += _dot(wu, aqt, UPCAST) * (su[:, None] * a_s[None, :])
                else:
                    acc_g += _dot(aq, wg, UPCAST) * (a_s[:, None] * sg[None, :])
                    if GATED:
                        acc_u += _dot(aq, wu, UPCAST) * (a_s[:, None] * su[None, :])
            elif SWAP_AB:
                at = tl.trans(a)
                acc_g += _dot(wg, at, UPCAST)
                if GATED:
                    acc_u += _dot(wu, at, UPCAST)
            else:
                acc_g += _dot(a, wg, UPCAST)
                if GATED:
                    acc_u += _dot(a, wu, UPCAST)
    if SWAP_AB:  # one return statement: Triton 3.6 refuses returns of different shapes, even under a constexpr if
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    return acc_g, acc_u


@triton.jit
def _epilogue(acc_g, acc_u, c_ptr, pair, m_mask, rn, n_mask, N, limit,
              GATED: tl.constexpr, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, RNE_BF16: tl.constexpr,
              d_ptr, HAS_DELTA: tl.constexpr):
    """Store act(gate) * up (GATED; DeepSeek-V4's clamp with HAS_LIMIT) or the plain product at c[pair, rn].
    HAS_DELTA (GATED): d [P, 2N] fp32 per-pair LoRA deltas added to the gate (columns :N) and up (N:)
    accumulators before the activation."""
    if GATED:
        g = acc_g
        u = acc_u
        if HAS_DELTA:
            d_mask = m_mask[:, None] & n_mask[None, :]
            d_rows = d_ptr + pair[:, None].to(tl.int64) * (2 * N) + rn[None, :]
            g = g + tl.load(d_rows, mask=d_mask, other=0.0)
            u = u + tl.load(d_rows + N, mask=d_mask, other=0.0)
        if HAS_LIMIT:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        if ACT == 0:
            act = g / (1.0 + tl.exp(-g))  # silu
        elif ACT == 1:
            # gelu_tanh: 0.5 g (1 + tanh(z)) = g * sigmoid(2z), z = sqrt(2/pi) (g + 0.044715 g^3)
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            act = g / (1.0 + tl.exp(-2.0 * z))
        else:
            act = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))  # exact (erf) gelu
        out = act * u
    else:
        out = acc_g
    if RNE_BF16:
        out = _rne_bf16(out)
    ptrs = c_ptr + pair[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(ptrs, out.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _expert_leader(ids_ptr, p, P, P_PAD: tl.constexpr):
    """The small path's leader of pair p's expert: (q [P_PAD] pair ids, member [P_PAD]: the pairs routed to that
    expert, first: the lowest of them, mine: the expert). The leader (first == p) does the work for all of them."""
    q = tl.arange(0, P_PAD)
    eid = tl.load(ids_ptr + q, mask=q < P, other=-1)
    mine = tl.load(ids_ptr + p)
    member = (eid == mine) & (q < P)  # the pairs routed to this pair's expert
    first = tl.min(tl.where(member, q, P_PAD), axis=0)
    return q, member, first, mine


@triton.jit
def _leader_tiles(member, pid_n, pid_k, N, K, SPLIT_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """The leader's work: (count of its pairs, rank [P_PAD] of each among them, output columns rn [BN] and n_mask,
    chunk slots sl [BLOCK_R], this K split's k_start, k_end)."""
    count = tl.sum(member.to(tl.int32), axis=0)
    rank = tl.cumsum(member.to(tl.int32), axis=0) - 1
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    sl = tl.arange(0, BLOCK_R)
    k_start, k_end = split_k_range(K, pid_k, SPLIT_K, BLOCK_K)
    return count, rank, rn, n_mask, sl, k_start, k_end


@triton.jit
def _leader_chunk(q, member, rank, count, c0, sl, A_ROW_DIV):
    """The leader's pairs c0 .. c0 + BLOCK_R: (pair [BLOCK_R], m_mask, arow [BLOCK_R] int64: their rows of a)."""
    match = member[None, :] & (rank[None, :] == (c0 + sl)[:, None])  # [BLOCK_R, P_PAD]
    pair = tl.sum(tl.where(match, q[None, :], 0), axis=1)
    m_mask = (c0 + sl) < count
    arow = (pair // A_ROW_DIV).to(tl.int64)
    return pair, m_mask, arow


@triton.jit
def _chunk_split_k(acc_g, acc_u, m_mask, ws_ptr, lock_ptr, pair, sl, pid_n, pid_k, GATED: tl.constexpr,
                   SPLIT_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """The small path's in-kernel split-K reduce of a chunk (``_split_k_jit``): (acc_g, acc_u summed over the K
    splits, m_mask cleared in every program but the tile's last, which runs the epilogue)."""
    # the chunk's tile is named by its first pair (each pair is in one chunk of one expert)
    tile = tl.sum(tl.where(sl == 0, pair, 0), axis=0) * tl.num_programs(1) + pid_n
    NACC: tl.constexpr = 2 if GATED else 1
    split_k_store(acc_g, ws_ptr, (tile * SPLIT_K + pid_k) * NACC, BLOCK_R, BLOCK_N)
    if GATED:
        split_k_store(acc_u, ws_ptr, (tile * SPLIT_K + pid_k) * NACC + 1, BLOCK_R, BLOCK_N)
    last = split_k_arrive(lock_ptr, tile, SPLIT_K)
    acc_g = split_k_sum(ws_ptr, tile * SPLIT_K * NACC, last, SPLIT_K, NACC, BLOCK_R, BLOCK_N)
    if GATED:
        acc_u = split_k_sum(ws_ptr, tile * SPLIT_K * NACC + 1, last, SPLIT_K, NACC, BLOCK_R, BLOCK_N)
    return acc_g, acc_u, split_k_and(m_mask, last)


@triton.jit
def _grouped_program(total_ptr, BLOCK_M: tl.constexpr):
    """The grouped path's program: (pid_m its block of sorted pairs, pid_n its N tile, live: the block starts below
    the padded pair total)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    total = tl.load(total_ptr)
    return pid_m, pid_n, pid_m * BLOCK_M < total


@triton.jit
def _block_pairs(sorted_ptr, block_expert_ptr, pid_m, pid_n, P, N, A_ROW_DIV, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """The grouped path's block pid_m of sorted pairs: (expert int64, pair [BM] (P: padding), m_mask, arow [BM]
    int64: their rows of a, output columns rn [BN], n_mask)."""
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = pair < P
    arow = (pair // A_ROW_DIV).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    return expert, pair, m_mask, arow, rn, n_mask


# ----------------------------------------------------------------------------------------------- kernels


@triton.jit(do_not_specialize=["P"])  # step-varying counts: one variant (sparrow.engine.warmup)
def moe_gemm_kernel(
    a_ptr,  # GATED: x [R, H]; else the activations [P, I]; unit stride on the last dim (A_FP8: e4m3)
    a_s_ptr,  # A_FP8: a's per-group scales [rows of a, ceil(K / 128)] fp32, unit last stride; else dummy
    w_ptr,  # GATED: gate_up [E, 2I, H]; else down [E, H, I]; unit stride on the last dim
    s_ptr,  # FP8_W: block scales [E, ceil(N_w / 128), ceil(K / 128)] fp32, unit last stride; else dummy
    c_ptr,  # out [P, N] contiguous (GATED: N = I, else N = H), a's dtype
    d_ptr,  # HAS_DELTA: [P, 2N] fp32 LoRA deltas of gate|up (see _epilogue); else dummy
    sorted_ptr,  # [S] int32 sorted pair ids, P = padding
    block_expert_ptr,  # [NB] int32 expert of each block
    total_ptr,  # [1] int32 padded pair count
    P, N, K, A_ROW_DIV,  # A row of pair p = p // A_ROW_DIV (K = top-k for x, 1 for the activations)
    stride_ar, stride_asr, stride_we, stride_wn, stride_se, stride_sn,
    limit,
    GATED: tl.constexpr, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, FP8_W: tl.constexpr,
    EMULATE_FP8: tl.constexpr, UPCAST: tl.constexpr, RNE_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # launched with launch_pdl (sparrow.kernels.use_pdl)
    SWAP_AB: tl.constexpr = False,  # _mm_rows' swapped dots (the weight tile as the MMA's M side)
    A_FP8: tl.constexpr = False,  # FP8_W: a was quantized by its own launch (Tile.a_fp8)
    HAS_DELTA: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    pid_m, pid_n, live = _grouped_program(total_ptr, BLOCK_M)
    if live:
        expert, pair, m_mask, arow, rn, n_mask = _block_pairs(sorted_ptr, block_expert_ptr, pid_m, pid_n, P, N,
                                                              A_ROW_DIV, BLOCK_M, BLOCK_N)
        acc_g, acc_u = _mm_rows(
            a_ptr, arow, m_mask, stride_ar, a_s_ptr, stride_asr, w_ptr + expert * stride_we, stride_wn,
            s_ptr + expert * stride_se, stride_sn, rn, n_mask, N, 0, K,
            GATED, FP8_W, EMULATE_FP8, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K, SUB_K, SWAP_AB, A_FP8,
        )
        _epilogue(acc_g, acc_u, c_ptr, pair, m_mask, rn, n_mask, N, limit, GATED, ACT, HAS_LIMIT, RNE_BF16,
                  d_ptr, HAS_DELTA)


@triton.jit
def moe_gemv_kernel(
    a_ptr, w_ptr, s_ptr, c_ptr, d_ptr,  # as moe_gemm_kernel
    ids_ptr,  # [P] flattened topk_ids (int32 / int64)
    ws_ptr,  # SPLIT_K > 1: fp32 partials, (1 + GATED) * SPLIT_K * BLOCK_R * BLOCK_N per (pair, N tile); else dummy
    lock_ptr,  # SPLIT_K > 1: int32 [P * N tiles] counters, 0 on entry and on exit; else dummy
    P, N, K, A_ROW_DIV,
    stride_ar, stride_we, stride_wn, stride_se, stride_sn,
    limit,
    GATED: tl.constexpr, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, FP8_W: tl.constexpr,
    EMULATE_FP8: tl.constexpr, UPCAST: tl.constexpr, RNE_BF16: tl.constexpr,
    P_PAD: tl.constexpr,  # next power of two >= P
    BLOCK_R: tl.constexpr,  # dot rows per pass (>= 16); experts with more pairs loop
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
    SPLIT_K: tl.constexpr,  # programs per (pair, N tile) (grid axis 2), each over a contiguous K range
    SWAP_AB: tl.constexpr = False,  # _mm_rows' swapped dots (the weight tile as the MMA's M side)
    USE_PDL: tl.constexpr = False,  # launched with launch_pdl (sparrow.kernels.use_pdl)
    HAS_DELTA: tl.constexpr = False,
):
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    pdl_enter(USE_PDL)
    q, member, first, mine = _expert_leader(ids_ptr, p, P, P_PAD)
    if first == p:  # the expert's leader does the work for all its pairs
        count, rank, rn, n_mask, sl, k_start, k_end = _leader_tiles(member, pid_n, pid_k, N, K, SPLIT_K, BLOCK_R,
                                                                    BLOCK_N, BLOCK_K)
        expert = mine.to(tl.int64)
        for c0 in range(0, count, BLOCK_R):
            pair, m_mask, arow = _leader_chunk(q, member, rank, count, c0, sl, A_ROW_DIV)
            acc_g, acc_u = _mm_rows(
                a_ptr, arow, m_mask, stride_ar, a_ptr, 0, w_ptr + expert * stride_we, stride_wn,
                s_ptr + expert * stride_se, stride_sn, rn, n_mask, N, k_start, k_end,
                GATED, FP8_W, EMULATE_FP8, UPCAST, BLOCK_R, BLOCK_N, BLOCK_K, SUB_K, SWAP_AB,
            )
            if SPLIT_K > 1:
                acc_g, acc_u, m_mask = _chunk_split_k(acc_g, acc_u, m_mask, ws_ptr, lock_ptr, pair, sl, pid_n, pid_k,
                                                      GATED, SPLIT_K, BLOCK_R, BLOCK_N)
            _epilogue(acc_g, acc_u, c_ptr, pair, m_mask, rn, n_mask, N, limit, GATED, ACT, HAS_LIMIT, RNE_BF16,
                      d_ptr, HAS_DELTA)


@triton.jit
def moe_reduce_kernel(
    y_ptr,  # [P, H] per-pair expert outputs, contiguous
    w_ptr,  # [R, K] routing weights (any float dtype), unit stride on K
    out_ptr,  # [R, H] contiguous
    H, stride_wr,
    TOPK: tl.constexpr, RNE_BF16: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # launched with launch_pdl (sparrow.kernels.use_pdl)
):
    pdl_enter(USE_PDL)
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOPK):
        wk = tl.load(w_ptr + r * stride_wr + k).to(tl.float32)
        acc += wk * tl.load(y_ptr + (r * TOPK + k) * H + cols, mask=mask, other=0.0).to(tl.float32)
    if RNE_BF16:
        acc = _rne_bf16(acc)
    tl.store(out_ptr + r * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)
