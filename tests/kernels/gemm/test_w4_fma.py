"""The FMA GEMV of the 4-bit kernels (``Int4Config.fma``, ``Tile.fma_rows``: rows as fp32 FMAs on the decoded
nibble planes, no dots) against the torch twins, int4 and NVFP4, dense linears and the small MoE path.
CPU: TRITON_INTERPRET=1 at tiny shapes (tests/conftest.py); the GPU-marked tests at gemma4-26b-a4b's shapes.

Budgets: the FMA path multiplies x by the exact weight values (int4: u - zero, then the group scale on the sums;
NVFP4: e2m1 times x * 2^64, the block scale on each word's sum) in fp32, so against the fp32 twins only the
summation order differs (fp32: atol 1e-4 on outputs of magnitude ~1; NVFP4 dense NMSE 1e-10); bf16 / fp16: one
output rounding plus the twin's bf16 weights (NMSE <= 1e-5 dense; MoE 1e-4: the twin also rounds gate|up before
the activation), as tests/kernels/gemm/test_int4_kernels.py and test_nvfp4_*.py state."""
from __future__ import annotations

import json

import pytest
import torch

from sparrow.kernels import backend
from sparrow.kernels.gemm.int4 import Int4Config, forced_config, int4_linear, int4_linear_ref, quantize_int4_ref
from sparrow.kernels.moe.int4_moe import int4_fused_moe, int4_fused_moe_ref
from sparrow.kernels.moe.moe_configs import MoeConfig, Tile, forced_config as moe_forced_config
from sparrow.kernels.gemm.nvfp4 import quantize_nvfp4_ref
from sparrow.kernels.gemm.nvfp4_linear import nvfp4_linear_triton, nvfp4_linear_w4a16_ref
from sparrow.kernels.moe.nvfp4_moe import nvfp4_fused_moe, nvfp4_fused_moe_ref
from tests.helpers import nmse

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32_ATOL = 1e-4
DENSE_NMSE = 1e-5
MOE_NMSE = 1e-4


def _check(got, want, dtype, budget):
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=0)
    else:
        assert nmse(got, want) <= budget


def _x(rows, k, dtype, seed, device=DEVICE):
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def _int4(n, k, group, symmetric, scale_dtype, seed=0, device=DEVICE):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1
    return quantize_int4_ref(w.to(device), group, symmetric, scale_dtype)


def _nvfp4(n, k, seed=0, device=DEVICE):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k ** 0.5
    codes, scale, g2 = quantize_nvfp4_ref(w.to(device))
    g = g2.expand(n).clone()
    g[: n // 2] *= 0.5  # two shards with different global scales
    return codes, scale, g


# K = 200 (int4 group 64): 64-column steps and a masked tail; 32-column steps (two a group); N = 40 ragged against
# 16 / 32-wide tiles
DENSE_CFGS = [Int4Config(block_m=1, block_n=16, block_k=64, split_k=1, fma=True),
              Int4Config(block_m=2, block_n=32, block_k=32, split_k=2, fma=True),
              Int4Config(block_m=4, block_n=16, block_k=64, split_k=0, fma=True)]


@pytest.mark.parametrize("rows", (1, 2, 3, 5))  # 3 and 5 rows take several M tiles at block_m 1 / 2 / 4
@pytest.mark.parametrize("symmetric,scale_dtype,dtype", [(False, torch.float32, torch.float32),
                                                         (True, torch.bfloat16, torch.bfloat16)])
def test_int4_linear_fma(rows, symmetric, scale_dtype, dtype):
    packed, scale, zero = _int4(40, 200, 64, symmetric, scale_dtype)
    x = _x(rows, 200, dtype, rows)
    want = int4_linear_ref(x, packed, scale, zero, 64)
    for cfg in DENSE_CFGS:
        with backend("triton"), forced_config(cfg):
            got = int4_linear(x, packed, scale, zero, 64)
        _check(got, want, dtype, DENSE_NMSE)


@pytest.mark.parametrize("rows", (1, 3))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
def test_nvfp4_linear_fma(rows, dtype):
    """K = 208: 16-column blocks past the last whole 64-column step (a masked tail); fp16 too (the FMA path
    keeps its sums in fp32, unlike the dots' unscaled fp16 weights)."""
    codes, scale, g = _nvfp4(40, 208)
    x = _x(rows, 208, dtype, rows + 10)
    want = nvfp4_linear_w4a16_ref(x, codes, scale, g)
    for cfg in DENSE_CFGS:
        with forced_config(cfg):
            got = nvfp4_linear_triton(x, codes, scale, g)
        assert nmse(got, want) <= (1e-10 if dtype == torch.float32 else DENSE_NMSE)


def _moe_case(rows, e, h, i, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed + rows)
    x = torch.randn(rows, h, generator=g).to(dtype).to(DEVICE)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(rows)]).to(DEVICE)
    wts = torch.softmax(torch.randn(rows, k, generator=g), -1).to(DEVICE)
    return x, wts, ids


