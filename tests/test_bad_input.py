"""Bad input through the library: each raises a sparrow.errors.SparrowError subclass whose message is one
line naming the problem, and a rejected request leaves the LLM able to serve the next one.
(The same cases through the command line are in tests/test_cli.py.)"""
from __future__ import annotations

import pytest
import torch

from sparrow import SamplingParams
from sparrow.errors import (
    InvalidRequestError,
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
)
from sparrow.loader.model_loader import load_model
from sparrow.models.registry import supported_architectures
from tests.helpers import (  # noqa: F401  (fixtures)
    assert_one_line,
    copy_checkpoint,
    edited_checkpoint,
    gguf_bert,
    gguf_truncated_data,
    gguf_truncated_header,
    ids_prompt,
    make_llm,
    missing_tensor_dir,
    random_prompts,
    raises,
    tiny_model_dir,
    unknown_arch_dir,
)


# ---------------------------------------------------------------- model files


def test_missing_model_path(tmp_path):
    path = tmp_path / "no-such-model"
    raises(ModelNotFoundError, lambda: make_llm(path), str(path), "does not exist")


def test_folder_without_checkpoint(tmp_path):
    raises(ModelNotFoundError, lambda: make_llm(tmp_path), "config.json")


def test_gguf_with_truncated_metadata(gguf_truncated_header):
    raises(ModelLoadError, lambda: load_model(gguf_truncated_header), str(gguf_truncated_header))


def test_gguf_with_truncated_tensor_data(gguf_truncated_data):
    raises(ModelLoadError, lambda: load_model(gguf_truncated_data), str(gguf_truncated_data))


def test_gguf_of_unsupported_architecture(gguf_bert):
    msg = raises(UnsupportedArchitectureError, lambda: make_llm(gguf_bert), "'bert'", "supported:")
    assert "llama" in msg


def test_hf_folder_of_unknown_architecture(unknown_arch_dir):
    msg = raises(UnsupportedArchitectureError, lambda: make_llm(unknown_arch_dir), "FooBarForCausalLM")
    for arch in supported_architectures():
        assert arch in msg


@pytest.mark.parametrize("change, needles", [
    (dict(hidden_act="bogus"), ["hidden_act='bogus'", "silu"]),
    (dict(max_position_embeddings=0), ["max_position_embeddings=0"]),
    (dict(max_position_embeddings=2048.5), ["max_position_embeddings=2048.5"]),  # 2048.0 loads as 2048
])
def test_hf_config_with_bad_values(tiny_model_dir, tmp_path, change, needles):
    """Refused at load with the field named (0 positions were read as 4096 before)."""
    path = copy_checkpoint(tiny_model_dir, tmp_path / "bad-config", **change)
    raises(ModelLoadError, lambda: make_llm(path), *needles)


@pytest.mark.parametrize("change, needles", [
    (dict(num_experts_per_tok=8), ["num_experts_per_tok=8", "num_experts=4"]),
    (dict(hidden_act="bogus"), ["hidden_act='bogus'"]),  # a MoE model failed only at its first forward pass
])
def test_moe_config_with_bad_values(change, needles):
    from transformers import Qwen3MoeConfig

    from sparrow.config import ModelConfig

    kw = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
              vocab_size=256)
    cfg = Qwen3MoeConfig(**{**kw, **change}).to_dict()
    cfg["architectures"] = ["Qwen3MoeForCausalLM"]
    raises(ModelLoadError, lambda: ModelConfig.from_hf(cfg), *needles)


@pytest.mark.parametrize("top_k", [0, 17])
def test_gemma4_config_with_top_k_outside_the_experts(top_k):
    from transformers import Gemma4TextConfig

    from sparrow.config import ModelConfig

    from tests.models._hf_tiny import _gemma4_text

    cfg = Gemma4TextConfig(**{**_gemma4_text(), "top_k_experts": top_k}).to_dict()  # 16 experts
    cfg["architectures"] = ["Gemma4ForCausalLM"]
    raises(ModelLoadError, lambda: ModelConfig.from_hf(cfg), f"num_experts_per_tok={top_k}", "num_experts=16")


