"""The command line (``python -m sparrow``) in subprocesses.

Bad input: exit status 2, stderr exactly one line starting with 'sparrow: error:', no traceback.
Success: ``generate`` / ``generate --chat`` / ``chat`` on the SmolLM2 GGUF print the same greedy text as
``LLM.generate`` / ``LLM.chat`` in this process (the oracle). SmolLM2 loads cost seconds each, so there
are three subprocess loads of it; the cheap cases use the tiny random Llama (with a byte tokenizer).
"""
from __future__ import annotations

import os

import pytest

from sparrow import SamplingParams
from tests.helpers import (  # noqa: F401  (fixtures)
    assert_cli_error,
    gguf_bert,
    gguf_truncated_data,
    gguf_truncated_header,
    missing_tensor_dir,
    run_cli,
    smollm2_gguf,
    tiny_model_dir,
    tiny_text_model_dir,
    unknown_arch_dir,
)

PROMPT = "The capital of France is"
MAX_TOKENS = 8
SMALL_CONTEXT = 256
"""max_model_len for the in-process oracle and the chat runs: a smaller KV pool, the same greedy tokens."""


@pytest.fixture(scope="module")
def tokenizer_cache(tmp_path_factory):
    """SPARROW_CACHE for this module: the GGUF tokenizer is converted once, then reused by the subprocesses."""
    return str(tmp_path_factory.mktemp("sparrow-cache"))


@pytest.fixture(scope="module")
def smollm2_oracle(tokenizer_cache):
    """Greedy texts from LLM in this process: (generate text, chat text for PROMPT, chat text for 'Hello').
    Prefix caching off: each CLI run is a fresh process whose one request hits no cache, and in bf16 (the CPU
    default with AMX / AVX512-BF16) a cached chat-template prefix shifts the logits enough to flip a near tie
    (SmolLM2's 'Hello' reply: 3rd token logprobs -1.62 / -1.75)."""
    from sparrow import LLM

    old = os.environ.get("SPARROW_CACHE")
    os.environ["SPARROW_CACHE"] = tokenizer_cache
    try:
        llm = LLM(str(smollm2_gguf()), device="cpu", max_model_len=SMALL_CONTEXT, enable_prefix_caching=False)
    finally:
        if old is None:
            del os.environ["SPARROW_CACHE"]
        else:
            os.environ["SPARROW_CACHE"] = old
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    text = llm.generate(PROMPT, sp)[0].outputs[0].text
    chat = llm.chat([{"role": "user", "content": PROMPT}], sp)[0].outputs[0].text
    hello = llm.chat([{"role": "user", "content": "Hello"}], sp)[0].outputs[0].text
    return text, chat, hello


def cli(*args, **kw):
    return run_cli(*args, "--device", "cpu", **kw)


# ---------------------------------------------------------------- bad input -> exit 2, one line


def test_missing_model(tmp_path):
    path = tmp_path / "nope"
    assert_cli_error(cli("generate", "hi", "--model", path), str(path), "does not exist")


def test_truncated_gguf_header(gguf_truncated_header):
    assert_cli_error(cli("generate", "hi", "--model", gguf_truncated_header), str(gguf_truncated_header))


def test_truncated_gguf_data(gguf_truncated_data):
    assert_cli_error(cli("generate", "hi", "--model", gguf_truncated_data), str(gguf_truncated_data))


def test_unsupported_gguf_architecture(gguf_bert):
    assert_cli_error(cli("generate", "hi", "--model", gguf_bert), "'bert'", "supported:")


def test_unknown_hf_architecture(unknown_arch_dir):
    assert_cli_error(cli("generate", "hi", "--model", unknown_arch_dir), "FooBarForCausalLM", "LlamaForCausalLM")


def test_missing_tensor(missing_tensor_dir):
    assert_cli_error(cli("generate", "hi", "--model", missing_tensor_dir),
                     "'model.layers.1.mlp.down_proj.weight'", "(64, 128)")


@pytest.mark.parametrize("args, needle", [
    (["--top-p", "0"], "--top-p=0"),
    (["--temperature", "-1"], "--temperature=-1"),
    (["--top-k", "-2"], "--top-k=-2"),
    (["--min-p", "2"], "--min-p=2"),
    (["--max-tokens", "0"], "--max-tokens=0"),
    (["--repetition-penalty", "0"], "--repetition-penalty=0"),
    (["--presence-penalty", "3"], "--presence-penalty=3"),
    (["--min-tokens", "9", "--max-tokens", "4"], "--min-tokens=9"),
])
def test_invalid_sampling_values(tiny_model_dir, args, needle):
    """Named by the flag the user typed (was SamplingParams.max_tokens=...)."""
    line = assert_cli_error(cli("generate", "hi", "--model", tiny_model_dir, *args), needle)
    assert "SamplingParams" not in line


def test_empty_prompt(tiny_model_dir):
    assert_cli_error(cli("generate", "", "--model", tiny_model_dir), "empty prompt")


