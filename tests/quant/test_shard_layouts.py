"""A tensor-parallel share cut from a checkpoint tensor (``weight_loaders.narrow_shard`` by the format's
``set_shard_layout``) converts to the same share of the kernel layout as the whole tensor does: every int4 layout
(compressed-tensors, GPTQ with g_idx, AWQ), both splits (output rows N, input columns K), two ranks each; and a
share off the blocks is refused by name. One process: no ranks are needed to cut a share."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from sparrow.errors import ModelLoadError
from sparrow.kernels.gemm.int4 import pack_int4_ref
from sparrow.quant.int4_layouts import convert, shard_layout
from sparrow.quant.weight_loaders import narrow_shard, set_shard_layout
from tests.quant.test_int4 import _awq_tensors, _gptq_tensors

N, K, GROUP, WORLD = 32, 256, 32, 2


def _tensors(layout: str) -> dict:
    """kind -> checkpoint tensor of ``layout`` for random codes u [N, K], zeros z [N, G], scales s [N, G]."""
    gen = torch.Generator().manual_seed(0)
    u = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.uint8)
    z = torch.randint(0, 16, (N, K // GROUP), generator=gen, dtype=torch.uint8)
    s = torch.rand(N, K // GROUP, generator=gen) + 0.5
    if layout == "gptq":
        return dict(zip(("packed", "zero", "scale", "g_idx"), _gptq_tensors(u, z, s, GROUP, v1=False)))
    if layout == "awq":
        return dict(zip(("packed", "zero", "scale"), _awq_tensors(u, z, s)))
    zp = pack_int4_ref(z.t().contiguous()).t().contiguous()  # [N / 8, G], packed along N
    return {"packed": pack_int4_ref(u), "scale": s, "zero": zp, "shape": torch.tensor([N, K])}


@pytest.mark.parametrize("layout", ["compressed-tensors", "gptq", "awq"])
def test_int4_shares_convert_to_the_kernel_layouts_share(layout):
    for kind, t in _tensors(layout).items():
        param = nn.Parameter(torch.empty(0), requires_grad=False)
        set_shard_layout(param, **shard_layout(layout, kind, GROUP))
        whole = convert(layout, kind, t, N, K, GROUP, kind, gptq_v1=False)
        for rank in range(WORLD):
            rows, cols = N // WORLD, K // WORLD
            got_n = convert(layout, kind, narrow_shard(param, t, "n", rank * rows, rows, kind), rows, K, GROUP, kind,
                            gptq_v1=False)
            got_k = convert(layout, kind, narrow_shard(param, t, "k", rank * cols, cols, kind), N, cols, GROUP, kind,
                            gptq_v1=False)
            if kind in ("shape", "g_idx"):  # checked only: convert accepted the share's values
                continue
            g = cols // GROUP if kind in ("scale", "zero") else cols // 8
            assert torch.equal(got_n, whole[rank * rows:(rank + 1) * rows]), (kind, "n", rank)
            assert torch.equal(got_k, whole[:, rank * g:(rank + 1) * g]), (kind, "k", rank)


def test_share_off_the_blocks_names_the_tensor():
    param = nn.Parameter(torch.empty(0), requires_grad=False)
    set_shard_layout(param, n=(0, 128), k=(1, 128))  # FP8 block scales
    with pytest.raises(ModelLoadError, match=r"'x.weight_scale_inv'.*output rows \(elements 96:192\).*128-element"):
        narrow_shard(param, torch.ones(2, 2), "n", 96, 96, "x.weight_scale_inv")
