"""The GGUF vocab table (``sparrow.quant.gguf.GGUFEmbeddingMethod``) against the float table the loader made before:
a float ``VocabEmbedding`` holding ``gguf_blocks.dequantize`` of the same blocks in the model dtype.

Rows: bit-exact (torch.equal) for every block type, fp32 and bf16, with Gemma's scale, duplicate and negative ids,
R = 1, 2, 3, 17, 33 and soft tokens; out-of-range ids fail as the float table's index does. Logits: equal to the
GGUF twin on the same bytes and within fp32 summation error (rtol 2e-5, atol 1e-5) of x @ W.T. Packaged
SmolLM2 (Q8_0 table, tied): greedy ids equal and logprobs within 1e-4 of the float-table model, and the same
bytes hold the embedding and the LM head. GPU: rows bit-exact with the CPU, and lookup + logits replay from a CUDA
graph. Shapes: V = 40 rows of H = 256 (one K-quant super-block, eight 32-element blocks).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from sparrow.errors import ModelLoadError
from sparrow.kernels.common.gguf_blocks import dequantize
from sparrow.kernels.gemm.gguf import gguf_linear_ref
from sparrow.layers.embedding import VocabEmbedding
from sparrow.quant.base import UnquantizedEmbeddingMethod
from sparrow.quant.gguf import GGUFConfig, GGUFEmbeddingMethod
from sparrow.quant.scope import quant_config_scope
from tests.kernels.common.test_gguf_blocks import random_blocks

BLOCK_TYPES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
V, H = 40, 256
ROWS = (1, 2, 3, 17, 33)


def _blocks(qtype: T, seed: int = 0) -> torch.Tensor:
    """Packed rows uint8 [V, H // B * T] as the loader yields them (``ggml_type`` set)."""
    t = torch.from_numpy(random_blocks(qtype, (V, H), np.random.default_rng(seed), fp16_max=0.05)).view(V, -1)
    t.ggml_type = int(qtype)
    return t


def _tables(loaded: torch.Tensor, dtype: torch.dtype, scale: float | None = None, device: str = "cpu"):
    """(GGUF table, float table) of ``loaded`` (packed rows, or a float tensor as a float file type arrives)."""
    with torch.device(device), quant_config_scope(GGUFConfig()):
        packed = VocabEmbedding(V, H, scale, dtype)
    assert isinstance(packed.quant_method, GGUFEmbeddingMethod)
    packed.weight.weight_loader(packed.weight, loaded, None, "token_embd.weight")
    packed.quant_method.process_weights_after_loading(packed)
    with torch.device(device):
        flt = VocabEmbedding(V, H, scale, dtype)  # outside any scope: the float table
    assert isinstance(flt.quant_method, UnquantizedEmbeddingMethod)
    ggml_type = getattr(loaded, "ggml_type", None)
    w = loaded if ggml_type is None else dequantize(loaded, ggml_type, (V, H))
    flt.weight.data.copy_(w)  # the float path: dequantized fp32, copied into the model-dtype table
    return packed, flt


def _ids(rows: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(-1, V, (rows,), generator=g)  # -1: a padding row (reads row 0)
    ids[0] = V - 1
    if rows > 1:
        ids[1] = ids[0]  # a duplicate
    return ids.to(device)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_rows_bit_exact_with_the_float_table(qtype, dtype):
    packed, flt = _tables(_blocks(qtype), dtype, scale=H ** 0.5)
    assert packed.gguf_weight_0.dtype == torch.uint8 and packed.gguf_segments[0][0] == qtype
    for rows in ROWS:
        ids = _ids(rows)
        got = packed(ids)
        assert got.dtype == dtype and got.shape == (rows, H)
        assert torch.equal(got, flt(ids)), (qtype.name, rows)
        want = dequantize(packed.gguf_weight_0, qtype, (V, H))[ids.clamp(min=0)].to(dtype) * torch.tensor(
            H ** 0.5, dtype=dtype)
        assert torch.equal(got, want)


@pytest.mark.parametrize("qtype", (T.Q8_0, T.Q4_K, T.Q6_K), ids=lambda t: t.name)
def test_logits_run_the_gguf_kernel_on_the_same_bytes(qtype):
    packed, flt = _tables(_blocks(qtype, seed=1), torch.float32)
    for rows in ROWS:
        x = torch.randn(rows, H, generator=torch.Generator().manual_seed(rows))
        got = packed.logits(x)
        assert got.shape == (rows, V) and got.dtype == torch.float32
        assert torch.equal(got, gguf_linear_ref(x, packed.gguf_weight_0, qtype))
        torch.testing.assert_close(got, flt.logits(x), rtol=2e-5, atol=1e-5)  # fp32 sums of 256 terms


def test_float_file_type_stays_a_float_table():
    w = torch.randn(V, H).half().float()  # an F16 tensor arrives dequantized to fp32, without ggml_type
    packed, flt = _tables(w, torch.bfloat16)
    assert packed.gguf_segments[0][0] is None and packed.gguf_weight_0.dtype == torch.bfloat16
    ids = _ids(17)
    assert torch.equal(packed(ids), flt(ids))
    x = torch.randn(3, H, dtype=torch.bfloat16)
    assert torch.equal(packed.logits(x), flt.logits(x))


def test_soft_tokens_replace_rows_as_in_the_float_path():
    packed, flt = _tables(_blocks(T.Q8_0), torch.float32, scale=2.0)
    ids, mask = _ids(5), torch.tensor([False, True, False, True, False])
    soft = torch.randn(2, H)
    got = packed(ids, soft, mask)
    assert torch.equal(got, flt(ids, soft, mask)) and torch.equal(got[mask], soft)


def test_out_of_range_ids_fail_as_the_float_table():
    packed, flt = _tables(_blocks(T.Q4_K), torch.float32)
    for bad in (V, V + 7):
        ids = torch.tensor([0, bad])
        with pytest.raises(IndexError, match=f"index {bad} is out of bounds"):
            flt(ids)
        with pytest.raises(IndexError, match=f"index {bad} is out of bounds"):
            packed(ids)


def test_misshaped_tensor_is_named():
    with quant_config_scope(GGUFConfig()):
        layer = VocabEmbedding(V + 1, H)
    with pytest.raises(ModelLoadError, match=r"'token_embd.weight' has shape \(40, 256\), expected \(41, 256\)"):
        layer.weight.weight_loader(layer.weight, _blocks(T.Q8_0), None, "token_embd.weight")


def test_smollm2_tied_head_matches_the_float_table(monkeypatch):
    """Packaged SmolLM2 (token_embd Q8_0, tied): the embedding and the LM head read one buffer, and greedy ids and
    logprobs equal the model whose table the loader dequantized (the float path)."""
    from sparrow import SamplingParams
    from sparrow.loader.gguf import GGUFCheckpoint
    from tests.helpers import make_llm, smollm2_gguf

    path = smollm2_gguf()
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 9690, 2533, 253, 655, 28], [1, 12]]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
    packed = make_llm(path, max_model_len=64)
    model = packed.engine.runner.model
    embd = next(t for t in GGUFCheckpoint(path).tensor_infos if t.name == "token_embd.weight")
    assert model.config.tie_word_embeddings and model.lm_table is model.model.embed_tokens
    assert model.model.embed_tokens.gguf_weight_0.numel() == embd.n_bytes  # the file's bytes, one copy
    got = [o.outputs[0] for o in packed.generate([{"prompt_token_ids": p} for p in prompts], params)]
    del packed, model
    monkeypatch.setattr(GGUFConfig, "get_embedding_method", lambda self, prefix: UnquantizedEmbeddingMethod())
    flt = make_llm(path, max_model_len=64)
    assert flt.engine.runner.model.model.embed_tokens.weight.dtype == torch.float32
    want = [o.outputs[0] for o in flt.generate([{"prompt_token_ids": p} for p in prompts], params)]
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        for lg, lw in zip(g.logprobs, w.logprobs):
            assert lg.keys() == lw.keys()
            for tok in lw:
                assert abs(lg[tok].logprob - lw[tok].logprob) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_cuda_rows_match_cpu_and_replay_from_a_graph(qtype, dtype):
    """Rows on CUDA equal the CPU's bit for bit; lookup + logits captured in a CUDA graph (no host sync inside)
    replay with new ids to the eager result."""
    cpu, _ = _tables(_blocks(qtype), dtype, scale=H ** 0.5)
    cuda, _ = _tables(_blocks(qtype), dtype, scale=H ** 0.5, device="cuda")
    ids = _ids(17, "cuda")
    assert torch.equal(cuda(ids).cpu(), cpu(ids.cpu()))
    static = ids.clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up (Triton compiles) outside the capture
            cuda.logits(cuda(static))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rows = cuda(static)
        logits = cuda.logits(rows)
    static.copy_((static.clamp(min=0) + 5) % V)  # other ids, same buffer
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(rows, cuda(static))
    assert torch.equal(logits, cuda.logits(cuda(static)))
