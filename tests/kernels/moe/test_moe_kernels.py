"""Fused MoE kernels (align, grouped GEMM, small-batch GEMV, reduce, dispatcher) against their torch twins.

Shapes: R = rows, H = hidden, E = experts, K = top-k, I = expert width, P = R * K pairs.
On CPU the kernels run under TRITON_INTERPRET=1 at H = 64 (ragged against the 128-wide FP8 groups),
I = 40 (ragged against every tile), with a reduced grid: every E in {8, 64, 128}, K in {1, 2, 8} and R in
{1, 2, 3, 16, 17, 64, 65} is covered on each path, not their full product. Real shapes (H = 2816, I = 704,
E = 128, K = 8, R up to 1024) run under ``@pytest.mark.gpu``.

Tolerances. Outputs are O(1). fp32: atol = rtol = 1e-4 (only summation order differs). bf16: the kernel is
compared with the fp32 reference on the same bf16 numbers, atol = rtol = 1e-2 (the intermediate, each pair's
output and the result are rounded to bf16, 2^-9 relative each). FP8 W8A8: (a) against the FP8 twin (same
quantization of x and of the intermediate), atol = rtol = 2e-2 (a one-ulp e4m3 flip of an activation
where the kernel's fp32 division rounds differently); (b) NMSE against the fp32 reference with the
dequantized weights (unquantized activations) < 4e-3: two e4m3 roundings of activations (x and the
intermediate) at ~1e-3 NMSE each, measured 1.8e-3 here.

Run as a script on a GPU: ``python tests/kernels/moe/test_moe_kernels.py`` prints the MoE-layer benchmark.
"""
import json

import pytest
import torch

from sparrow.kernels import backend
from sparrow.kernels.moe import moe_configs
from sparrow.kernels.gemm.fp8 import dequantize_fp8_block_ref, quantize_fp8_block_ref
from sparrow.kernels.moe.moe import (
    SMALL_MAX_PAIRS,
    fused_moe,
    fused_moe_ref,
    fused_moe_triton,
    moe_align_ref,
    moe_align_triton,
    moe_reduce_ref,
    moe_reduce_triton,
)
from sparrow.kernels.moe.moe_configs import MoeConfig, Tile, forced_config, pick_config
from sparrow.kernels.moe.moe_ref import fused_moe_grouped_ref, fused_moe_per_pair_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
H, I = 64, 40
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
FP8_TOL = dict(atol=2e-2, rtol=2e-2)
FP8_NMSE = 4e-3
# Small tiles keep the interpreter fast and make every shape ragged; FP8 needs block_k = 128.
CPU_CFG = MoeConfig(16, Tile(32, 32), Tile(64, 32))  # gate|up: 2 ragged N tiles of I = 40; down: 1
CPU_CFG_FP8 = MoeConfig(16, Tile(32, 128), Tile(64, 128))
GROUPED, SMALL = 0, 10**9  # pair_threshold forcing each path (small while P <= SMALL_MAX_PAIRS)

# (E, K, R): the grouped path sees every E, K and R; the small path every E, K and the R with P <= 256
GROUPED_CASES = [(8, 2, 1), (8, 8, 17), (64, 1, 65), (64, 8, 3), (8, 8, 64), (128, 2, 16), (128, 8, 17),
                 (8, 1, 2)]
SMALL_CASES = [(8, 8, 1), (8, 2, 17), (64, 1, 65), (64, 8, 3), (128, 8, 2), (128, 2, 16), (128, 8, 4),
               (8, 1, 64)]


def _nmse(a, b):
    return float(((a.float() - b.float()) ** 2).mean() / (b.float() ** 2).mean())


def _routing(rows, num_experts, top_k, seed=0, skew=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, num_experts, generator=g)
    if skew:  # every row's first choice is expert 3: one crowded expert
        logits[:, 3] += 100.0
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return weights.to(DEVICE), ids.to(DEVICE)


def _weights(num_experts, hidden, width, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * width, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, width, generator=g) / width**0.5 * 2
    return w13.to(dtype).to(DEVICE), w2.to(dtype).to(DEVICE)


def _case(num_experts, top_k, rows, dtype, hidden=H, width=I, seed=0, skew=False):
    g = torch.Generator().manual_seed(seed + 7)
    x = torch.randn(rows, hidden, generator=g).to(dtype).to(DEVICE)
    w13, w2 = _weights(num_experts, hidden, width, dtype)
    tw, ti = _routing(rows, num_experts, top_k, seed, skew)
    return x, w13, w2, tw, ti


