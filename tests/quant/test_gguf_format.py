"""The GGUF format (sparrow.quant.gguf) on the packaged SmolLM2 Q4_1 file and the default Gemma 3 270M Q4_K_M
file: the blocks stay packed (bytes in memory equal to the file's bytes for those tensors, the token embedding's
included, so a loaded model's resident weight bytes are within 1.1x of the file's tensor bytes), a packed projection
whose shards have different types runs one segment per type, ``quantization=`` re-quantizes from the dequantized
weights, and bad GGUF expert slices are refused by name. Token-exactness against transformers is
tests/models/test_packaged_models.py's and tests/loader/test_gguf_moe_files.py's."""
from __future__ import annotations

import pytest
import torch

from sparrow.errors import ModelLoadError
from sparrow.loader.gguf import GGUFCheckpoint
from sparrow.loader.model_loader import load_model
from sparrow.quant.gguf import GGUFLinearMethod, GGUFMoEMethod, weight_bytes
from tests.helpers import smollm2_gguf


def _quantized_bytes(path) -> int:
    """Bytes of the file's quantized tensors (the Linear weights blk.* and the token embedding; not norms)."""
    ckpt = GGUFCheckpoint(path)
    return sum(t.n_bytes for t in ckpt.tensor_infos if t.tensor_type not in (0, 1, 30))  # F32, F16, BF16


def _resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer of ``model`` (what the weights hold in memory)."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def test_smollm2_blocks_stay_packed():
    path = smollm2_gguf()
    loaded = load_model(path)
    assert loaded.quant_config.name == "gguf"
    packed, _ = weight_bytes(loaded.model)
    assert packed == _quantized_bytes(path)  # exactly the file's blocks, no float copy
    for m in loaded.model.modules():
        if getattr(m, "quant_kind", None) == "linear":
            assert isinstance(m.quant_method, GGUFLinearMethod)
            assert [t for t, _, _ in m.gguf_segments] and all(
                getattr(m, b).dtype == torch.uint8 for _, _, b in m.gguf_segments)


def _packaged(name: str):
    from sparrow.default_model import default_model_path

    return smollm2_gguf() if name == "smollm2" else default_model_path()


@pytest.mark.parametrize("name", ["smollm2", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_resident_weight_bytes_are_the_file_tensor_bytes(name):
    """Issue 43: a packaged model's weights in memory (fp32 model dtype: the float copies cost most there) are at
    most 1.1x the file's tensor bytes, and the load log's packed + other bytes are those resident bytes."""
    path = _packaged(name)
    ckpt = GGUFCheckpoint(path)
    model = load_model(path, dtype=torch.float32).model
    resident, file_bytes = _resident_bytes(model), ckpt.tensor_bytes
    assert resident <= 1.1 * file_bytes, f"{name}: {resident / 1e6:.1f} MB resident vs {file_bytes / 1e6:.1f} MB"
    assert sum(weight_bytes(model)) == resident


@pytest.mark.slow
def test_gemma3_mixed_type_shards_run_one_segment_each():
    from sparrow.default_model import default_model_path
    from sparrow.kernels.common.gguf_blocks import dequantize

    path = default_model_path()
    loaded = load_model(path)
    qkv = loaded.model.model.layers[0].self_attn.qkv_proj
    ckpt = GGUFCheckpoint(path)
    types = {t.name: t.tensor_type for t in ckpt.tensor_infos}
    want = [types[f"blk.0.attn_{s}.weight"] for s in "qkv"]
    assert len(set(want)) > 1  # the file mixes Q5_0 (q, k) and Q8_0 (v): the case under test
    assert [t for t, _, _ in qkv.gguf_segments] == [want[0], want[2]]
    # the layer's output equals x @ W.T of the dequantized q|k|v tensors (the twin's float path)
    info = {t.name: t for t in ckpt.tensor_infos}
    ws = []
    for s in "qkv":
        t = info[f"blk.0.attn_{s}.weight"]
        ws.append(dequantize(ckpt._raw(t), t.tensor_type, tuple(reversed(t.shape))))
    x = torch.randn(3, qkv.in_features, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(qkv(x), x @ torch.cat(ws).T, rtol=1e-4, atol=1e-4)


def test_quantization_requantizes_from_dequantized_weights():
    loaded = load_model(smollm2_gguf(), quantization="int4")
    assert loaded.quant_config.name == "int4"
    assert not any(isinstance(getattr(m, "quant_method", None), GGUFLinearMethod) for m in loaded.model.modules())


def test_expert_slices_of_two_types_are_refused():
    layer = torch.nn.Module()
    layer.hidden_size, layer.intermediate_size, layer.num_experts, layer.prefix = 256, 256, 2, "model.layers.0.mlp"
    method = GGUFMoEMethod()
    method.create_weights(layer, torch.float32)
    gate = torch.zeros(256, 256 // 256 * 144, dtype=torch.uint8)
    gate.ggml_type = 12  # Q4_K
    up = torch.zeros(256, 256 // 256 * 210, dtype=torch.uint8)
    up.ggml_type = 14  # Q6_K
    param = layer.gate_up_proj
    param.weight_loader(param, gate, (0, 0), "experts.0.gate_proj.weight")
    with pytest.raises(ModelLoadError, match="Q6_K.*Q4_K"):
        param.weight_loader(param, up, (0, 1), "experts.0.up_proj.weight")
    float_slice = torch.zeros(256, 256)
    with pytest.raises(ModelLoadError, match="float"):
        param.weight_loader(param, float_slice, (1, 0), "experts.1.gate_proj.weight")