def test_prompt_longer_than_max_model_len(tiny_text_model_dir):
    # byte tokenizer: 40 characters are 40 tokens
    assert_cli_error(cli("generate", "x" * 40, "--model", tiny_text_model_dir, "--max-model-len", "16"),
                     "40 tokens", "max_model_len=16")


def test_max_model_len_above_the_model(tiny_model_dir):
    assert_cli_error(cli("generate", "hi", "--model", tiny_model_dir, "--max-model-len", "100000"),
                     "max_model_len=100000", "512")


def test_bad_dtype(tiny_model_dir):
    assert_cli_error(cli("generate", "hi", "--model", tiny_model_dir, "--dtype", "float8"), "'float8'")


def test_model_without_tokenizer(tiny_model_dir):
    # reported: sparrow/tokenizer.py puts transformers' multi-line message into the error, so only check
    # the status and the first line here (test_bad_input.py has the strict xfail for the one-line rule)
    proc = cli("generate", "hi", "--model", tiny_model_dir)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("sparrow: error: cannot load a tokenizer")


def test_chat_without_template(tiny_model_dir, tmp_path):
    from tests.helpers import copy_checkpoint, save_byte_tokenizer

    path = copy_checkpoint(tiny_model_dir, tmp_path / "no-template")
    save_byte_tokenizer(path)
    assert_cli_error(cli("generate", "hi", "--chat", "--model", path), "chat template", "SmolLM2-135M-Instruct")
    assert_cli_error(cli("chat", "--model", path, input="hi\n"), "chat template", "SmolLM2-135M-Instruct")
    # said before the weights load: no "loaded" line under -v
    early = cli("chat", "-v", "--model", path, input="hi\n")
    assert "chat template" in early.stderr and "sparrow: loaded" not in early.stderr, early.stderr


def test_chat_on_the_default_base_model_fails_before_loading():
    """The packaged Gemma 3 270M has no template: said before its weights load (only the tokenizer is read)."""
    import time

    t0 = time.monotonic()
    proc = cli("chat", "-v", input="hi\n")
    assert proc.returncode == 2 and "has no chat template" in proc.stderr, proc.stderr
    assert "sparrow: loaded" not in proc.stderr and "loading" not in proc.stderr, proc.stderr
    assert time.monotonic() - t0 < 30


@pytest.fixture(scope="module")
def refusing_template_dir(tiny_model_dir, tmp_path_factory):
    from tests.helpers import GEMMA2_STYLE_TEMPLATE, copy_checkpoint, save_byte_tokenizer

    path = copy_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("refusing") / "tiny")
    save_byte_tokenizer(path, chat_template=GEMMA2_STYLE_TEMPLATE)
    return path


def test_generate_chat_with_a_template_that_refuses(refusing_template_dir):
    """Was a 32-line jinja2 traceback and exit 1."""
    assert_cli_error(cli("generate", "x" * 30, "--chat", "--model", refusing_template_dir),
                     "chat template refused", "Messages longer than 20 characters are not supported")


def test_chat_with_a_system_message_the_template_refuses(refusing_template_dir):
    """Every turn would be refused: one line and exit 2 before the first prompt."""
    assert_cli_error(cli("chat", "--system", "be brief", "--model", refusing_template_dir, input="hi\n"),
                     "System role not supported")


def test_chat_turn_the_template_refuses_is_reported_and_chat_goes_on(refusing_template_dir):
    proc = cli("chat", "--model", refusing_template_dir, "--max-tokens", "3",
               input="hi\n" + "x" * 30 + "\nagain\n/exit\n")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("sparrow: error:")]
    assert len(errors) == 1 and "Messages longer than 20 characters" in errors[0], proc.stderr
    assert proc.stdout.count("> ") == 4  # hi, the refused turn, again, /exit: every line was read


# ---------------------------------------------------------------- success


def test_generate_and_chat_on_the_tiny_model(tiny_text_model_dir):
    proc = cli("generate", "hello", "--model", tiny_text_model_dir, "--max-tokens", "5")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("\n") and "Traceback" not in proc.stderr
    proc = cli("chat", "--model", tiny_text_model_dir, "--max-tokens", "4", "--system", "be brief",
               input="hi\n/reset\nagain\n")  # ends with EOF instead of /exit
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("> ") == 4  # a prompt per line read, and one that meets EOF


def test_chat_turn_longer_than_the_context_is_refused_and_chat_goes_on(tiny_text_model_dir):
    """A turn that makes the conversation longer than max_model_len is reported on one line and dropped; the
    session reads on (before, it ended with exit status 2 and the lines after it were never read)."""
    proc = cli("chat", "--model", tiny_text_model_dir, "--max-tokens", "3", "--max-model-len", "40",
               input="x" * 40 + "\n/reset\nhi\n/exit\n")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("sparrow: error:")]
    assert len(errors) == 1 and "max_model_len=40" in errors[0] and "/reset" in errors[0], proc.stderr
    assert proc.stdout.count("> ") == 4  # every line was read