def _quantize_experts(w):
    """[E, N, K] -> (e4m3 [E, N, K], fp32 scales [E, ceil(N/128), ceil(K/128)])."""
    qs = [quantize_fp8_block_ref(we) for we in w.float()]
    return torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs])


def _dequantize_experts(q, s):
    return torch.stack([dequantize_fp8_block_ref(qe, se) for qe, se in zip(q, s)])


def _cfg(fp8=False):
    return forced_config(CPU_CFG_FP8 if fp8 else CPU_CFG) if not ON_GPU else _nullcontext()


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _check_against_fp32_ref(out, x, w13, w2, tw, ti, activation="silu", swiglu_limit=None):
    want = fused_moe_grouped_ref(x.float(), w13.float(), w2.float(), tw, ti, activation, swiglu_limit)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), want, **TOL[x.dtype])


# ------------------------------------------------------------------------------------------- align


@pytest.mark.parametrize("num_experts,block_m", [(8, 16), (64, 64), (128, 16)])
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_align_matches_twin(num_experts, top_k, block_m):
    for rows in (1, 3, 17, 65) if num_experts < 128 else (2, 16, 64):
        if top_k > num_experts:
            continue
        _, ids = _routing(rows, num_experts, top_k, seed=rows, skew=rows == 17)
        got = moe_align_triton(ids.int(), num_experts, block_m)
        want = moe_align_ref(ids, num_experts, block_m)
        for g, w in zip(got, want):
            assert g.dtype == torch.int32
            torch.testing.assert_close(g, w, atol=0, rtol=0)
        sorted_ids, block_expert, total = want
        pairs = ids.numel()
        valid = sorted_ids[sorted_ids < pairs].long()
        assert sorted(valid.tolist()) == list(range(pairs))  # every pair exactly once
        assert int(total) % block_m == 0 and bool((sorted_ids[int(total):] == pairs).all())
        experts = block_expert.repeat_interleave(block_m)[: sorted_ids.numel()]
        keep = sorted_ids < pairs
        assert torch.equal(experts[keep].long(), ids.reshape(-1)[sorted_ids[keep].long()].long())


# ------------------------------------------------------------------------------------------ reduce


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduce_matches_twin(dtype):
    g = torch.Generator().manual_seed(0)
    rows, top_k, hidden = 5, 3, 200
    y = torch.randn(rows * top_k, hidden, generator=g).to(dtype).to(DEVICE)
    w = torch.rand(rows, top_k, generator=g).to(DEVICE)
    torch.testing.assert_close(moe_reduce_triton(y, w), moe_reduce_ref(y, w), **TOL[dtype])


# ------------------------------------------------------------------------------------------ experts


@pytest.mark.parametrize("path", ["grouped", "small"])
@pytest.mark.parametrize("case", range(8))
def test_experts_match_reference(path, case):
    num_experts, top_k, rows = (GROUPED_CASES if path == "grouped" else SMALL_CASES)[case]
    dtype = torch.float32 if case % 2 else torch.bfloat16
    x, w13, w2, tw, ti = _case(num_experts, top_k, rows, dtype, seed=case)
    with _cfg():
        out = fused_moe_triton(x, w13, w2, tw, ti.int() if case % 3 == 0 else ti,
                               pair_threshold=GROUPED if path == "grouped" else SMALL)
    _check_against_fp32_ref(out, x, w13, w2, tw, ti)
    if dtype == torch.float32:  # and the layer's per-pair / grouped twin directly
        ref = (fused_moe_grouped_ref if path == "grouped" else fused_moe_per_pair_ref)(x, w13, w2, tw, ti)
        torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("path", ["grouped", "small"])
@pytest.mark.parametrize("activation,limit", [("gelu_pytorch_tanh", None), ("gelu", None), ("silu", 0.3)])
def test_activations_and_swiglu_limit(path, activation, limit):
    x, w13, w2, tw, ti = _case(8, 2, 17, torch.bfloat16, seed=3)
    with _cfg():
        out = fused_moe_triton(x, w13, w2, tw, ti, activation, swiglu_limit=limit,
                               pair_threshold=GROUPED if path == "grouped" else SMALL)
    _check_against_fp32_ref(out, x, w13, w2, tw, ti, activation, limit)