def _int4_experts(e, h, i, group, symmetric, scale_dtype, device=DEVICE):
    w13 = _int4(e * 2 * i, h, group, symmetric, scale_dtype, 1, device)
    w2 = _int4(e * h, i, group, symmetric, scale_dtype, 2, device)
    stack = lambda t, n: None if t is None else t.reshape(e, n, -1)  # noqa: E731
    return tuple(stack(t, 2 * i) for t in w13), tuple(stack(t, h) for t in w2)


def _nvfp4_experts(e, h, i, device=DEVICE):
    """Stacked NVFP4 experts (codes, scale, global [E, shards]) for gate|up (2 shards) and down, each expert
    quantized on its own (a per-expert export's global scales; small temporaries at gemma4's shapes), the up
    shard's global halved (two shards with different global scales)."""
    out = []
    for n, k, halves, seed in ((2 * i, h, 2, 1), (h, i, 1, 2)):
        w = (torch.randn(e, n, k, generator=torch.Generator().manual_seed(seed)) / k ** 0.5).to(device)
        parts = [quantize_nvfp4_ref(w[x]) for x in range(e)]
        g = torch.cat([p[2] for p in parts]).unsqueeze(1).repeat(1, halves)
        if halves == 2:
            g[:, 1] *= 0.5
        out += [torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]), g.contiguous()]
    return out


# gate|up: 2 rows at a time with K split over 2 programs; down: one row at a time, 32-column steps over I = 96
# (int4 group 32)
MOE_CFG = MoeConfig(16, Tile(block_n=16, block_k=32, split_k=2, fma_rows=2), Tile(block_n=32, block_k=32, fma_rows=1))


@pytest.mark.parametrize("rows", (1, 3))  # 3 rows: experts with 2 or 3 pairs loop over their pairs
@pytest.mark.parametrize("symmetric,dtype", [(False, torch.float32), (True, torch.bfloat16)])
def test_int4_moe_fma(rows, symmetric, dtype):
    scale_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
    w13, w2 = _int4_experts(4, 64, 96, 32, symmetric, scale_dtype)
    x, wts, ids = _moe_case(rows, 4, 64, 96, 3, dtype)
    want = int4_fused_moe_ref(x, *w13, *w2, 32, wts, ids, "gelu_pytorch_tanh")
    with backend("triton"), moe_forced_config(MOE_CFG):
        got = int4_fused_moe(x, *w13, *w2, 32, wts, ids, "gelu_pytorch_tanh")
    _check(got, want, dtype, MOE_NMSE)


@pytest.mark.parametrize("rows", (1, 3))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
def test_nvfp4_moe_fma(rows, dtype):
    w = _nvfp4_experts(4, 64, 96)
    x, wts, ids = _moe_case(rows, 4, 64, 96, 3, dtype, seed=5)
    want = nvfp4_fused_moe_ref(x, *w, wts, ids, "silu")
    with backend("triton"), moe_forced_config(MOE_CFG):
        got = nvfp4_fused_moe(x, *w, wts, ids, "silu")
    _check(got, want, dtype, MOE_NMSE)


