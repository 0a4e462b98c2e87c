"""Triton bodies of the routed 4-bit experts, int4 W4A16 and NVFP4 W4A16 (launchers:
``sparrow.kernels.moe.int4_moe``, ``sparrow.kernels.moe.nvfp4_moe``): ``_moe_jit``'s small and grouped paths on
the 4-bit decoders and dots of ``sparrow.kernels.gemm._w4_jit`` (FMA rows: ``sparrow.kernels.gemm._w4_fma_jit``).

Shapes: R = rows, H = hidden, E = experts, I = expert width, P = pairs (``_moe_jit``).
"""
import triton
import triton.language as tl

from sparrow.kernels.common._pdl_jit import pdl_enter
from sparrow.kernels.gemm._w4_fma_jit import _w4_fma_rows
from sparrow.kernels.gemm._w4_jit import _nv_post, _w4_mm_rows
from sparrow.kernels.moe._moe_jit import _block_pairs, _chunk_split_k, _epilogue, _expert_leader, _grouped_program, \
    _leader_chunk, _leader_tiles


@triton.jit
def _w4_global(acc_g, acc_u, g_ptr, a_ptr, expert, stride_ge, GATED: tl.constexpr, NVFP4: tl.constexpr,
               DIVIDE_G: tl.constexpr, FMA: tl.constexpr = False):
    """NVFP4: the accumulators times the expert's global multipliers g [E, 1 + GATED] (divided by them with
    DIVIDE_G: compressed-tensors' weight_global_scale) and ``_nv_post(a_ptr, FMA)``; int4: unchanged."""
    if NVFP4:
        UP: tl.constexpr = 1 if GATED else 0
        gg = tl.load(g_ptr + expert * stride_ge)
        gu = tl.load(g_ptr + expert * stride_ge + UP)
        post = _nv_post(a_ptr, FMA)
        if DIVIDE_G:
            acc_g = acc_g * (post / gg)
            acc_u = acc_u * (post / gu)
        else:
            acc_g = acc_g * (gg * post)
            acc_u = acc_u * (gu * post)
    return acc_g, acc_u


@triton.jit
def w4_moe_gemv_kernel(
    a_ptr,  # GATED: x [R, H]; else the activations [P, I]; unit last stride
    w_ptr,  # int32 words, GATED: [E, 2I, H / 8]; else [E, H, I / 8]; unit last stride
    s_ptr, z_ptr,  # int4: scales [E, N_w, G] (+ uint8 zeros, same strides); NVFP4: e4m3 [E, N_w, K / 16]
    g_ptr,  # NVFP4: fp32 [E, 1 + GATED] global multipliers (gate, up); else dummy
    c_ptr,  # out [P, N] contiguous, a's dtype
    ids_ptr,  # [P] flattened topk_ids
    ws_ptr, lock_ptr,  # SPLIT_K > 1: split-K workspace, (1 + GATED) tiles per (pair, N tile), and counters
    P, N, K, A_ROW_DIV, stride_ar, stride_we, stride_wn, stride_se, stride_sn, stride_ge, GROUP: tl.constexpr, limit,
    GATED: tl.constexpr, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, NVFP4: tl.constexpr, HAS_ZERO: tl.constexpr,
    DIVIDE_G: tl.constexpr, SCALE_W: tl.constexpr, UPCAST: tl.constexpr, RNE_BF16: tl.constexpr,
    P_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
    SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr = False, SWAP_AB: tl.constexpr = False, FMA: tl.constexpr = False,
):
    """The small path (``_moe_jit.moe_gemv_kernel``'s scheme on 4-bit weights): program per (pair, N tile, K split);
    the first pair of each expert gathers all pairs routed to it into BLOCK_R dot rows (FMA: BLOCK_R rows of fp32
    FMAs, ``_w4_fma_rows``) and streams the expert's words once for each BLOCK_R of them, the other programs exit
    at once."""
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    pdl_enter(USE_PDL)
    q, member, first, mine = _expert_leader(ids_ptr, p, P, P_PAD)
    if first == p:
        count, rank, rn, n_mask, sl, k_start, k_end = _leader_tiles(member, pid_n, pid_k, N, K, SPLIT_K, BLOCK_R,
                                                                    BLOCK_N, BLOCK_K)
        expert = mine.to(tl.int64)
        for c0 in range(0, count, BLOCK_R):
            pair, m_mask, arow = _leader_chunk(q, member, rank, count, c0, sl, A_ROW_DIV)
            if FMA:
                acc_g, acc_u = _w4_fma_rows(
                    a_ptr, arow, m_mask, stride_ar, w_ptr + expert * stride_we, stride_wn, s_ptr + expert * stride_se,
                    z_ptr + expert * stride_se, stride_sn, stride_sn, rn, n_mask, N, k_start, k_end, GROUP,
                    GATED, NVFP4, HAS_ZERO, BLOCK_R, BLOCK_N, BLOCK_K)
            else:
                acc_g, acc_u = _w4_mm_rows(
                    a_ptr, arow, m_mask, stride_ar, w_ptr + expert * stride_we, stride_wn, s_ptr + expert * stride_se,
                    z_ptr + expert * stride_se, stride_sn, stride_sn, rn, n_mask, N, k_start, k_end, GROUP,
                    GATED, NVFP4, HAS_ZERO, SCALE_W, UPCAST, RNE_BF16, BLOCK_R, BLOCK_N, BLOCK_K, SUB_K, SWAP_AB)
            acc_g, acc_u = _w4_global(acc_g, acc_u, g_ptr, a_ptr, expert, stride_ge, GATED, NVFP4, DIVIDE_G, FMA)
            if SPLIT_K > 1:
                acc_g, acc_u, m_mask = _chunk_split_k(acc_g, acc_u, m_mask, ws_ptr, lock_ptr, pair, sl, pid_n, pid_k,
                                                      GATED, SPLIT_K, BLOCK_R, BLOCK_N)
            _epilogue(acc_g, acc_u, c_ptr, pair, m_mask, rn, n_mask, N, limit, GATED, ACT, HAS_LIMIT, RNE_BF16,
                      c_ptr, False)  # no LoRA delta: 4-bit experts with adapters run the float kernels