@pytest.mark.parametrize("path", ["grouped", "small"])
def test_one_crowded_expert(path):
    """65 rows all pick expert 3 first: 65 pairs in one expert (> the small path's 64 dot rows: it loops)."""
    x, w13, w2, tw, ti = _case(8, 1, 65, torch.float32, skew=True)
    assert bool((ti == 3).all())
    with _cfg():
        out = fused_moe_triton(x, w13, w2, tw, ti, pair_threshold=GROUPED if path == "grouped" else SMALL)
    _check_against_fp32_ref(out, x, w13, w2, tw, ti)


@pytest.mark.parametrize("num_experts,top_k,rows", [(8, 2, 17), (64, 1, 16)])
def test_fp8_swapped_dots_on_the_grouped_path(num_experts, top_k, rows):
    x, w13, w2, tw, ti = _case(num_experts, top_k, rows, torch.bfloat16, seed=rows)
    q13, s13 = _quantize_experts(w13)
    q2, s2 = _quantize_experts(w2)
    cfg = MoeConfig(16, Tile(64, 128, swap_ab=True), Tile(64, 128, swap_ab=True))
    with forced_config(cfg):
        out = fused_moe_triton(x, q13, q2, tw, ti, w13_scale=s13, w2_scale=s2, pair_threshold=GROUPED)
    torch.testing.assert_close(out.float(), fused_moe_ref(x, q13, q2, tw, ti, w13_scale=s13, w2_scale=s2).float(),
                               **FP8_TOL)


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("num_experts,top_k,rows,dtype", [(8, 2, 17, torch.bfloat16), (64, 8, 3, torch.bfloat16),
                                                          (8, 2, 5, torch.float32)])
def test_fp8_prequantized_activations_on_the_grouped_path(num_experts, top_k, rows, dtype, swap):
    """``Tile.a_fp8``: x and the intermediate quantized by their own launch before each grouped GEMM. The
    quantizer gives exactly the in-kernel quantization's e4m3 values and scales (both are the formula of
    ``quantize_fp8_per_group_ref``, checked bit for bit here; the intermediate's K = 40 is one ragged group).
    The two GEMMs then differ only in how the e4m3 operand reaches the dot: under the interpreter each
    ``tl.dot`` is a numpy fp32 matmul whose summation order depends on the BLAS build and the operands'
    layout (a clean triton 3.9 / torch 2.13 venv gave last-bit differences on the fp32 swapped case), so the
    outputs are compared at atol = rtol = 1e-5 (O(1) values, a few fp32 ulps of a 64-term sum; a sum that
    lands on an e4m3 rounding boundary of the intermediate could still flip one step, about 2^-20 a value),
    and both against the twin."""
    from sparrow.kernels.gemm.fp8 import quantize_fp8_per_group_ref
    from sparrow.kernels.gemm.scaled_mm import quantize_fp8_per_group_triton

    x, w13, w2, tw, ti = _case(num_experts, top_k, rows, dtype, seed=rows)
    with backend("triton"):
        for got, want in zip(quantize_fp8_per_group_triton(x), quantize_fp8_per_group_ref(x)):
            torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=0)
    q13, s13 = _quantize_experts(w13)
    q2, s2 = _quantize_experts(w2)
    outs = []
    for a_fp8 in (False, True):
        tile = Tile(64 if swap else 32, 128, swap_ab=swap, a_fp8=a_fp8)
        with forced_config(MoeConfig(16, tile, tile)):
            outs.append(fused_moe_triton(x, q13, q2, tw, ti, w13_scale=s13, w2_scale=s2, pair_threshold=GROUPED))
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=1e-5, rtol=1e-5)
    twin = fused_moe_ref(x, q13, q2, tw, ti, w13_scale=s13, w2_scale=s2)
    torch.testing.assert_close(outs[1].float(), twin.float(), **FP8_TOL)


@pytest.mark.parametrize("rows", [16, 128, 256])
def test_fp8_default_grouped_tiles(rows):
    """``default_config``'s FP8 grouped tiles (swapped dots; BLOCK_M 16 at 4 pairs an expert, 32 at 32, and
    ``a_fp8`` at 64) against the twin: the tiles untuned shapes and devices get."""
    x, w13, w2, tw, ti = _case(8, 2, rows, torch.bfloat16, seed=rows)
    cfg = moe_configs.default_config(rows, rows * 2, 8, False, True)
    assert cfg.gate_up.swap_ab and cfg.gate_up.a_fp8 == (rows * 2 / 8 >= 64)
    q13, s13 = _quantize_experts(w13)
    q2, s2 = _quantize_experts(w2)
    with forced_config(cfg):  # as pick_config returns it where no table matches (the CPU has none)
        out = fused_moe_triton(x, q13, q2, tw, ti, w13_scale=s13, w2_scale=s2, pair_threshold=GROUPED)
    twin = fused_moe_ref(x, q13, q2, tw, ti, w13_scale=s13, w2_scale=s2)
    torch.testing.assert_close(out.float(), twin.float(), **FP8_TOL)


