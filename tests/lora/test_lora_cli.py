"""``sparrow generate --lora PATH``: the adapter's greedy text equals ``LLM.generate`` with its LoRARequest (the
adapter itself is checked against PEFT in test_lora_peft.py), and differs from the base model's; ``LLM.chat``
with a lora_request."""
from __future__ import annotations

from sparrow import LLM, LoRARequest, SamplingParams
from tests.helpers import run_cli, tiny_model_dir, tiny_text_model_dir  # noqa: F401  (fixtures)
from tests.lora._adapters import DENSE_TARGETS, make_adapter


def _adapter_and_llm(model_dir, tmp_path, seed: int):
    """A rank-4 dense adapter of the tiny Llama at ``model_dir`` and an fp32 CPU LLM with one LoRA slot."""
    adapter = make_adapter("llama", model_dir, tmp_path / "adapter", seed=seed, r=4, lora_alpha=8,
                           target_modules=DENSE_TARGETS)
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=64, enable_lora=True, max_loras=1,
              max_lora_rank=4)
    return adapter, llm


def test_generate_with_lora(tiny_text_model_dir, tmp_path):  # noqa: F811
    adapter, llm = _adapter_and_llm(tiny_text_model_dir, tmp_path, seed=3)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    base = llm.generate("hello", params)[0].outputs[0].text
    tuned = llm.generate("hello", params, lora_request=LoRARequest("adapter", 1, str(adapter)))[0].outputs[0].text
    assert tuned != base
    proc = run_cli("generate", "hello", "--model", str(tiny_text_model_dir), "--lora", str(adapter), "--device",
                   "cpu", "--dtype", "float32", "--max-model-len", "64", "--max-tokens", "8", "--temperature", "0",
                   "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == tuned + "\n"


def test_generate_with_a_missing_adapter_is_one_line(tiny_text_model_dir, tmp_path):  # noqa: F811
    from tests.helpers import assert_cli_error

    missing = tmp_path / "nowhere"
    msg = assert_cli_error(run_cli("generate", "hello", "--model", str(tiny_text_model_dir), "--lora", str(missing),
                                   "--device", "cpu", "--max-model-len", "64", "--max-tokens", "2"), str(missing))
    assert "Traceback" not in msg


def test_generate_with_a_rank_pattern(tiny_text_model_dir, tmp_path):  # noqa: F811
    """An adapter whose rank_pattern gives a module a rank above r (as PEFT writes for fused experts' gate_up_proj)
    runs: --lora sizes the slots by its largest rank."""
    adapter = make_adapter("llama", tiny_text_model_dir, tmp_path / "adapter", seed=4, r=2, lora_alpha=4,
                           target_modules=["q_proj", "o_proj"], rank_pattern={"q_proj": 6})
    llm = LLM(str(tiny_text_model_dir), device="cpu", dtype="float32", max_model_len=64, enable_lora=True,
              max_loras=1, max_lora_rank=6)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tuned = llm.generate("hello", params, lora_request=LoRARequest("adapter", 1, str(adapter)))[0].outputs[0].text
    proc = run_cli("generate", "hello", "--model", str(tiny_text_model_dir), "--lora", str(adapter), "--device",
                   "cpu", "--dtype", "float32", "--max-model-len", "64", "--max-tokens", "8", "--temperature", "0",
                   "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == tuned + "\n"


def test_llm_chat_with_lora(tiny_text_model_dir, tmp_path):  # noqa: F811
    """LLM.chat takes lora_request (as vLLM's): the reply is generate's on the templated conversation."""
    from sparrow.tokenizer import apply_chat_template

    adapter, llm = _adapter_and_llm(tiny_text_model_dir, tmp_path, seed=5)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    messages = [{"role": "user", "content": "hi"}]
    lora = LoRARequest("adapter", 1, str(adapter))
    prompt = apply_chat_template(llm.tokenizer, messages)
    want = llm.generate(prompt, params, lora_request=lora)[0].outputs[0].token_ids
    assert want != llm.generate(prompt, params)[0].outputs[0].token_ids
    assert llm.chat(messages, params, lora_request=lora)[0].outputs[0].token_ids == want


def test_chat_with_a_missing_adapter_stops_at_start(tiny_text_model_dir, tmp_path):  # noqa: F811
    """``sparrow chat --lora`` checks the adapter before the first turn: one error line, exit 2 (not an error at
    every turn and exit 0)."""
    from tests.helpers import assert_cli_error

    missing = tmp_path / "nowhere"
    assert_cli_error(run_cli("chat", "--model", str(tiny_text_model_dir), "--lora", str(missing), "--device", "cpu",
                             "--max-model-len", "64", "--max-tokens", "2", input="hi\nhello\n"), str(missing))
