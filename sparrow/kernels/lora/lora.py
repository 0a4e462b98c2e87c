"""LoRA deltas for rows of many adapters in one step (Punica / S-LoRA's shrink / expand, one row per program):

    t[p]    = A[w(p)] @ x[p // x_div]              (shrink, fp32)      A [L, R, K], x [X, K] -> t [P, R]
    out[p]  (+)= B[w(p)]^T @ t[p]                   (expand)            B [L, R, N] (rank-major), out [P, N]
    lora_delta = both: a split-K shrink (grid P x ceil(K / SPLIT_K_CHUNK) up to SPLIT_K_MAX_ROWS rows, each
                 program one K chunk's partial t, no atomics), then the expand summing the partials

Shapes: P = rows (or (row, expert) pairs), K = in features, N = out features, L = weight sets (adapter slots, or
slots x experts), R = the buffers' rank width (zero-padded past each slot's rank). The weight set of row p:
v = slots[p // slot_div]; with ``expert_ids`` [P] (routed experts: pair p of row p // top-k) w(p) = v x
num_experts + expert_ids[p], the slot v; without, w(p) = v, the slot v // rank_div. Rows with v < 0 (the base
model) are left untouched, or get zeros with ``accumulate=False``. ``ranks`` [slots] int32: the rank each slot
uses (the kernels read no column past it; the twins read the zero padding: it adds nothing). The LoRA scaling is
folded into B by the caller. fp32 accumulation; out gets (out +) delta rounded once to its dtype. P is
expert_ids' length, else slots' length.

Segments (packed projections: qkv, gate_up, whose B is block-diagonal): ``out_sizes`` (<= 3 ints summing to N)
splits N, and ``seg_cols`` [slots, G, 2] int32 gives per slot and segment g (first rank row c, rank rows m): the
expand computes segment g's outputs from B rows [c, c + m) and t[c:c + m] only (twins and kernels alike; the
rank rows left out must be zero in that segment for the result to be the full product, as
``sparrow.layers.lora_buffers.LoRABuffers`` ensures). Without them the expand reads rank rows [0, rank).

Triton kernels (``_lora_jit``) where ``use_triton(x)``: no launch synchronizes with the host (CUDA graph safe);
PDL launches on Hopper. The torch twins (one matmul per distinct weight set, a host sync) are the CPU path and the
oracle. Tile choices are the module constants below, per row range ``ROW_TILES`` (read at each launch, so a sweep
may set them). Errors: ValueError naming the bad argument.
"""
from __future__ import annotations

import torch

from sparrow.kernels import dispatch, pdl_kwargs, use_triton

# Tile constants: the least total time of benchmarks/kernels_micro.py tune_lora on the H200 over gemma4-26b-a4b's
# qkv, o_proj, expert gate_up and expert down deltas at 1, 8 and 64 decode rows (against the untuned 256-column
# chunks, 4 shrink warps and 256-output expand tiles; the figures: benchmarks/README.md, Multi-LoRA). Per case the
# best differs (1 row: 128-column chunks and 128-output tiles were faster on the dense deltas), which one set of
# constants gives up.
SPLIT_K_CHUNK = 512
"""K columns per shrink program of lora_delta at up to SPLIT_K_MAX_ROWS rows (decode, verify, routed pairs)."""
SPLIT_K_MAX_ROWS = 1024
"""Above this many rows the grid is full with one shrink program per row (over all of K: no partials to keep);
64 decode rows x top-8 experts = 512 pairs stay split."""
SHRINK_TILE = 8192
"""Elements of A a shrink program loads at once (BLOCK_R x BLOCK_K; BLOCK_R covers R)."""
SHRINK_WARPS = 8
"""Warps of a shrink program."""
EXPAND_BLOCK_N = 512
"""Outputs per expand program (one segment's; each rank row of B a contiguous run of them)."""
EXPAND_TILE = 8192
"""Most elements of B an expand program loads at once (BLOCK_R x EXPAND_BLOCK_N; more rank rows loop)."""
EXPAND_WARPS = 4
"""Warps of an expand program."""
ROW_TILES: tuple[tuple[int, dict[str, int]], ...] = (
    # H200, benchmarks/kernels_micro.py tune_lora (per launch row count P, least total of its cases); what
    # benchmarks/lora.py gives with this table: benchmarks/README.md, Multi-LoRA
    (1, {"SPLIT_K_CHUNK": 128, "SHRINK_TILE": 8192, "SHRINK_WARPS": 8, "EXPAND_BLOCK_N": 128, "EXPAND_TILE": 4096,
         "EXPAND_WARPS": 4}),
    (8, {"SPLIT_K_CHUNK": 128, "SHRINK_TILE": 8192, "SHRINK_WARPS": 4, "EXPAND_BLOCK_N": 512, "EXPAND_TILE": 8192,
         "EXPAND_WARPS": 4}),
    (64, {"SPLIT_K_CHUNK": 128, "SHRINK_TILE": 4096, "SHRINK_WARPS": 4, "EXPAND_BLOCK_N": 512, "EXPAND_TILE": 8192,
          "EXPAND_WARPS": 4}),
)
"""Per row range values of the constants above: (largest P, {constant name: value}) entries, smallest bound
first; a launch of P rows takes the names that the first entry covering P holds, and the constants for the
rest (``tile``). ``benchmarks/kernels_micro.py tune_lora`` prints such a table from its per-row-count sweep."""
MAX_SEGMENTS = 3


