"""LoRA shrink / expand kernels and the delta (sparrow/kernels/lora/lora.py) against their torch twins (and the twins
against the per-row definition), the packed projections' segments (each output shard reading only its rank rows
of B, shard ranks below the maximum, absent shards; the segments derived by LoRABuffers.write giving the full
product), and the routed experts' LoRA
deltas in both MoE paths (Triton grouped GEMM / per-expert GEMV epilogue vs the torch twins, and the twins vs
experts with the merged weights W_e + B_e A_e of each row's adapter). Triton runs under the interpreter on CPU.
Tolerances: fp32 1e-4, bf16 1e-2 (absolute and relative; bf16 experts 3e-2 against the fp32 merged-weight
oracle: the paths round the intermediate at different points)."""
from __future__ import annotations

import pytest
import torch

from sparrow.kernels import backend
from sparrow.kernels.lora import lora as lora_kernels
from sparrow.kernels.lora.lora import lora_delta_ref, lora_delta_triton, lora_expand_ref, lora_expand_triton, lora_index, \
    lora_shrink_ref, lora_shrink_triton
from sparrow.kernels.moe.moe import fused_moe_triton
from sparrow.kernels.moe.moe_configs import MoeConfig, Tile, forced_config
from sparrow.kernels.moe.moe_ref import fused_moe_grouped_ref, fused_moe_per_pair_ref, gate_up_act
from sparrow.layers.lora_buffers import ExpertLoRA, LoRABuffers

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
SLOTS = 3


def _buffers(experts, width, k, n, dtype, ranks, seed):
    """LoRABuffers with random factors of rank ranks[s] in slot s (zeros past it)."""
    g = torch.Generator().manual_seed(seed)
    buf = LoRABuffers(SLOTS, experts, width, k, n, dtype, torch.device(DEVICE))
    for s, r in enumerate(ranks):
        a = torch.randn(experts, r, k, generator=g) / k**0.5
        b = torch.randn(experts, n, r, generator=g) / r**0.5
        buf.write(s, (a[0], b[0]) if experts == 1 else (a, b))
    return buf


def _slots(rows, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, SLOTS, (rows,), generator=g).to(DEVICE)  # -1: rows of the base model


