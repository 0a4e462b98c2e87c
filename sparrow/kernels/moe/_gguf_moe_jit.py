"""Triton bodies of the GGUF routed experts (launcher, tiles and torch twin: ``sparrow.kernels.moe.gguf_moe``):
``_moe_jit``'s small and grouped paths on raw ggml blocks, each weight tile dequantized in registers by the shared
``dequant_tile`` (fp32, bit-exact with ``gguf_blocks.dequantize``) and never written back.

Shapes: R = rows, H = hidden, E = experts, I = expert width, P = pairs (``_moe_jit``). A GGUF weight of logical
shape [N, K] of a type with B elements / T bytes a block is uint8 [N, K / B * T], each row its blocks as in the
file; stacked experts [E, N, K / B * T]; gate_up's rows :I gate, I: up.
"""
import triton
import triton.language as tl

from sparrow.kernels.common._fp8_jit import dot_upcast as _dot, rne_bf16 as _rne_bf16
from sparrow.kernels.common._pdl_jit import pdl_enter
from sparrow.kernels.common._gguf_dequant_jit import dequant_tile
from sparrow.kernels.moe._moe_jit import _block_pairs, _chunk_split_k, _epilogue, _expert_leader, _grouped_program, \
    _leader_chunk, _leader_tiles


@triton.jit
def _gguf_acc(acc, a, w, FMA: tl.constexpr, SWAP_AB: tl.constexpr, UPCAST: tl.constexpr, RNE_BF16: tl.constexpr):
    """acc += a [BM, BK] @ w [BN, BK]^T (acc [BM, BN] fp32; SWAP_AB: [BN, BM] = w @ a^T). FMA: fp32 products of
    the exact fp32 weights summed over the step (no dot: 1-4 rows); else the weights rounded to a's dtype, as the
    twin's dequantized experts are, and a dot (``_fp8_jit.dot_upcast``; RNE_BF16: the interpreter's bf16 rounding)."""
    if FMA:
        acc += tl.sum(a.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
    else:
        if RNE_BF16:
            w = _rne_bf16(w)
        w = w.to(a.dtype)
        if SWAP_AB:
            acc += _dot(w, tl.trans(a), UPCAST)
        else:
            acc += _dot(a, tl.trans(w), UPCAST)
    return acc


@triton.jit
def _gguf_mm_rows(
    a_ptr, arow, m_mask, stride_ar,  # A rows arow [BM] (int64) of a [*, K]
    w_ptr, w_base, stride_wn,  # uint8 blocks: this expert's rows start at byte w_base, stride_wn bytes a row
    rn, n_mask, N_UP, k_start, k_end,  # output rows [BN] (up: N_UP rows further, GATED); K range, BLOCK_K steps
    GGML_TYPE: tl.constexpr, GATED: tl.constexpr, FMA: tl.constexpr, SWAP_AB: tl.constexpr, UPCAST: tl.constexpr,
    RNE_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """(acc_gate, acc_up) [BM, BN] fp32 = A @ W[rn]^T (and A @ W[N_UP + rn]^T when GATED) over k_start:k_end
    (whole BLOCK_K steps: the launcher picks BLOCK_K dividing K). Each step reads BN rows' BLOCK_K / B blocks
    (contiguous bytes of each row); rows past N read row 0 and are masked at the store."""
    if SWAP_AB and not FMA:
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = acc_g
    row = tl.where(n_mask, rn, 0).to(tl.int64)
    off_g = w_base + row * stride_wn
    off_u = w_base + (row + N_UP) * stride_wn
    a_rows = a_ptr + arow[:, None] * stride_ar
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_rows + kk[None, :], mask=m_mask[:, None], other=0.0)
        acc_g = _gguf_acc(acc_g, a, dequant_tile(w_ptr, off_g, kk, GGML_TYPE), FMA, SWAP_AB, UPCAST, RNE_BF16)
        if GATED:
            acc_u = _gguf_acc(acc_u, a, dequant_tile(w_ptr, off_u, kk, GGML_TYPE), FMA, SWAP_AB, UPCAST, RNE_BF16)
    if SWAP_AB and not FMA:  # one return statement (Triton refuses returns of different shapes)
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    return acc_g, acc_u


@triton.jit
def _small_program(ids_ptr, P, P_PAD: tl.constexpr):
    """The small path's program (pair p, N tile, K split) and its expert's leader (``_moe_jit._expert_leader``)."""
    p = tl.program_id(0)
    q, member, first, mine = _expert_leader(ids_ptr, p, P, P_PAD)
    return p, tl.program_id(1), tl.program_id(2), q, member, first, mine


@triton.jit
def gguf_moe_gemv_kernel(
    a_ptr,  # GATED: x [R, H]; else the activations [P, I]; unit last stride
    w_ptr,  # uint8 blocks, GATED: gate_up [E, 2I, H / B * T]; else down [E, H, I / B * T]; unit last stride
    c_ptr,  # out [P, N] contiguous, a's dtype
    ids_ptr,  # [P] flattened topk_ids
    ws_ptr, lock_ptr,  # SPLIT_K > 1: split-K workspace, (1 + GATED) tiles per (pair, N tile), and counters
    P, N, K, A_ROW_DIV, stride_ar, stride_we, stride_wn, limit,  # strides of w in bytes
    GGML_TYPE: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, UPCAST: tl.constexpr,
    RNE_BF16: tl.constexpr, P_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, FMA: tl.constexpr = False, SWAP_AB: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):
    """The small path (``_moe_jit.moe_gemv_kernel``'s scheme): program per (pair, N tile, K split); the first pair
    of each expert (its leader) gathers the pairs routed to it, BLOCK_R at a time, and streams the expert's blocks
    of its N tile and K range once for each BLOCK_R of them; the other programs exit at once. act(gate) * up
    fused into the gate|up store; K splits reduced in the kernel (``_split_k_jit``)."""
    pdl_enter(USE_PDL)
    p, pid_n, pid_k, q, member, first, mine = _small_program(ids_ptr, P, P_PAD)
    if first == p:
        count, rank, rn, n_mask, sl, k_start, k_end = _leader_tiles(member, pid_n, pid_k, N, K, SPLIT_K, BLOCK_R,
                                                                    BLOCK_N, BLOCK_K)
        w_base = mine.to(tl.int64) * stride_we
        for c0 in range(0, count, BLOCK_R):
            pair, m_mask, arow = _leader_chunk(q, member, rank, count, c0, sl, A_ROW_DIV)
            acc_g, acc_u = _gguf_mm_rows(a_ptr, arow, m_mask, stride_ar, w_ptr, w_base, stride_wn, rn, n_mask, N,
                                         k_start, k_end, GGML_TYPE, GATED, FMA, SWAP_AB, UPCAST, RNE_BF16, BLOCK_R,
                                         BLOCK_N, BLOCK_K)
            if SPLIT_K > 1:
                acc_g, acc_u, m_mask = _chunk_split_k(acc_g, acc_u, m_mask, ws_ptr, lock_ptr, pair, sl, pid_n, pid_k,
                                                      GATED, SPLIT_K, BLOCK_R, BLOCK_N)
            _epilogue(acc_g, acc_u, c_ptr, pair, m_mask, rn, n_mask, N, limit, GATED, ACT, HAS_LIMIT, RNE_BF16,
                      c_ptr, False)  # no LoRA delta: GGUF experts with adapters run the float kernels


@triton.jit(do_not_specialize=["P"])  # step-varying counts: one variant (sparrow.engine.warmup)
def gguf_moe_gemm_kernel(
    a_ptr, w_ptr, c_ptr,  # as gguf_moe_gemv_kernel
    sorted_ptr,  # [S] int32 sorted pair ids, P = padding (moe_align)
    block_expert_ptr,  # [NB] int32 expert of each block
    total_ptr,  # [1] int32 padded pair count
    P, N, K, A_ROW_DIV, stride_ar, stride_we, stride_wn, limit,
    GGML_TYPE: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, UPCAST: tl.constexpr,
    RNE_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):
    """The grouped path (``_moe_jit.moe_gemm_kernel``'s scheme): program per (block of BLOCK_M sorted pairs,
    BLOCK_N outputs); each block dequantizes only its expert's weight tiles, once for its BLOCK_M pairs."""
    pdl_enter(USE_PDL)
    pid_m, pid_n, live = _grouped_program(total_ptr, BLOCK_M)
    if live:
        expert, pair, m_mask, arow, rn, n_mask = _block_pairs(sorted_ptr, block_expert_ptr, pid_m, pid_n, P, N,
                                                              A_ROW_DIV, BLOCK_M, BLOCK_N)
        acc_g, acc_u = _gguf_mm_rows(a_ptr, arow, m_mask, stride_ar, w_ptr, expert * stride_we, stride_wn, rn,
                                     n_mask, N, 0, K, GGML_TYPE, GATED, False, SWAP_AB, UPCAST, RNE_BF16, BLOCK_M,
                                     BLOCK_N, BLOCK_K)
        _epilogue(acc_g, acc_u, c_ptr, pair, m_mask, rn, n_mask, N, limit, GATED, ACT, HAS_LIMIT, RNE_BF16,
                  c_ptr, False)
