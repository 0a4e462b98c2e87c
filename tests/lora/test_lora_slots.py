"""The adapter slots (sparrow/lora/manager.py): adapters copied into max_loras slots on demand, the least recently
used one not in the step evicted, a slot's buffers holding exactly the adapter's factors (zeros past its rank and
for the modules it does not target), and one folder under two ids read once. Tiny random Llama, PEFT adapters."""
from __future__ import annotations

import pytest
import torch

from sparrow import LoRARequest
from tests.helpers import make_llm
from tests.lora._adapters import base_model, make_adapter


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-slots")
    base = base_model("llama", root / "base")
    a = make_adapter("llama", base, root / "a", 1, r=4, target_modules=["q_proj", "v_proj", "down_proj"])
    b = make_adapter("llama", base, root / "b", 2, r=2, target_modules=["o_proj"])
    llm = make_llm(base, max_model_len=64, enable_lora=True, max_loras=2, max_lora_rank=4, max_cpu_loras=3)
    return llm.engine.runner.lora, a, b


def test_lru_slots_and_their_contents(setup):
    mgr, a, b = setup
    reqs = {1: LoRARequest("a", 1, str(a)), 2: LoRARequest("b", 2, str(b)), 3: LoRARequest("a-again", 3, str(a))}
    for r in reqs.values():
        mgr.load(r)
    assert mgr.adapters[3].targets is mgr.adapters[1].targets  # same folder: read once
    s12, errors = mgr.assign({1: reqs[1], 2: reqs[2]})
    assert sorted(s12.values()) == [0, 1] and not errors
    assert mgr.assign({2: reqs[2]}) == ({2: s12[2]}, {})  # 2 used last: 1 is the least recently used
    assert mgr.assign({3: reqs[3]}) == ({3: s12[1]}, {})  # evicts 1, keeps 2
    assert set(mgr.slots) == {2, 3}
    with pytest.raises(ValueError, match="more than max_loras=2"):
        mgr.assign(reqs)
    # slot contents: adapter 2 (o_proj only, rank 2) in its slot, zeros elsewhere
    slot = s12[2]
    qkv = mgr.buffers["model.layers.0.self_attn.qkv_proj", "weight"]
    o = mgr.buffers["model.layers.0.self_attn.o_proj", "weight"]
    a_o, b_o = mgr.adapters[2].targets["model.layers.0.self_attn.o_proj", "weight"]
    assert int(o.ranks[slot]) == 2 and int(qkv.ranks[slot]) == 0
    assert torch.equal(o.a[slot, :2], a_o) and torch.all(o.a[slot, 2:] == 0)
    assert torch.equal(o.b[slot, :2], b_o.t()) and torch.all(o.b[slot, 2:] == 0)  # B stored rank-major
    assert torch.all(qkv.a[slot] == 0) and torch.all(qkv.b[slot] == 0)
    # adapter 3 (= a: q and v of rank 4 side by side in the packed qkv_proj, B block-diagonal)
    slot = mgr.slots[3]
    q_rows, k_rows = 64, 32
    assert int(qkv.ranks[slot]) == 8
    assert torch.all(qkv.b[slot, 4:, :q_rows] == 0) and torch.all(qkv.b[slot, :, q_rows:q_rows + k_rows] == 0)
    assert torch.all(qkv.b[slot, :4, q_rows + k_rows:] == 0)
    assert qkv.seg_cols[slot].tolist() == [[0, 4], [0, 0], [4, 4]]  # q: rank rows 0-3, k: none, v: 4-7