def test_missing_tensor(missing_tensor_dir):
    raises(ModelLoadError, lambda: make_llm(missing_tensor_dir),
           "'model.layers.1.mlp.down_proj.weight'", "(64, 128)")


def test_missing_shard_of_a_packed_tensor(tiny_model_dir, tmp_path):
    path = edited_checkpoint(tiny_model_dir, tmp_path / "ckpt", lambda t: t.pop("model.layers.0.self_attn.q_proj.weight"))
    raises(ModelLoadError, lambda: load_model(path), "'model.layers.0.self_attn.q_proj.weight'", "(64, 64)")


@pytest.mark.parametrize("name, shape, expected", [
    ("model.layers.1.mlp.down_proj.weight", (64, 127), "(64, 128)"),
    ("model.layers.0.self_attn.k_proj.weight", (31, 64), "(32, 64)"),  # a shard of the packed qkv_proj
    ("model.norm.weight", (65,), "(64,)"),
])
def test_misshaped_tensor(tiny_model_dir, tmp_path, name, shape, expected):
    path = edited_checkpoint(tiny_model_dir, tmp_path / "ckpt", lambda t: t.__setitem__(name, torch.zeros(shape)))
    raises(ModelLoadError, lambda: load_model(path), repr(name), str(shape), expected)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.extra_proj.weight", "model.layers.2.mlp.down_proj.weight"])
def test_extra_unused_tensor(tiny_model_dir, tmp_path, name):
    path = edited_checkpoint(tiny_model_dir, tmp_path / "ckpt", lambda t: t.__setitem__(name, torch.zeros(4, 4)))
    raises(ModelLoadError, lambda: load_model(path), repr(name), "not used")


def test_tokenizer_missing_for_text_model(tiny_model_dir):
    with pytest.raises(ModelLoadError, match="cannot load a tokenizer for .*tiny-llama"):
        make_llm(tiny_model_dir, skip_tokenizer_init=False)


def test_tokenizer_missing_message_is_one_line(tiny_model_dir):
    raises(ModelLoadError, lambda: make_llm(tiny_model_dir, skip_tokenizer_init=False), "tokenizer")


@pytest.mark.parametrize("kw, needle", [
    (dict(device="tpu"), "'tpu'"),
    (dict(dtype="float8"), "'float8'"),
    (dict(block_size=24), "block_size=24"),
    (dict(max_model_len=100_000), "max_model_len=100000"),
    (dict(max_model_len=1), "max_model_len=1"),
    (dict(num_kv_blocks=2), "num_kv_blocks=2"),
    (dict(quantization="int3"), "quantization='int3'"),
    (dict(max_model_len="abc"), "max_model_len='abc'"),
    (dict(dtype="float16"), "float16"),
    (dict(max_num_seqs=0), "max_num_seqs=0"),  # accepted before: generate then never admitted a request
    (dict(max_num_batched_tokens=-4), "max_num_batched_tokens=-4"),
    (dict(num_kv_blocks=0), "num_kv_blocks=0"),
    (dict(kv_cache_memory="8XB"), "kv_cache_memory='8XB'"),
    (dict(kv_cache_memory="1GiB", num_kv_blocks=64), "num_kv_blocks=64 and kv_cache_memory"),
])
def test_bad_llm_arguments(tiny_model_dir, kw, needle):
    raises(InvalidRequestError, lambda: make_llm(tiny_model_dir, **kw), needle)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpu(tiny_model_dir):
    raises(InvalidRequestError, lambda: make_llm(tiny_model_dir, device="cuda"), "CUDA")


# ---------------------------------------------------------------- requests


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return make_llm(tiny_model_dir, max_model_len=64)