@pytest.mark.parametrize("path", ["grouped", "small"])
@pytest.mark.parametrize("num_experts,top_k,rows", [(8, 2, 17), (128, 8, 3), (64, 1, 16)])
def test_fp8(path, num_experts, top_k, rows):
    x, w13, w2, tw, ti = _case(num_experts, top_k, rows, torch.bfloat16, seed=rows)
    q13, s13 = _quantize_experts(w13)
    q2, s2 = _quantize_experts(w2)
    with _cfg(fp8=True):
        out = fused_moe_triton(x, q13, q2, tw, ti, w13_scale=s13, w2_scale=s2,
                               pair_threshold=GROUPED if path == "grouped" else SMALL)
    twin = fused_moe_ref(x, q13, q2, tw, ti, w13_scale=s13, w2_scale=s2)
    torch.testing.assert_close(out.float(), twin.float(), **FP8_TOL)
    deq = fused_moe_grouped_ref(x.float(), _dequantize_experts(q13, s13), _dequantize_experts(q2, s2), tw, ti)
    assert _nmse(out, deq) < FP8_NMSE


@pytest.mark.parametrize("path", ["grouped", "small"])
def test_unreduced_pairs(path):
    """``reduce=False``: the per-pair outputs [P, H] that moe_reduce_triton turns into the reduced output."""
    x, w13, w2, tw, ti = _case(8, 2, 17, torch.float32, seed=5)
    threshold = GROUPED if path == "grouped" else SMALL
    with _cfg():
        pairs = fused_moe_triton(x, w13, w2, tw, ti, pair_threshold=threshold, reduce=False)
        out = fused_moe_triton(x, w13, w2, tw, ti, pair_threshold=threshold)
    assert pairs.shape == (34, x.shape[1])
    torch.testing.assert_close(moe_reduce_triton(pairs, tw, x.dtype), out, atol=0, rtol=0)
    torch.testing.assert_close(pairs, fused_moe_ref(x, w13, w2, tw, ti, reduce=False), atol=1e-4, rtol=1e-4)


FLOAT_SPLITS = [(8, 8, 1, False), (8, 2, 17, False), (64, 1, 65, False), (128, 8, 2, False), (8, 8, 1, True),
                (8, 2, 17, True)]
FP8_SPLITS = [(8, 8, 1, False), (8, 2, 17, False), (8, 8, 1, True)]  # the interpreter's slowest left to float


@pytest.mark.parametrize("num_experts,top_k,rows,swap,fp8", [(*c, False) for c in FLOAT_SPLITS]
                         + [(*c, True) for c in FP8_SPLITS])
def test_small_path_split_k(num_experts, top_k, rows, fp8, swap):
    """The small path with K split over programs and reduced in the kernel (ragged splits, some empty);
    ``swap``: the swapped dots (weight tile as the MMA's M side, accumulators transposed at the end)."""
    dtype = torch.bfloat16 if fp8 or rows == 1 else torch.float32
    x, w13, w2, tw, ti = _case(num_experts, top_k, rows, dtype, hidden=384 if fp8 else H,
                               width=136 if fp8 else I, seed=rows)
    if fp8:
        cfg = MoeConfig(16, Tile(32, 128, split_k=2, swap_ab=swap), Tile(64, 128, split_k=0, swap_ab=swap))
        q13, s13 = _quantize_experts(w13)
        q2, s2 = _quantize_experts(w2)
        with forced_config(cfg):
            out = fused_moe_triton(x, q13, q2, tw, ti, w13_scale=s13, w2_scale=s2, pair_threshold=SMALL)
            again = fused_moe_triton(x, q13, q2, tw, ti, w13_scale=s13, w2_scale=s2, pair_threshold=SMALL)
        torch.testing.assert_close(out.float(), fused_moe_ref(x, q13, q2, tw, ti, w13_scale=s13, w2_scale=s2).float(),
                                   **FP8_TOL)
    else:
        cfg = MoeConfig(16, Tile(32, 16, split_k=3, swap_ab=swap), Tile(64, 16, split_k=2, swap_ab=swap))
        with forced_config(cfg):
            out = fused_moe_triton(x, w13, w2, tw, ti, pair_threshold=SMALL)
            again = fused_moe_triton(x, w13, w2, tw, ti, pair_threshold=SMALL)
        _check_against_fp32_ref(out, x, w13, w2, tw, ti)
    assert torch.equal(out, again)  # counters reset, partials summed in split order