@triton.jit(do_not_specialize=["P"])  # step-varying counts: one variant (sparrow.engine.warmup)
def w4_moe_gemm_kernel(
    a_ptr, w_ptr, s_ptr, z_ptr, g_ptr, c_ptr,  # as w4_moe_gemv_kernel
    sorted_ptr,  # [S] int32 sorted pair ids, P = padding (moe_align)
    block_expert_ptr,  # [NB] int32 expert of each block
    total_ptr,  # [1] int32 padded pair count
    P, N, K, A_ROW_DIV, stride_ar, stride_we, stride_wn, stride_se, stride_sn, stride_ge, GROUP: tl.constexpr, limit,
    GATED: tl.constexpr, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, NVFP4: tl.constexpr, HAS_ZERO: tl.constexpr,
    DIVIDE_G: tl.constexpr, SCALE_W: tl.constexpr, UPCAST: tl.constexpr, RNE_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
    USE_PDL: tl.constexpr = False, SWAP_AB: tl.constexpr = False,
):
    """The grouped path (``_moe_jit.moe_gemm_kernel``'s scheme on 4-bit weights): program per (block of BLOCK_M
    sorted pairs, BLOCK_N outputs); each block reads only its expert's words."""
    pdl_enter(USE_PDL)
    pid_m, pid_n, live = _grouped_program(total_ptr, BLOCK_M)
    if live:
        expert, pair, m_mask, arow, rn, n_mask = _block_pairs(sorted_ptr, block_expert_ptr, pid_m, pid_n, P, N,
                                                              A_ROW_DIV, BLOCK_M, BLOCK_N)
        acc_g, acc_u = _w4_mm_rows(
            a_ptr, arow, m_mask, stride_ar, w_ptr + expert * stride_we, stride_wn, s_ptr + expert * stride_se,
            z_ptr + expert * stride_se, stride_sn, stride_sn, rn, n_mask, N, 0, K, GROUP,
            GATED, NVFP4, HAS_ZERO, SCALE_W, UPCAST, RNE_BF16, BLOCK_M, BLOCK_N, BLOCK_K, SUB_K, SWAP_AB)
        acc_g, acc_u = _w4_global(acc_g, acc_u, g_ptr, a_ptr, expert, stride_ge, GATED, NVFP4, DIVIDE_G)
        _epilogue(acc_g, acc_u, c_ptr, pair, m_mask, rn, n_mask, N, limit, GATED, ACT, HAS_LIMIT, RNE_BF16,
                  c_ptr, False)  # no LoRA delta: 4-bit experts with adapters run the float kernels