GOOD = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize("field, value", [
    ("top_p", 0.0), ("top_p", 1.5), ("temperature", -0.5), ("top_k", -2), ("n", 0), ("min_p", 2.0),
    ("max_tokens", 0), ("min_tokens", -1), ("repetition_penalty", 0.0), ("presence_penalty", 3.0),
    ("frequency_penalty", -2.5), ("logprobs", -1), ("prompt_logprobs", -1), ("stop", [""]),
    ("stop_token_ids", ["a"]), ("seed", 1.5), ("temperature", float("nan")), ("temperature", float("inf")),
    ("repetition_penalty", float("nan")), ("temperature", "0.5"), ("logprobs", 21), ("prompt_logprobs", 10**6),
    ("stop", 5), ("stop_token_ids", 5), ("stop_token_ids", [True]), ("top_k", 2**31), ("top_k", 10**20),
])
def test_invalid_sampling_values(field, value):
    raises(InvalidRequestError, lambda: SamplingParams(**{field: value}), f"SamplingParams.{field}=")


def test_min_tokens_above_max_tokens():
    raises(InvalidRequestError, lambda: SamplingParams(min_tokens=5, max_tokens=2), "min_tokens", "max_tokens")


@pytest.mark.parametrize("prompt, needles", [
    ({"prompt_token_ids": []}, ["empty prompt"]),
    ({"prompt_token_ids": list(range(64))}, ["64 tokens", "max_model_len=64"]),
    ({"prompt_token_ids": [1, 256, 3]}, ["256", "[0, 256)"]),
    ({"prompt_token_ids": [-1]}, ["-1", "vocabulary"]),
    ({"prompt_token_ids": [1, 2.5]}, ["prompt_token_ids"]),
    ({"prompt_token_ids": ["a"]}, ["prompt_token_ids"]),
    ({"prompt_token_ids": None}, ["prompt_token_ids"]),
    ({"tokens": [1, 2]}, ["prompt_token_ids"]),
    ("hello", ["tokenizer"]),  # this LLM has no tokenizer
])
def test_bad_prompts_then_a_good_one(llm, prompt, needles):
    raises(InvalidRequestError, lambda: llm.generate(prompt, GOOD), *needles)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests
    (p,) = random_prompts([10], seed=1)
    out = llm.generate(ids_prompt(p), GOOD)[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


def test_sampling_params_of_the_wrong_type(llm):
    raises(InvalidRequestError, lambda: llm.generate({"prompt_token_ids": [1, 2]}, {"temperature": 0}),
           "SamplingParams")


@pytest.mark.parametrize("prompts", [5, None, b"hello"])
def test_prompts_of_the_wrong_type(llm, prompts):
    raises(InvalidRequestError, lambda: llm.generate(prompts, GOOD), "prompts must be", type(prompts).__name__)


def test_model_that_is_not_a_path():
    from sparrow import LLM

    raises(InvalidRequestError, lambda: LLM(123, device="cpu"), "model=123")


def test_sampling_params_changed_after_construction(llm):
    """A SamplingParams edited into an invalid value is refused when the request is added; the request keeps
    a copy, so editing the caller's object afterwards does not reach it."""
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    sp.temperature = -1.0
    raises(InvalidRequestError, lambda: llm.generate({"prompt_token_ids": [1, 2]}, sp), "temperature=-1.0")
    assert not llm.engine.requests
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, stop_token_ids=[5])
    rid = llm.engine.add_request({"prompt_token_ids": [1, 2]}, sp)
    sp.max_tokens = 1
    sp.stop_token_ids.append(6)
    try:
        own = llm.engine.requests[rid][1][0].params
        assert own.max_tokens == 4 and own.stop_token_ids == [5]
    finally:
        llm.engine.abort(rid)