def test_dispatcher_picks_backend_and_path():
    x, w13, w2, tw, ti = _case(8, 2, 40, torch.float32)  # P = 80
    with backend("torch"):
        assert torch.equal(fused_moe(x, w13, w2, tw, ti), fused_moe_grouped_ref(x, w13, w2, tw, ti))
        assert torch.equal(fused_moe(x, w13, w2, tw, ti, pair_threshold=80), fused_moe_per_pair_ref(x, w13, w2, tw, ti))
    with backend("triton"), _cfg():
        torch.testing.assert_close(fused_moe(x[:1], w13, w2, tw[:1], ti[:1]),
                                   fused_moe_grouped_ref(x[:1], w13, w2, tw[:1], ti[:1]), **TOL[torch.float32])
    assert fused_moe_triton(x[:0], w13, w2, tw[:0], ti[:0]).shape == (0, H)


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda x, w13, w2, tw, ti: fused_moe_triton(x, w13[:, :, :-1], w2, tw, ti), "gate_up_proj"),
        (lambda x, w13, w2, tw, ti: fused_moe_triton(x, w13, w2[:, :, :-1], tw, ti), "down_proj"),
        (lambda x, w13, w2, tw, ti: fused_moe_triton(x, w13, w2, tw, ti.float()), "topk_ids"),
        (lambda x, w13, w2, tw, ti: fused_moe_triton(x, w13, w2, tw[:, :1], ti), "topk_weights"),
        (lambda x, w13, w2, tw, ti: fused_moe_triton(x, w13, w2, tw, ti, "relu"), "activation"),
        (lambda x, w13, w2, tw, ti: fused_moe_triton(x, w13.bfloat16(), w2, tw, ti), "dtype"),
        (lambda x, w13, w2, tw, ti: fused_moe_triton(x, w13, w2, tw, ti, w13_scale=torch.ones(1)), "w2_scale"),
        (lambda x, w13, w2, tw, ti: fused_moe_triton(x, w13, w2, tw, ti, w13_scale=torch.ones(1, 1, 1),
                                                     w2_scale=torch.ones(1, 1, 1)), "float8"),
        (lambda x, w13, w2, tw, ti: moe_reduce_ref(torch.zeros(5, H), tw), "moe_reduce"),
        (lambda x, w13, w2, tw, ti: moe_align_triton(ti, 8, 24), "block_m"),
    ],
)
def test_rejects(bad, match):
    with pytest.raises(ValueError, match=match):
        bad(*_case(8, 2, 3, torch.float32))


def test_config_table_nearest_rows_and_forcing(tmp_path, monkeypatch):
    a, b = MoeConfig(16, Tile(32, 256), Tile(64, 256)), MoeConfig(64, Tile(128, 64), Tile(128, 64))
    path = moe_configs.config_file(8, H, I, False, "Fake GPU")
    monkeypatch.setattr(moe_configs, "CONFIG_DIR", tmp_path)
    path = tmp_path / path.name
    path.write_text(json.dumps({"configs": {"1": a.to_json(), "256": b.to_json()}}))
    moe_configs._load.cache_clear()
    assert pick_config(3, 8, 8, H, I, True, False, "Fake GPU") == a
    assert pick_config(200, 8, 8, H, I, False, False, "Fake GPU") == b
    fp8_default = moe_configs.default_config(200, 1600, 8, False, True)
    assert pick_config(200, 8, 8, H, I, False, True, "Fake GPU") == fp8_default  # no fp8 file: the heuristic
    with forced_config(b):
        assert pick_config(1, 8, 8, H, I, True, False, "Fake GPU") == b
    moe_configs._load.cache_clear()