def test_one_folder_spelled_two_ways_is_one_adapter(setup, monkeypatch):
    """An id names one folder however its path is spelled (a trailing slash, relative to the working directory, a
    symbolic link): the same id may come back with another spelling, and a second id shares the host copy. Another
    folder under a known id is still refused."""
    from sparrow.errors import LoRAAdapterError

    mgr, a, b = setup
    first = mgr.load(LoRARequest("a", 11, str(a)))
    monkeypatch.chdir(a.parent)
    link = a.parent / "a-link"
    link.symlink_to(a, target_is_directory=True)
    for spelling in (str(a) + "/", a.name, f"./{a.name}", str(link)):
        assert mgr.load(LoRARequest("a", 11, spelling)) is first, spelling
    assert mgr.load(LoRARequest("a", 12, a.name)).targets is first.targets
    with pytest.raises(LoRAAdapterError, match="lora_int_id 11 is already the adapter at"):
        mgr.load(LoRARequest("b", 11, str(b)))

def test_no_slots_for_a_quantized_lm_head(tmp_path):
    """With quantize_lm_head the LM head is a Linear (``lm_head_quantized``), which no adapter can target: it holds no
    adapter slots (at Gemma 4's vocabulary, 4 slots of rank 64 would be 136 MB of bf16 for nothing), while the
    decoder's linears hold theirs."""
    base = base_model("llama", tmp_path / "base")
    llm = make_llm(base, max_model_len=64, enable_lora=True, max_loras=2, max_lora_rank=4, quantization="fp8",
                   quantize_lm_head=True)
    mgr, model = llm.engine.runner.lora, llm.engine.runner.model
    assert model.lm_head_quantized.lora is None
    assert all(path.startswith("model.layers.") for path, _ in mgr.buffers)
    assert ("model.layers.0.self_attn.qkv_proj", "weight") in mgr.buffers


def test_host_copies_in_the_buffer_dtype_fill_slots_as_fp32_factors_did(tmp_path):
    """bf16 Qwen2-MoE (attention, dense and shared-expert MLPs, fused experts, router): the host copies are bf16, and a
    slot written from them holds bit for bit what a copy of the fp32 factors (scaling folded in) into the bf16
    buffers gives: A, B, ranks and segment columns of every module."""
    from sparrow.lora.adapter import load_adapter
    from sparrow.layers.lora_buffers import LoRABuffers
    from tests.lora._adapters import DENSE_TARGETS, EXPERT_PARAMS, ROUTER_PARAMS

    base = base_model("qwen2_moe", tmp_path / "base")
    path = make_adapter("qwen2_moe", base, tmp_path / "a", 3, r=4, lora_alpha=8, target_modules=DENSE_TARGETS,
                        target_parameters=EXPERT_PARAMS + ROUTER_PARAMS)
    # PEFT >= 0.22 stacks target_modules gate_proj / up_proj on the fused experts as gate_up_proj of rank 2r
    llm = make_llm(base, dtype="bfloat16", max_model_len=64, enable_lora=True, max_loras=2, max_lora_rank=8)
    mgr = llm.engine.runner.lora
    req = LoRARequest("a", 1, str(path))
    adapter = mgr.load(req)
    assert {t.dtype for ab in adapter.targets.values() for t in ab} == {torch.bfloat16}
    slot = mgr.assign({1: req})[0][1]
    fp32 = load_adapter(req, mgr.model, mgr.max_lora_rank)  # the factors as they were kept before (fp32)
    assert {t.dtype for ab in fp32.targets.values() for t in ab} == {torch.float32}
    for key, buf in mgr.buffers.items():
        ref = LoRABuffers(1, buf.experts, buf.width, buf.a.shape[2], buf.b.shape[2], torch.bfloat16, buf.a.device,
                          buf.out_sizes)
        ref.write(0, fp32.targets.get(key))
        e = buf.experts
        assert torch.equal(buf.a[slot * e:(slot + 1) * e], ref.a), key
        assert torch.equal(buf.b[slot * e:(slot + 1) * e], ref.b), key
        assert torch.equal(buf.ranks[slot], ref.ranks[0]) and torch.equal(buf.seg_cols[slot], ref.seg_cols[0]), key
    assert any(key[1] == "gate_up_proj" for key in fp32.targets) and len(fp32.targets) > 10