def test_chat_template_errors_are_sparrow_errors(tiny_model_dir, tmp_path):
    """A template that refuses (jinja2 TemplateError) was raised as is; one that does not parse is the model's."""
    from tests.helpers import GEMMA2_STYLE_TEMPLATE, save_byte_tokenizer

    path = copy_checkpoint(tiny_model_dir, tmp_path / "refusing")
    save_byte_tokenizer(path, chat_template=GEMMA2_STYLE_TEMPLATE)
    llm = make_llm(path, skip_tokenizer_init=False, max_model_len=64)
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    raises(InvalidRequestError, lambda: llm.chat([{"role": "system", "content": "be brief"},
                                                  {"role": "user", "content": "hi"}], sp),
           "chat template refused", "System role not supported")
    for bad in ([], "hi", [{"content": "hi"}]):
        raises(InvalidRequestError, lambda: llm.chat(bad, sp), "messages must be")
    assert len(llm.chat([{"role": "user", "content": "hi"}], sp)[0].outputs[0].token_ids) == 2  # still serves
    one = [llm.chat([{"role": "user", "content": t}], sp)[0].outputs[0].token_ids for t in ("hi", "hello")]
    both = llm.chat([[{"role": "user", "content": "hi"}], [{"role": "user", "content": "hello"}]], sp)  # vLLM's batch
    assert [o.outputs[0].token_ids for o in both] == one
    llm.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }"
    raises(ModelLoadError, lambda: llm.chat([{"role": "user", "content": "hi"}], sp), "does not parse")
    llm.tokenizer.chat_template = None
    raises(InvalidRequestError, lambda: llm.chat([{"role": "user", "content": "hi"}], sp), "no chat template",
           "LLM.generate", "/v1/completions")


def test_prompt_that_is_not_utf8_text():
    from sparrow.tokenizer import encode_prompt

    raises(InvalidRequestError, lambda: encode_prompt(None, "bad \udcff bytes"), "UTF-8")


def test_longest_allowed_prompt(llm):
    out = llm.generate({"prompt_token_ids": [7] * 63}, SamplingParams(temperature=0.0, max_tokens=10))[0]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"


def test_one_bad_prompt_rejects_the_batch_without_side_effects(llm):
    prompts = random_prompts([5, 9], seed=2)
    free = llm.engine.block_manager.num_free_blocks
    raises(InvalidRequestError, lambda: llm.generate(
        [ids_prompt(prompts[0]), {"prompt_token_ids": [999]}, ids_prompt(prompts[1])], GOOD), "999")
    assert not llm.engine.has_unfinished_requests() and llm.engine.block_manager.num_free_blocks == free
    raises(InvalidRequestError, lambda: llm.generate([ids_prompt(p) for p in prompts], [GOOD]), "1 SamplingParams")
    raises(InvalidRequestError, lambda: llm.generate([], GOOD), "no prompts")
    outs = llm.generate([ids_prompt(p) for p in prompts], GOOD)
    alone = [llm.generate(ids_prompt(p), GOOD)[0].outputs[0].token_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == alone


def test_duplicate_request_id(llm):
    (p,) = random_prompts([5], seed=3)
    llm.engine.add_request(ids_prompt(p), GOOD, request_id="x")
    try:
        raises(InvalidRequestError, lambda: llm.engine.add_request(ids_prompt(p), GOOD, request_id="x"), "'x'")
    finally:
        llm.engine.abort("x")
    assert not llm.engine.has_unfinished_requests()


def test_largest_top_k_samples(llm):
    """top_k = MAX_TOP_K (far above the vocabulary) keeps every token: the sampler takes it (it overflowed int64
    for larger values before SamplingParams bounded them)."""
    from sparrow.sampling_params import MAX_TOP_K

    sp = SamplingParams(temperature=1.0, top_k=MAX_TOP_K, max_tokens=3, ignore_eos=True, seed=1)
    assert len(llm.generate({"prompt_token_ids": [1, 2, 3]}, sp)[0].outputs[0].token_ids) == 3