def test_fma_rows_out_of_range():
    """An FMA tile of more rows than one program holds accumulators for is refused, naming the limit."""
    packed, scale, zero = _int4(40, 200, 64, True, torch.float32)
    x = _x(3, 200, torch.float32, 0)
    with backend("triton"), forced_config(Int4Config(block_m=8, block_n=16, block_k=64, fma=True)):
        with pytest.raises(ValueError, match=r"block_m in \(1, 2, 4\)"):
            int4_linear(x, packed, scale, zero, 64)
    w13, w2 = _int4_experts(4, 64, 96, 32, True, torch.float32)
    x, wts, ids = _moe_case(3, 4, 64, 96, 3, torch.float32)
    tile = Tile(block_n=16, block_k=32, fma_rows=3)
    with backend("triton"), moe_forced_config(MoeConfig(16, tile, tile)):
        with pytest.raises(ValueError, match="fma_rows"):
            int4_fused_moe(x, *w13, *w2, 32, wts, ids)


def test_fma_steps_cut_to_the_int4_group():
    """A tuned FMA tile meets checkpoints of any group: int4 steps wider than the group are cut to one group (dense
    block_k 128 on group 32; experts block_k 128 on group 32), equal to the twins."""
    packed, scale, zero = _int4(40, 200, 32, False, torch.float32)
    x = _x(2, 200, torch.float32, 3)
    with backend("triton"), forced_config(Int4Config(block_m=2, block_n=16, block_k=128, fma=True)):
        got = int4_linear(x, packed, scale, zero, 32)
    _check(got, int4_linear_ref(x, packed, scale, zero, 32), torch.float32, DENSE_NMSE)
    w13, w2 = _int4_experts(4, 64, 96, 32, False, torch.float32)
    xm, wts, ids = _moe_case(2, 4, 64, 96, 3, torch.float32)
    tile = Tile(block_n=16, block_k=128, fma_rows=1)
    with backend("triton"), moe_forced_config(MoeConfig(16, tile, tile)):
        got = int4_fused_moe(xm, *w13, *w2, 32, wts, ids)
    _check(got, int4_fused_moe_ref(xm, *w13, *w2, 32, wts, ids), torch.float32, MOE_NMSE)


GPU_FMA_ROWS = (1, 2, 3, 4, 8)


def _shipped_dense(fmt: str) -> list:
    """(file, its Int4Config entries) of each shipped dense tile file of ``fmt`` (configs/w4_linear_<fmt>_<device>.json,
    every device's), read by ``int4.tuned_configs`` as the launchers read them."""
    from sparrow.kernels.gemm import int4

    out = []
    for f in sorted(int4.CONFIG_DIR.glob(f"w4_linear_{fmt}_*.json")):
        int4.tuned_configs.cache_clear()
        out.append((f, [cfg for _, cfg in int4.tuned_configs(fmt, f.stem.removeprefix(f"w4_linear_{fmt}_")
                                                                 .replace("_", " "))]))
    int4.tuned_configs.cache_clear()
    return out


def _shipped_dense_fma(fmt: str) -> list:
    """The FMA tiles of ``_shipped_dense``: the GPU test runs each tuned tile, not only the sweep's fastest."""
    return [cfg for _, cfgs in _shipped_dense(fmt) for cfg in cfgs if cfg.fma]


def _shipped_moe_fma(fmt: str) -> list:
    """The FMA entries of the shipped gemma4 MoE tile files of ``fmt`` (configs/E128_H2816_I704_<fmt>_*.json)."""
    from sparrow.kernels.moe.moe_configs import CONFIG_DIR

    return [cfg for f in sorted(CONFIG_DIR.glob(f"E128_H2816_I704_{fmt}_*.json"))
            for cfg in (MoeConfig.from_json(c) for c in json.loads(f.read_text())["configs"].values())
            if cfg.gate_up.fma_rows or cfg.down.fma_rows]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", GPU_FMA_ROWS)