def test_config_table_fma_entries_small_path_only(tmp_path, monkeypatch):
    """An entry of FMA tiles (swept at one row on the small path) is the nearest for every row count of the small
    path; the grouped path skips it: the nearest entry without FMA tiles, else the default tiles."""
    fma = MoeConfig(16, Tile(64, 128, split_k=4, fma_rows=1), Tile(128, 128, fma_rows=1))
    grouped = MoeConfig(64, Tile(128, 64), Tile(128, 64))
    monkeypatch.setattr(moe_configs, "CONFIG_DIR", tmp_path)
    path = moe_configs.config_file(8, H, I, False, "Fake GPU", "int4")
    path.write_text(json.dumps({"configs": {"1": fma.to_json()}}))
    moe_configs._load.cache_clear()
    try:
        assert pick_config(1, 8, 8, H, I, True, False, "Fake GPU", "int4") == fma
        assert pick_config(8, 8, 8, H, I, True, False, "Fake GPU", "int4") == fma
        assert pick_config(64, 8, 8, H, I, False, False, "Fake GPU", "int4") == \
            moe_configs.default_w4_config(64, 512, 8, False)
        path.write_text(json.dumps({"configs": {"1": fma.to_json(), "1024": grouped.to_json()}}))
        moe_configs._load.cache_clear()
        assert pick_config(2, 8, 8, H, I, False, False, "Fake GPU", "int4") == grouped
        assert pick_config(2, 8, 8, H, I, True, False, "Fake GPU", "int4") == fma
    finally:
        moe_configs._load.cache_clear()


def test_shipped_config_files_parse():
    files = sorted(moe_configs.CONFIG_DIR.glob("E*_H*_I*.json"))  # the MoE tables (w4_linear_*: dense)
    assert files, "no tile-config data files shipped"
    for f in files:
        table = moe_configs._load(f)
        assert table and all(c.block_m >= 16 for c in table.values())


# ------------------------------------------------------------------------------------- GPU, real shapes


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16, 17, 64, 65, 1024])
@pytest.mark.parametrize("activation", ["gelu_pytorch_tanh", "silu"])
def test_gpu_gemma4_shape(rows, fp8, activation):
    x, w13, w2, tw, ti = _case(128, 8, rows, torch.bfloat16, hidden=2816, width=704, seed=rows)
    if fp8:
        q13, s13 = _quantize_experts(w13)
        q2, s2 = _quantize_experts(w2)
        out = fused_moe_triton(x, q13, q2, tw, ti, activation, w13_scale=s13, w2_scale=s2)
        twin = fused_moe_ref(x, q13, q2, tw, ti, activation, w13_scale=s13, w2_scale=s2)
        torch.testing.assert_close(out.float(), twin.float(), **FP8_TOL)
        deq = fused_moe_grouped_ref(x.float(), _dequantize_experts(q13, s13), _dequantize_experts(q2, s2), tw, ti,
                                    activation)
        assert _nmse(out, deq) < FP8_NMSE
    else:
        out = fused_moe_triton(x, w13, w2, tw, ti, activation)
        _check_against_fp32_ref(out, x, w13, w2, tw, ti, activation)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 64, 1024])
def test_gpu_fp8_experts_fp32_activations(rows):
    """FP8 experts with fp32 activations (an fp32 model quantized at load) at Gemma 4's shape, the table's
    tiles through ``_fp32_config``: against the twin, which quantizes the same fp32 x."""
    x, w13, w2, tw, ti = _case(128, 8, rows, torch.float32, hidden=2816, width=704, seed=rows)
    q13, s13 = _quantize_experts(w13)
    q2, s2 = _quantize_experts(w2)
    out = fused_moe_triton(x, q13, q2, tw, ti, "gelu_pytorch_tanh", w13_scale=s13, w2_scale=s2)
    twin = fused_moe_ref(x, q13, q2, tw, ti, "gelu_pytorch_tanh", w13_scale=s13, w2_scale=s2)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, twin, **FP8_TOL)
    assert _nmse(out, twin) < 1e-5


def test_fp32_config_keeps_fp8_scale_groups():
    """fp32 activations on the GPU halve K steps and stages; FP8 weights keep whole 128-column scale groups
    (the H200 failure: a 64-wide K step refused by the FP8 check)."""
    from sparrow.kernels.moe.moe import _fp32_config
    from sparrow.kernels.moe.moe_configs import MoeConfig, Tile

    cfg = MoeConfig(16, Tile(64, 128, num_stages=3), Tile(64, 256, num_stages=4))
    fp8 = _fp32_config(cfg, fp8=True)
    assert (fp8.gate_up.block_k, fp8.down.block_k, fp8.down.num_stages) == (128, 128, 2)
    bf16 = _fp32_config(cfg, fp8=False)
    assert (bf16.gate_up.block_k, bf16.down.block_k) == (64, 128)