@pytest.mark.parametrize("rows", [1, 3, 17, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shrink_expand_match_twins(rows, dtype):
    k, n, width = 72, 100, 24
    buf = _buffers(1, width, k, n, dtype, ranks=[8, 24, 3], seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(5)).to(dtype).to(DEVICE)
    slots = _slots(rows, rows)
    y0 = torch.randn(rows, n, generator=torch.Generator().manual_seed(6)).to(dtype).to(DEVICE)
    t_ref = lora_shrink_ref(x, buf.a, slots, buf.ranks)
    want = lora_expand_ref(t_ref, buf.b, slots, buf.ranks, y0.clone())
    t = lora_shrink_triton(x, buf.a, slots, buf.ranks)
    got = lora_expand_triton(t, buf.b, slots, buf.ranks, y0.clone())
    mine = slots >= 0
    torch.testing.assert_close(t[mine], t_ref[mine], **TOL[torch.float32])
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(got[~mine], y0[~mine])  # rows without an adapter are untouched
    # and the twin is the plain per-row product with each slot's factors
    for r in range(rows):
        s = int(slots[r])
        if s >= 0:
            delta = buf.b[s].float().t() @ (buf.a[s].float() @ x[r].float())
            torch.testing.assert_close(want[r].float(), (y0[r].float() + delta), **TOL[dtype])


@pytest.mark.parametrize("chunk", [16, 1 << 20])
@pytest.mark.parametrize("rows,accumulate", [(1, True), (5, False), (17, True)])
def test_delta_split_k_and_one_chunk(chunk, rows, accumulate, monkeypatch):
    """lora_delta: the split-K shrink (K = 40 in chunks of 16, the last ragged; its partials summed by the
    expand) and one chunk over all of K give the twin's result."""
    monkeypatch.setattr(lora_kernels, "SPLIT_K_CHUNK", chunk)
    k, n = 40, 300  # five expand N tiles, the last ragged
    buf = _buffers(1, 16, k, n, torch.float32, ranks=[16, 7, 0], seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    slots = _slots(rows, rows + 1)
    y0 = torch.randn(rows, n, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    want = lora_delta_ref(x, buf.a, buf.b, slots, buf.ranks, y0.clone(), accumulate=accumulate)
    got = lora_delta_triton(x, buf.a, buf.b, slots, buf.ranks, y0.clone(), accumulate=accumulate)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    if not accumulate:
        assert torch.all(got[slots < 0] == 0)


def test_row_tiles_pick_per_range(monkeypatch):
    """ROW_TILES: a launch's P takes the first covering entry's values, the constants for names it lacks and
    for P past every bound."""
    monkeypatch.setattr(lora_kernels, "ROW_TILES", ((1, {"SPLIT_K_CHUNK": 16}), (8, {"EXPAND_BLOCK_N": 32})))
    assert lora_kernels.tile("SPLIT_K_CHUNK", 1) == 16
    assert lora_kernels.tile("SPLIT_K_CHUNK", 2) == lora_kernels.SPLIT_K_CHUNK  # entry 8 lacks it
    assert lora_kernels.tile("EXPAND_BLOCK_N", 8) == 32
    assert lora_kernels.tile("EXPAND_BLOCK_N", 9) == lora_kernels.EXPAND_BLOCK_N


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_delta_with_row_tiles(rows, monkeypatch):
    """lora_delta with per range tiles (small chunks and expand tiles at 1 row, others at 2-8, the constants
    above) gives the twin's result: K = 40, N = 300 (ragged last tiles), ranks 16 / 7 / 0."""
    monkeypatch.setattr(lora_kernels, "ROW_TILES", (
        (1, {"SPLIT_K_CHUNK": 16, "EXPAND_BLOCK_N": 32, "EXPAND_TILE": 256, "SHRINK_WARPS": 2}),
        (8, {"SPLIT_K_CHUNK": 32, "EXPAND_BLOCK_N": 64, "EXPAND_TILE": 512})))
    k, n = 40, 300
    buf = _buffers(1, 16, k, n, torch.float32, ranks=[16, 7, 0], seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    slots = _slots(rows, rows + 1)
    y0 = torch.randn(rows, n, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    want = lora_delta_ref(x, buf.a, buf.b, slots, buf.ranks, y0.clone())
    got = lora_delta_triton(x, buf.a, buf.b, slots, buf.ranks, y0.clone())
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("chunk", [16, 1 << 20])
@pytest.mark.parametrize("rows,top_k", [(1, 2), (5, 3), (16, 1)])
def test_pair_indexing(rows, top_k, chunk, monkeypatch):
    """Pairs use the weight set slot x E + expert of their row's slot, read x row p // top_k (gate_up) or their
    own row (down); ranks are per slot."""
    monkeypatch.setattr(lora_kernels, "SPLIT_K_CHUNK", chunk)
    experts, k, n = 4, 40, 56
    buf = _buffers(experts, 16, k, n, torch.float32, ranks=[16, 5, 9], seed=rows)
    slots = _slots(rows, 3)
    ids = torch.randint(0, experts, (rows, top_k), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    for x_rows, x_div in ((rows, top_k), (rows * top_k, 1)):
        x = torch.randn(x_rows, k, generator=torch.Generator().manual_seed(1)).to(DEVICE)
        kw = dict(expert_ids=ids, num_experts=experts, slot_div=top_k, x_div=x_div)
        out0 = torch.zeros(rows * top_k, n, device=DEVICE)
        want = lora_delta_ref(x, buf.a, buf.b, slots, buf.ranks, out0.clone(), **kw)
        got = lora_delta_triton(x, buf.a, buf.b, slots, buf.ranks, out0.clone(), **kw)
        torch.testing.assert_close(got, want, **TOL[torch.float32])
        for p in range(rows * top_k):  # the twin against the definition
            s, e = int(slots[p // top_k]), int(ids.reshape(-1)[p])
            if s >= 0:
                w = s * experts + e
                torch.testing.assert_close(want[p], buf.b[w].t() @ (buf.a[w] @ x[p // x_div]),
                                           **TOL[torch.float32])
            else:
                assert torch.all(want[p] == 0)


def _moe_case(rows, experts, top_k, dtype, h=48, i=40):
    g = torch.Generator().manual_seed(rows + experts)
    x = torch.randn(rows, h, generator=g).to(dtype).to(DEVICE)
    w13 = (torch.randn(experts, 2 * i, h, generator=g) / h**0.5).to(dtype).to(DEVICE)
    w2 = (torch.randn(experts, h, i, generator=g) / i**0.5).to(dtype).to(DEVICE)
    weights, ids = torch.softmax(torch.randn(rows, experts, generator=g), -1).topk(top_k, dim=-1)
    lora = ExpertLoRA(_buffers(experts, 8, h, 2 * i, dtype, [8, 4, 6], seed=1),
                      _buffers(experts, 8, i, h, dtype, [2, 8, 5], seed=2))
    return x, w13, w2, weights.to(DEVICE), ids.to(DEVICE), lora, _slots(rows, rows)


def _merged_oracle(x, w13, w2, weights, ids, lora, slots):
    """Each pair with its row's merged expert weights W + B A (PEFT's merge), fp32."""
    out = torch.zeros(x.shape[0], x.shape[1], device=x.device)
    e_count = w13.shape[0]
    for r in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e, s = int(ids[r, j]), int(slots[r])
            g13, g2 = w13[e].float(), w2[e].float()
            if s >= 0:
                n = s * e_count + e
                g13 = g13 + lora.gate_up.b[n].float().t() @ lora.gate_up.a[n].float()
                g2 = g2 + lora.down.b[n].float().t() @ lora.down.a[n].float()
            a = gate_up_act((g13 @ x[r].float())[None], "silu", None)[0]
            out[r] += float(weights[r, j]) * (g2 @ a)
    return out


@pytest.mark.parametrize("path", ["grouped", "small"])
@pytest.mark.parametrize("rows,experts,top_k,dtype", [(1, 4, 2, torch.float32), (9, 8, 3, torch.float32),
                                                      (17, 8, 2, torch.bfloat16)])
def test_expert_deltas_in_both_paths(path, rows, experts, top_k, dtype):
    x, w13, w2, weights, ids, lora, slots = _moe_case(rows, experts, top_k, dtype)
    ref = fused_moe_grouped_ref if path == "grouped" else fused_moe_per_pair_ref
    with backend("torch"):
        want = ref(x, w13, w2, weights, ids, lora=lora.bind(slots, ids))
    oracle = _merged_oracle(x, w13, w2, weights, ids, lora, slots).to(DEVICE)
    tol = TOL[torch.float32] if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)  # bf16: two roundings apart
    torch.testing.assert_close(want.float(), oracle, **tol)
    cfg = MoeConfig(16, Tile(32, 32), Tile(64, 32))
    with backend("triton"), forced_config(cfg) if DEVICE == "cpu" else torch.no_grad():
        got = fused_moe_triton(x, w13, w2, weights, ids, pair_threshold=-1 if path == "grouped" else 10**9,
                               lora=lora.bind(slots, ids))
    torch.testing.assert_close(got.float(), want.float() if dtype == torch.float32 else oracle, **tol)


def _packed(out_sizes, max_rank, shard_ranks, experts, k, dtype, seed):
    """LoRABuffers of a packed projection (segments ``out_sizes``, width max_rank x shards) with, in slot s,
    shards of ranks shard_ranks[s] side by side (0: shard not adapted; A stacked, B block-diagonal, as the
    adapter loader builds them); experts > 1: per-expert factors of that layout."""
    g = torch.Generator().manual_seed(seed)
    n = sum(out_sizes)
    buf = LoRABuffers(SLOTS, experts, max_rank * len(out_sizes), k, n, dtype, torch.device(DEVICE), out_sizes)
    for s, ranks in enumerate(shard_ranks):
        total = sum(ranks)
        a = torch.randn(experts, total, k, generator=g) / k**0.5
        b = torch.zeros(experts, n, total)
        row = col = 0
        for size, r in zip(out_sizes, ranks):
            b[:, row:row + size, col:col + r] = torch.randn(experts, size, r, generator=g) / max(r, 1)**0.5
            row, col = row + size, col + r
        buf.write(s, None if total == 0 else ((a[0], b[0]) if experts == 1 else (a, b)))
    return buf


def _expected_cols(ranks):
    out, col = [], 0
    for r in ranks:
        out.append([col if r else 0, r])
        col += r
    return out


SHARD_RANKS = [(8, 3, 5), (2, 0, 8), (0, 0, 0)]  # slot 0: all shards below / at the max; 1: no k; 2: empty


@pytest.mark.parametrize("rows", [1, 2, 3, 17, 64])
@pytest.mark.parametrize("accumulate", [True, False])
def test_packed_segments(rows, accumulate, monkeypatch):
    """A packed qkv-like projection (segments 40 / 24 / 36, rank 8 per shard, R = 24): seg_cols are each shard's
    own rank rows; the kernel with segments (small tiles: ragged tiles in every segment, two rank-row steps)
    equals the twin with segments, which equals the full product of B over all R rank rows (the twin without
    segments) and the per-row definition. fp32 1e-4."""
    monkeypatch.setattr(lora_kernels, "EXPAND_BLOCK_N", 16)
    monkeypatch.setattr(lora_kernels, "EXPAND_TILE", 64)  # BLOCK_R 4: rank 8 in two steps
    monkeypatch.setattr(lora_kernels, "SPLIT_K_CHUNK", 32)
    sizes, k = (40, 24, 36), 72
    buf = _packed(sizes, 8, SHARD_RANKS, 1, k, torch.float32, seed=rows)
    for s, ranks in enumerate(SHARD_RANKS):
        assert buf.seg_cols[s].tolist() == _expected_cols(ranks)
        assert int(buf.ranks[s]) == sum(ranks)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    slots = _slots(rows, rows + 7)
    y0 = torch.randn(rows, sum(sizes), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    seg = dict(out_sizes=buf.out_sizes, seg_cols=buf.seg_cols)
    want = lora_delta_ref(x, buf.a, buf.b, slots, buf.ranks, y0.clone(), accumulate=accumulate, **seg)
    full = lora_delta_ref(x, buf.a, buf.b, slots, buf.ranks, y0.clone(), accumulate=accumulate)
    got = lora_delta_triton(x, buf.a, buf.b, slots, buf.ranks, y0.clone(), accumulate=accumulate, **seg)
    torch.testing.assert_close(want, full, **TOL[torch.float32])
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    base = y0 if accumulate else torch.zeros_like(y0)
    for r in range(rows):
        s = int(slots[r])
        delta = buf.b[s].t() @ (buf.a[s] @ x[r]) if s >= 0 else 0.0
        torch.testing.assert_close(got[r], base[r] + delta, **TOL[torch.float32])


def test_segment_cols_are_honoured():
    """seg_cols that leave out nonzero rank rows: kernel and twin both use only the listed rows (so the kernel
    matches the twin's per-segment semantics, not just the full product). bf16 B, fp32 out; 1e-4."""
    sizes, k, rows = (24, 40), 32, 9
    buf = _buffers(1, 16, k, sum(sizes), torch.bfloat16, ranks=[16, 12, 5], seed=11)
    cols = torch.tensor([[[2, 5], [9, 7]], [[0, 12], [3, 0]], [[4, 1], [0, 5]]], dtype=torch.int32).to(DEVICE)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16).to(DEVICE)
    slots = _slots(rows, 13)
    out0 = torch.randn(rows, sum(sizes), generator=torch.Generator().manual_seed(14)).to(DEVICE)
    seg = dict(out_sizes=sizes, seg_cols=cols)
    want = lora_delta_ref(x, buf.a, buf.b, slots, buf.ranks, out0.clone(), **seg)
    got = lora_delta_triton(x, buf.a, buf.b, slots, buf.ranks, out0.clone(), **seg)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    t = lora_shrink_ref(x, buf.a, slots, buf.ranks)
    for r in range(rows):  # the twin against the definition of the segments
        s = int(slots[r])
        if s < 0:
            assert torch.equal(want[r], out0[r])
            continue
        for g, (lo, hi) in enumerate(((0, 24), (24, 64))):
            c, m = cols[s, g].tolist()
            delta = buf.b[s, c:c + m, lo:hi].float().t() @ t[r, c:c + m]
            torch.testing.assert_close(want[r, lo:hi], out0[r, lo:hi] + delta, **TOL[torch.float32])


@pytest.mark.parametrize("rows,top_k", [(1, 8), (3, 2), (17, 2)])
@pytest.mark.parametrize("layout", ["fused", "per_expert"])
def test_expert_gate_up_segments(rows, top_k, layout, monkeypatch):
    """Expert gate_up buffers (segments gate / up of 48 each, width 2 x 8): PEFT's fused 3-D tensor (one dense B
    of rank r over both halves: both segments rank rows [0, r)) or per-expert gate / up modules (block-diagonal).
    Pairs of base rows get zeros (accumulate off, as ExpertDelta.gate_up); the grouped path's weight-set
    indices with rank_div = E give the same rows. Kernel vs twin vs the full product; fp32 1e-4."""
    monkeypatch.setattr(lora_kernels, "EXPAND_BLOCK_N", 32)
    experts, i, k = 4, 48, 40
    if layout == "fused":
        buf = LoRABuffers(SLOTS, experts, 16, k, 2 * i, torch.float32, torch.device(DEVICE), (i, i))
        g = torch.Generator().manual_seed(rows)
        for s, r in enumerate((8, 5, 0)):
            a = torch.randn(experts, r, k, generator=g) / k**0.5
            b = torch.randn(experts, 2 * i, r, generator=g) / max(r, 1)**0.5
            buf.write(s, (a, b) if r else None)
        assert buf.seg_cols[:2].tolist() == [[[0, 8], [0, 8]], [[0, 5], [0, 5]]]
    else:
        shard = [(8, 6), (3, 8), (0, 0)]
        buf = _packed((i, i), 8, shard, experts, k, torch.float32, seed=rows)
        assert buf.seg_cols[1].tolist() == _expected_cols(shard[1])
    slots = _slots(rows, rows + 2)
    ids = torch.randint(0, experts, (rows, top_k), generator=torch.Generator().manual_seed(rows)).to(DEVICE)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    kw = dict(expert_ids=ids, num_experts=experts, slot_div=top_k, x_div=top_k, accumulate=False)
    seg = dict(out_sizes=buf.out_sizes, seg_cols=buf.seg_cols)
    out0 = torch.full((rows * top_k, 2 * i), 7.0, device=DEVICE)  # overwritten: zeros for base pairs
    want = lora_delta_ref(x, buf.a, buf.b, slots, buf.ranks, out0.clone(), **kw, **seg)
    full = lora_delta_ref(x, buf.a, buf.b, slots, buf.ranks, out0.clone(), **kw)
    got = lora_delta_triton(x, buf.a, buf.b, slots, buf.ranks, out0.clone(), **kw, **seg)
    torch.testing.assert_close(want, full, **TOL[torch.float32])
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    base = (slots < 0).repeat_interleave(top_k)
    assert torch.all(got[base] == 0)
    # the grouped path's indexing: weight sets as slots, the slot by rank_div
    idx = lora_index(slots, ids, experts, top_k)
    xp = x.repeat_interleave(top_k, 0)
    got2 = lora_delta_triton(xp, buf.a, buf.b, idx, buf.ranks, out0.clone(), rank_div=experts, accumulate=False,
                             **seg)
    torch.testing.assert_close(got2, want, **TOL[torch.float32])


def test_segment_argument_errors():
    buf = _packed((8, 8), 4, [(4, 4), (0, 0), (0, 0)], 1, 16, torch.float32, seed=0)
    x, slots = torch.randn(2, 16, device=DEVICE), torch.zeros(2, dtype=torch.int32, device=DEVICE)
    out = torch.zeros(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="out_sizes and seg_cols"):
        lora_delta_triton(x, buf.a, buf.b, slots, buf.ranks, out, out_sizes=(8, 8))
    with pytest.raises(ValueError, match="summing to N=16"):
        lora_delta_triton(x, buf.a, buf.b, slots, buf.ranks, out, out_sizes=(8, 4), seg_cols=buf.seg_cols)
    with pytest.raises(ValueError, match="seg_cols must be"):
        lora_delta_triton(x, buf.a, buf.b, slots, buf.ranks, out, out_sizes=(16,), seg_cols=buf.seg_cols)
    with pytest.raises(ValueError, match="out_sizes"):
        LoRABuffers(2, 1, 4, 16, 16, torch.float32, torch.device(DEVICE), (4, 4, 4, 4))