def test_generate_into_a_closed_pipe(tiny_text_model_dir):
    """`sparrow generate ... | head -c 1`: the reader is gone; exit status 1 without a traceback."""
    import subprocess
    import sys

    from tests.helpers import REPO_ROOT

    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        proc = subprocess.run([sys.executable, "-m", "sparrow", "generate", "hello", "--model", str(tiny_text_model_dir),
                               "--device", "cpu", "--max-tokens", "4"], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, env=env, cwd=str(REPO_ROOT), timeout=300)
    finally:
        os.close(write_end)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


def test_generate_into_a_closed_stream_in_process(tiny_text_model_dir, monkeypatch):
    """The same in one process, with sys.stdout replaced by an object without a file descriptor."""
    import io
    import sys

    from sparrow.cli import main

    class Closed(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Closed())
    assert main(["generate", "hello", "--model", str(tiny_text_model_dir), "--device", "cpu", "--max-tokens", "2"]) == 1


@pytest.mark.slow
def test_generate_smollm2_matches_llm(smollm2_oracle, tokenizer_cache):
    text, _, _ = smollm2_oracle
    assert text.strip()
    proc = cli("generate", PROMPT, "--model", smollm2_gguf(), "--max-tokens", MAX_TOKENS,
               env={"SPARROW_CACHE": tokenizer_cache})
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == text + "\n"


@pytest.mark.slow
def test_generate_chat_smollm2_matches_llm_chat(smollm2_oracle, tokenizer_cache):
    _, chat, _ = smollm2_oracle
    assert chat.strip()
    proc = cli("generate", PROMPT, "--chat", "--model", smollm2_gguf(), "--max-tokens", MAX_TOKENS,
               "--max-model-len", SMALL_CONTEXT, env={"SPARROW_CACHE": tokenizer_cache})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == chat + "\n"


@pytest.mark.slow
def test_chat_session_smollm2(smollm2_oracle, tokenizer_cache):
    _, _, hello = smollm2_oracle
    proc = cli("chat", "--model", smollm2_gguf(), "--max-tokens", MAX_TOKENS, "--max-model-len", SMALL_CONTEXT,
               input="Hello\n/exit\n", env={"SPARROW_CACHE": tokenizer_cache})
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    # input() writes its '> ' prompt to stdout when stdin is not a terminal
    assert proc.stdout == "> " + hello + "\n> "


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"], ["serve"], ["bench"]])
@pytest.mark.parametrize("value", ["0", "1.5", "-0.2", "nan", "half"])
def test_gpu_memory_utilization_out_of_range(command, value, capsys):
    """Refused by the parser (before any model load), naming the flag and the interval."""
    from sparrow.cli import main

    with pytest.raises(SystemExit) as exc:
        main([*command, "--gpu-memory-utilization", value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and err.startswith("sparrow: error:")
    assert "--gpu-memory-utilization" in err and "(0, 1]" in err and repr(value) in err


def test_gpu_memory_utilization_reaches_the_cache_config():
    from sparrow.cli import build_parser
    from sparrow.config import CacheConfig
    from sparrow.server.main import _build_llm

    args = build_parser().parse_args(["serve", "--model-shape", "tiny-dense", "--device", "cpu",
                                      "--gpu-memory-utilization", "0.5", "--max-model-len", "32"])
    assert _build_llm(args).config.cache.gpu_memory_utilization == 0.5
    assert build_parser().parse_args(["bench"]).gpu_memory_utilization == CacheConfig.gpu_memory_utilization


def test_kv_cache_dtype_flags_reach_the_cache_config(tiny_model_dir, capsys):
    """--kv-cache-dtype / --calculate-kv-scales / --kv-cache-dtype-skip-layers on serve (and generate, chat); a bad
    dtype is refused by the parser naming the flag and the value; a bad skip entry by the config, naming it."""
    from sparrow.cli import build_parser, main
    from sparrow.server.main import _build_llm

    args = build_parser().parse_args(["serve", "--model-shape", "tiny-dense", "--device", "cpu", "--max-model-len",
                                      "32", "--kv-cache-dtype", "fp8", "--calculate-kv-scales",
                                      "--kv-cache-dtype-skip-layers", "sliding_window,1"])
    cache = _build_llm(args).config.cache
    assert (cache.kv_cache_dtype, cache.calculate_kv_scales, cache.kv_cache_dtype_skip_layers) == (
        "fp8", True, ("sliding_window", 1))
    for command in (["generate", "hi"], ["chat"]):
        assert build_parser().parse_args([*command, "--kv-cache-dtype", "fp8_e4m3"]).kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(SystemExit) as exc:
        main(["generate", "hi", "--kv-cache-dtype", "int8"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--kv-cache-dtype" in err and "'int8'" in err
    assert_cli_error(cli("generate", "hi", "--model", tiny_model_dir, "--kv-cache-dtype", "fp8",
                         "--kv-cache-dtype-skip-layers", "full"), "kv_cache_dtype_skip_layers entry 'full'")


def test_serve_model_and_model_shape_refused(tiny_model_dir):
    assert_cli_error(cli("serve", "--model", tiny_model_dir, "--model-shape", "tiny-dense"),
                     "--model or --model-shape")
    assert_cli_error(cli("serve", "--model-shape", "tiny-dense", "--port", "99999"), "--port",
                     "from 1 to 65535", "'99999'")