def test_small_path_tile_fits_shared_memory():
    """A forced small path at 65 rows pads the dot to 128 rows: a 3-stage 256 x 32 tile would need 288 KB of
    shared memory (the H200 failure), so the launcher drops to 2 stages; tiles that fit are left alone."""
    from sparrow.kernels.moe.moe import SHARED_MEMORY_BUDGET, _fit_shared_memory
    from sparrow.kernels.moe.moe_configs import Tile

    tile = Tile(block_n=32, block_k=256, num_warps=4, num_stages=3)
    fitted = _fit_shared_memory(tile, 128, 2, 2, gated=True)
    assert fitted.num_stages == 2 and 2 * (128 * 256 * 2 + 2 * 256 * 32 * 2) <= SHARED_MEMORY_BUDGET
    assert _fit_shared_memory(tile, 16, 2, 2, gated=True) is tile


def test_tune_writes_after_each_row_count_and_keeps_other_entries(tmp_path):
    """benchmarks/moe_layer.py --tune rewrites the data file per row count: earlier entries stay, meta lists the
    tuned rows, and the entries parse back as MoeConfig."""
    import json
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks"))
    import moe_layer

    from sparrow.kernels.moe.moe_configs import MoeConfig, Tile

    def cfg(n):
        return MoeConfig(16, Tile(n, 128), Tile(n, 256)).to_json()

    moe_layer.write_table({"64": cfg(32)}, "fp8", tmp_path, "Some GPU", "x")
    path = moe_layer.write_table({"1": cfg(16)}, "fp8", tmp_path, "Some GPU", "x")
    data = json.loads(path.read_text())
    assert list(data["configs"]) == ["1", "64"] and data["meta"]["tuned_rows"] == [1, 64]
    assert MoeConfig.from_json(data["configs"]["1"]).gate_up.block_n == 16


def test_moe_layer_bench_shapes(tmp_path, monkeypatch):
    """moe_layer.py --shape takes H, E, K, I from sparrow bench's MoE model shapes (its data file is named by
    them); a dense shape is refused by name."""
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks"))
    import moe_layer

    from sparrow.kernels.moe.moe_configs import MoeConfig, Tile

    for name in ("H", "E", "K", "I"):
        monkeypatch.setattr(moe_layer, name, getattr(moe_layer, name))
    moe_layer.set_shape("qwen3-30b-a3b")
    assert (moe_layer.H, moe_layer.E, moe_layer.K, moe_layer.I) == (2048, 128, 8, 768)
    path = moe_layer.write_table({"1": MoeConfig(16, Tile(32, 128), Tile(32, 128)).to_json()}, "fp8", tmp_path,
                                 "Some GPU", "x")
    assert path.name == "E128_H2048_I768_fp8_Some_GPU.json"
    path = moe_layer.write_table({"1": MoeConfig(16, Tile(32, 128), Tile(32, 128)).to_json()}, "int4", tmp_path,
                                 "Some GPU", "x")
    assert path.name == "E128_H2048_I768_int4_Some_GPU.json"
    moe_layer.set_shape("gemma4-26b-a4b")
    assert (moe_layer.H, moe_layer.E, moe_layer.K, moe_layer.I) == (2816, 128, 8, 704)
    with pytest.raises(SystemExit, match="llama3-8b.*not an MoE model shape"):
        moe_layer.set_shape("llama3-8b")