def tile(name: str, p: int) -> int:
    """The tile constant ``name`` (e.g. "SPLIT_K_CHUNK") for a launch of P rows: ROW_TILES' first entry whose
    bound covers P, where it holds the name, else the module constant."""
    for bound, values in ROW_TILES:
        if p <= bound:
            if name in values:
                return values[name]
            break
    return globals()[name]


def lora_index(slots: torch.Tensor, expert_ids: torch.Tensor | None = None, num_experts: int = 1,
               slot_div: int = 1) -> torch.Tensor:
    """[P] int64 weight set of each row (module doc), -1 for rows without an adapter (torch)."""
    if expert_ids is None:
        return slots.to(torch.int64)
    flat = expert_ids.reshape(-1).to(torch.int64)
    v = slots.to(torch.int64).repeat_interleave(slot_div)[: flat.numel()]
    return torch.where(v >= 0, v * num_experts + flat, -1)


def _check(x, w, slots, ranks, expert_ids, name) -> None:
    if w.dim() != 3 or not w.is_contiguous():
        raise ValueError(f"{name}: weights must be a contiguous [L, *, *] tensor, got {tuple(w.shape)}")
    for n, t in (("slots", slots), ("expert_ids", expert_ids)):
        if t is not None and t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: {n} must be int32 / int64, got {t.dtype}")
    if ranks.dtype != torch.int32:
        raise ValueError(f"{name}: ranks must be int32, got {ranks.dtype}")
    for n, t in (("weights", w), ("slots", slots), ("ranks", ranks), ("expert_ids", expert_ids)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: {n} is on {t.device}, the input on {x.device}")


def _rows(slots, expert_ids) -> int:
    return expert_ids.numel() if expert_ids is not None else slots.numel()


# ------------------------------------------------------------------------------------------------ twins


def _segments(n: int, out_sizes, seg_cols, ranks, name) -> tuple[tuple[int, ...], torch.Tensor | None]:
    """(segment sizes, seg_cols or None) checked: sizes sum to n, at most MAX_SEGMENTS, seg_cols [slots, G, 2]
    int32 contiguous beside ranks."""
    if (out_sizes is None) != (seg_cols is None):
        raise ValueError(f"{name}: out_sizes and seg_cols go together")
    if out_sizes is None:
        return (n,), None
    sizes = tuple(int(v) for v in out_sizes)
    if not 1 <= len(sizes) <= MAX_SEGMENTS or sum(sizes) != n or min(sizes) < 0:
        raise ValueError(f"{name}: out_sizes {sizes} must be 1 to {MAX_SEGMENTS} sizes summing to N={n}")
    if (seg_cols.dtype != torch.int32 or not seg_cols.is_contiguous() or seg_cols.device != ranks.device
            or tuple(seg_cols.shape) != (ranks.shape[0], len(sizes), 2)):
        raise ValueError(f"{name}: seg_cols must be a contiguous int32 [slots={ranks.shape[0]}, G={len(sizes)}, 2] "
                         f"tensor on {ranks.device}, got {seg_cols.dtype} {tuple(seg_cols.shape)} on {seg_cols.device}")
    return sizes, seg_cols


def lora_shrink_ref(x, a, slots, ranks, expert_ids=None, num_experts=1, slot_div=1, x_div=1, rank_div=1):
    """Torch twin of ``lora_shrink``: t [P, R] fp32 (rows without an adapter: zeros)."""
    idx = lora_index(slots, expert_ids, num_experts, slot_div)
    t = torch.zeros(idx.numel(), a.shape[1], dtype=torch.float32, device=x.device)
    for i in torch.unique(idx[idx >= 0]).tolist():
        rows = (idx == i).nonzero().squeeze(1)
        t[rows] = x[rows // x_div].float() @ a[i].float().t()
    return t


def lora_expand_ref(t, b, slots, ranks, out, expert_ids=None, num_experts=1, slot_div=1, rank_div=1,
                    accumulate=True, out_sizes=None, seg_cols=None):
    """Torch twin of ``lora_expand``: out[p] (+)= B[w(p)]^T @ t[p] in place (per segment, module doc); returns
    out."""
    idx = lora_index(slots, expert_ids, num_experts, slot_div)
    sizes, segs = _segments(b.shape[2], out_sizes, seg_cols, ranks, "lora_expand")
    segs = segs.tolist() if segs is not None else None
    bounds = [sum(sizes[:g]) for g in range(len(sizes) + 1)]
    if not accumulate:
        out[idx < 0] = 0
    for i in torch.unique(idx[idx >= 0]).tolist():
        rows = (idx == i).nonzero().squeeze(1)
        if segs is None:
            delta = t[rows] @ b[i].float()
        else:
            slot = i // num_experts if expert_ids is not None else i // rank_div
            delta = torch.zeros(rows.numel(), b.shape[2], dtype=torch.float32, device=out.device)
            for g, (c, m) in enumerate(segs[slot]):
                lo, hi = bounds[g], bounds[g + 1]
                delta[:, lo:hi] = t[rows, c:c + m] @ b[i, c:c + m, lo:hi].float()
        base = out[rows].float() if accumulate else 0.0
        out[rows] = (base + delta).to(out.dtype)
    return out


def lora_delta_ref(x, a, b, slots, ranks, out, expert_ids=None, num_experts=1, slot_div=1, x_div=1, rank_div=1,
                   accumulate=True, out_sizes=None, seg_cols=None):
    """Torch twin of ``lora_delta``."""
    t = lora_shrink_ref(x, a, slots, ranks, expert_ids, num_experts, slot_div, x_div, rank_div)
    return lora_expand_ref(t, b, slots, ranks, out, expert_ids, num_experts, slot_div, rank_div, accumulate,
                           out_sizes, seg_cols)


# ------------------------------------------------------------------------------------------- launchers


def _block(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, (n - 1).bit_length()))


def _common(x, slots, ranks, expert_ids, num_experts, slot_div, rank_div):
    has = expert_ids is not None
    eids = expert_ids.reshape(-1) if has else slots
    return (slots, eids, ranks), dict(SLOT_DIV=slot_div, NUM_E=num_experts, RANK_DIV=rank_div), dict(HAS_EIDS=has)


def shrink_chunk(p: int, k: int) -> int:
    """K columns per shrink program of lora_delta at P rows (the dispatch rule, module doc)."""
    return tile("SPLIT_K_CHUNK", p) if p <= SPLIT_K_MAX_ROWS else max(k, 1)


def _shrink_parts(x, a, slots, ranks, expert_ids, num_experts, slot_div, x_div, rank_div, chunk, name):
    """t [P, S, R] fp32 partial products of the S = ceil(K / chunk) K chunks (rows without an adapter unwritten)."""
    from sparrow.kernels.lora._lora_jit import lora_shrink_kernel

    _check(x, a, slots, ranks, expert_ids, name)
    x = x if x.stride(-1) == 1 else x.contiguous()
    p, (_, r, k) = _rows(slots, expert_ids), a.shape
    splits = max(1, -(-k // chunk))
    t = torch.empty(p, splits, r, dtype=torch.float32, device=x.device)
    if p:
        ptrs, divs, flags = _common(x, slots, ranks, expert_ids, num_experts, slot_div, rank_div)
        block_r = _block(r)
        block_k = max(16, min(_block(chunk), tile("SHRINK_TILE", p) // block_r))
        lora_shrink_kernel[(p, splits)](
            x, a, *ptrs, t, k, r, splits, chunk, x_div, divs["SLOT_DIV"], divs["NUM_E"], divs["RANK_DIV"],
            x.stride(0), **flags, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=tile("SHRINK_WARPS", p), **pdl_kwargs(x))
    return t


def lora_shrink_triton(x, a, slots, ranks, expert_ids=None, num_experts=1, slot_div=1, x_div=1, rank_div=1):
    """Triton launcher of ``lora_shrink``: one program per row over all of K (rows without an adapter: t's row
    unwritten)."""
    k = a.shape[2] if a.dim() == 3 else 1
    t = _shrink_parts(x, a, slots, ranks, expert_ids, num_experts, slot_div, x_div, rank_div, max(k, 1),
                      "lora_shrink")
    return t.view(t.shape[0], t.shape[2])


def lora_expand_triton(t, b, slots, ranks, out, expert_ids=None, num_experts=1, slot_div=1, rank_div=1,
                       accumulate=True, out_sizes=None, seg_cols=None):
    """Triton launcher of ``lora_expand``: one program per (row, EXPAND_BLOCK_N outputs of one segment); t [P, R]
    or the shrink's partials [P, S, R] (summed), fp32 contiguous; out must be contiguous [P, N]."""
    from sparrow.kernels.lora._lora_jit import lora_expand_kernel

    _check(t, b, slots, ranks, expert_ids, "lora_expand")
    p, (_, r, n) = _rows(slots, expert_ids), b.shape
    _check_out(out, p, n, "lora_expand")
    sizes, segs = _segments(n, out_sizes, seg_cols, ranks, "lora_expand")
    parts = t if t.dim() == 3 else t.unsqueeze(1)
    if parts.dtype != torch.float32 or not parts.is_contiguous() or parts.shape[0] != p or parts.shape[2] != r:
        raise ValueError(f"lora_expand: t must be a contiguous fp32 [P={p}, R={r}] or [P, S, R] tensor, got "
                         f"{t.dtype} {tuple(t.shape)}")
    if p:
        ptrs, divs, flags = _common(t, slots, ranks, expert_ids, num_experts, slot_div, rank_div)
        splits, block_n = parts.shape[1], tile("EXPAND_BLOCK_N", p)
        block_r = max(1, min(_block(max(1, r // len(sizes)), 1), tile("EXPAND_TILE", p) // block_n))
        n0, n1 = (sizes + (0, 0))[:2]
        tiles = sum(-(-v // block_n) for v in sizes)
        lora_expand_kernel[(p, tiles)](
            parts, b, *ptrs, segs if segs is not None else ranks, out, n, r, splits, len(sizes), n0, n1,
            divs["SLOT_DIV"], divs["NUM_E"], divs["RANK_DIV"], **flags, HAS_SEGS=segs is not None,
            ACCUMULATE=accumulate, BLOCK_R=block_r, BLOCK_S=_block(splits, 1), BLOCK_N=block_n,
            num_warps=tile("EXPAND_WARPS", p), **pdl_kwargs(t))
    return out


def lora_delta_triton(x, a, b, slots, ranks, out, expert_ids=None, num_experts=1, slot_div=1, x_div=1, rank_div=1,
                      accumulate=True, out_sizes=None, seg_cols=None):
    """Triton launcher of ``lora_delta``: the split-K shrink (``shrink_chunk``), then the expand summing its
    partials."""
    _check(x, a, slots, ranks, expert_ids, "lora_delta")
    p, n, k = _rows(slots, expert_ids), b.shape[2], a.shape[2]
    _check_out(out, p, n, "lora_delta")
    t = _shrink_parts(x, a, slots, ranks, expert_ids, num_experts, slot_div, x_div, rank_div, shrink_chunk(p, k),
                      "lora_delta")
    return lora_expand_triton(t, b, slots, ranks, out, expert_ids, num_experts, slot_div, rank_div, accumulate,
                              out_sizes, seg_cols)


def _check_out(out, p, n, name) -> None:
    if not out.is_contiguous() or tuple(out.shape) != (p, n):
        raise ValueError(f"{name}: out must be a contiguous [P={p}, N={n}] tensor, got {tuple(out.shape)}")


# ----------------------------------------------------------------------------------------- dispatchers


lora_shrink = dispatch("lora_shrink", lora_shrink_triton, lora_shrink_ref, """t [P, R] fp32 = A[w(p)] @ x[p // x_div]
    (module doc); rows without an adapter are unspecified.""")


def lora_expand(t, b, slots, ranks, out, expert_ids=None, num_experts=1, slot_div=1, rank_div=1, accumulate=True,
                out_sizes=None, seg_cols=None):
    """out[p] (+)= B[w(p)]^T @ t[p] in place (module doc); returns out. Dispatched on ``out`` (the tensor written)."""
    fn = lora_expand_triton if use_triton(out) else lora_expand_ref
    return fn(t, b, slots, ranks, out, expert_ids, num_experts, slot_div, rank_div, accumulate, out_sizes, seg_cols)


lora_delta = dispatch("lora_delta", lora_delta_triton, lora_delta_ref, """out[p] (+)= B[w(p)]^T @ (A[w(p)] @
    x[p // x_div]) in place (module doc; ``out_sizes`` / ``seg_cols``: the segments); returns out.""")