@pytest.mark.parametrize("fmt", ("int4", "nvfp4"))
def test_w4_fma_gpu(rows, fmt):
    """gemma4-26b-a4b's shapes: the dense 2816 -> 4096 linear and one MoE layer (E 128, top-8, H 2816, I 704),
    bf16, each FMA tile of the sweep (1 / 2 / 4 rows at a time) against the fp32 twins."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = _x(rows, 2816, torch.bfloat16, rows, "cuda")
    if fmt == "int4":
        packed, scale, zero = _int4(4096, 2816, 128, True, torch.bfloat16, device="cuda")
        dense = lambda: int4_linear(x, packed, scale, zero, 128)  # noqa: E731
        dense_ref = int4_linear_ref(x.float(), packed, scale.float(), zero, 128)
    else:
        codes, scale, g = _nvfp4(4096, 2816, device="cuda")
        dense = lambda: nvfp4_linear_triton(x, codes, scale, g)  # noqa: E731
        dense_ref = nvfp4_linear_w4a16_ref(x.float(), codes, scale, g)
    for cfg in [Int4Config(block_m=bm, block_n=64, block_k=128, split_k=0, fma=True) for bm in (1, 2, 4)] + \
            _shipped_dense_fma(fmt):
        with forced_config(cfg):
            assert nmse(dense(), dense_ref) <= DENSE_NMSE, cfg
    xm, wts, ids = _moe_case(rows, 128, 2816, 704, 8, torch.bfloat16)
    if fmt == "int4":
        w13, w2 = _int4_experts(128, 2816, 704, 128, True, torch.bfloat16, "cuda")
        moe = lambda: int4_fused_moe(xm, *w13, *w2, 128, wts, ids, "gelu_pytorch_tanh")  # noqa: E731
        with backend("torch"):
            moe_ref = int4_fused_moe_ref(xm.float(), *w13, *w2, 128, wts, ids, "gelu_pytorch_tanh")
    else:
        w = _nvfp4_experts(128, 2816, 704, "cuda")
        moe = lambda: nvfp4_fused_moe(xm, *w, wts, ids, "gelu_pytorch_tanh")  # noqa: E731
        with backend("torch"):
            moe_ref = nvfp4_fused_moe_ref(xm.float(), *w, wts, ids, "gelu_pytorch_tanh")
    for cfg in [MoeConfig(16, tile, tile) for tile in (Tile(block_n=64, block_k=128, split_k=0, fma_rows=fr)
                                                        for fr in (1, 2, 4))] + _shipped_moe_fma(fmt):
        with moe_forced_config(cfg):
            assert nmse(moe(), moe_ref) <= MOE_NMSE, cfg


def test_tuned_dense_file(monkeypatch, tmp_path):
    """``int4.pick_config`` reads the device's tuned file of the format (written by kernels_micro.py tune_w4_fma):
    each entry covers the rows up to its bound, rows past the last bound take INT4_CONFIGS, and another format or
    device keeps the table."""
    import dataclasses

    from sparrow.kernels.gemm import int4

    one = Int4Config(1, 64, 128, split_k=4, fma=True)
    four = Int4Config(4, 128, 256, num_warps=8, split_k=2, fma=True)
    monkeypatch.setattr(int4, "CONFIG_DIR", tmp_path)
    int4.tuned_configs.cache_clear()
    int4.config_file("int4", "Fake GPU").write_text(json.dumps(
        {"configs": {"4": dataclasses.asdict(four), "1": dataclasses.asdict(one)}}))
    try:
        assert int4.config_file("int4", "Fake GPU").name == "w4_linear_int4_Fake_GPU.json"
        assert int4.pick_config(1, "int4", "Fake GPU") == one
        assert int4.pick_config(3, "int4", "Fake GPU") == int4.pick_config(4, "int4", "Fake GPU") == four
        assert int4.pick_config(5, "int4", "Fake GPU") == int4.INT4_CONFIGS[0][1]
        assert int4.pick_config(1, "nvfp4", "Fake GPU") == int4.pick_config(1, "int4", "Other GPU") \
            == int4.pick_config(1) == int4.INT4_CONFIGS[0][1]
        with forced_config(four):
            assert int4.pick_config(1, "int4", "Fake GPU") == four
    finally:
        int4.tuned_configs.cache_clear()


def test_shipped_dense_files_parse():
    """Each shipped dense 4-bit tile file (configs/w4_linear_<format>_<device>.json) reads as Int4Config entries
    that the launchers accept: FMA tiles of 1 / 2 / 4 rows, dot tiles of at least 16."""
    from sparrow.kernels.gemm import int4

    shipped = _shipped_dense("int4") + _shipped_dense("nvfp4")
    assert shipped, "no dense 4-bit tile files shipped"
    for f, cfgs in shipped:
        assert cfgs, f
        for cfg in cfgs:
            assert cfg.block_m in int4.FMA_ROWS if cfg.fma else cfg.block_m >= 16