@pytest.mark.gpu
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (64, 1), (128, 8), (256, 8)])
@pytest.mark.parametrize("rows", [1, 17, 65, 1024])
@pytest.mark.parametrize("path", ["grouped", "small"])
def test_gpu_paths_and_align(num_experts, top_k, rows, path):
    if path == "small" and rows * top_k > SMALL_MAX_PAIRS:
        pytest.skip("small path holds at most SMALL_MAX_PAIRS pairs")
    x, w13, w2, tw, ti = _case(num_experts, top_k, rows, torch.bfloat16, hidden=1024, width=320, seed=rows)
    out = fused_moe_triton(x, w13, w2, tw, ti, pair_threshold=GROUPED if path == "grouped" else SMALL)
    _check_against_fp32_ref(out, x, w13, w2, tw, ti)
    for g, w in zip(moe_align_triton(ti, num_experts, 64), moe_align_ref(ti, num_experts, 64)):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_small_path_split_k(rows, fp8, split, swap):
    x, w13, w2, tw, ti = _case(128, 8, rows, torch.bfloat16, hidden=2816, width=704, seed=rows)
    n = 64 if swap else 32  # swapped: the weight tile is the wgmma's M side (64 rows)
    cfg = MoeConfig(16, Tile(n, 256, split_k=split, swap_ab=swap), Tile(2 * n, 256, split_k=split, swap_ab=swap))
    with forced_config(cfg):
        if fp8:
            q13, s13 = _quantize_experts(w13)
            q2, s2 = _quantize_experts(w2)
            out = fused_moe_triton(x, q13, q2, tw, ti, w13_scale=s13, w2_scale=s2)
            twin = fused_moe_ref(x, q13, q2, tw, ti, w13_scale=s13, w2_scale=s2)
            torch.testing.assert_close(out.float(), twin.float(), **FP8_TOL)
        else:
            out = fused_moe_triton(x, w13, w2, tw, ti)
            _check_against_fp32_ref(out, x, w13, w2, tw, ti)


@pytest.mark.gpu
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("rows", [65, 1024, 4096])
def test_gpu_fp8_prequantized_activations(rows, swap):
    """``Tile.a_fp8`` on the grouped path at Gemma 4's shape (prefill tiles: 64 / 128 pairs a block) against
    the twin, and against the in-kernel quantization with the same tiles."""
    x, w13, w2, tw, ti = _case(128, 8, rows, torch.bfloat16, hidden=2816, width=704, seed=rows)
    q13, s13 = _quantize_experts(w13)
    q2, s2 = _quantize_experts(w2)
    outs = []
    for a_fp8 in (False, True):
        tile = Tile(128, 128, num_warps=8 if not swap else 4, num_stages=3, swap_ab=swap, a_fp8=a_fp8)
        with forced_config(MoeConfig(32 if swap else 128, tile, tile)):
            outs.append(fused_moe_triton(x, q13, q2, tw, ti, "gelu_pytorch_tanh", w13_scale=s13, w2_scale=s2))
    twin = fused_moe_ref(x, q13, q2, tw, ti, "gelu_pytorch_tanh", w13_scale=s13, w2_scale=s2)
    for out in outs:
        torch.testing.assert_close(out.float(), twin.float(), **FP8_TOL)
    assert _nmse(outs[1], outs[0]) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 8])
def test_gpu_fp8_small_path_wide_k(rows):
    """The swapped FP8 small-path tiles with 1024-wide K steps (``moe_layer.py --tune``'s rows-1 pick, sixth
    session: gate|up 64 x 1024 with 3 K splits (H = 2816 has 3 steps), down 128 x 1024 in one step) against the
    twin at Gemma 4's shape."""
    x, w13, w2, tw, ti = _case(128, 8, rows, torch.bfloat16, hidden=2816, width=704, seed=rows)
    q13, s13 = _quantize_experts(w13)
    q2, s2 = _quantize_experts(w2)
    cfg = MoeConfig(16, Tile(64, 1024, split_k=4, swap_ab=True), Tile(128, 1024, split_k=4, swap_ab=True))
    with forced_config(cfg):
        out = fused_moe_triton(x, q13, q2, tw, ti, w13_scale=s13, w2_scale=s2)
    twin = fused_moe_ref(x, q13, q2, tw, ti, w13_scale=s13, w2_scale=s2)
    torch.testing.assert_close(out.float(), twin.float(), **FP8_TOL)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture():
    """The whole small and grouped chains capture into a CUDA graph (no host sync) and replay correctly."""
    for rows in (1, 64):
        x, w13, w2, tw, ti = _case(128, 8, rows, torch.bfloat16, hidden=2816, width=704)
        out = fused_moe_triton(x, w13, w2, tw, ti)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fused_moe_triton(x, w13, w2, tw, ti)
        _, new_ids = _routing(rows, 128, 8, seed=99)
        ti.copy_(new_ids)
        graph.replay()
        torch.testing.assert_close(captured, fused_moe_triton(x, w13, w2, tw, ti), atol=0, rtol=0)
        assert not torch.equal(captured, out)


if __name__ == "__main__":
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks"))
    import moe_layer

    moe_layer.main(sys.argv[1:])
