"""Command line: ``sparrow generate | chat | serve | bench | models`` (also ``python -m sparrow``).

Errors a user can cause (missing model, bad prompt, bad sampling value, ...) print one line naming the
problem and exit with status 2, without a traceback."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from sparrow.cli_support import (chat_prompt as _chat_prompt, chat_tokenizer as _chat_tokenizer, cmd_models,
                                 field_docs, kv_cache_args, length_note, line_editing, stats_line)
from sparrow.errors import SparrowError


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _int_at_least(low: int, high: int | None = None):
    """argparse type: an integer >= ``low`` (and <= ``high``; the error names the value)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = low - 1
        if n < low or (high is not None and n > high):
            bound = f">= {low}" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"expected an integer {bound}, got {text!r}")
        return n
    return parse


_positive_int = _int_at_least(1)


def _fraction(text: str) -> float:
    """argparse type: a number in (0, 1] (argparse names the flag in the error)."""
    try:
        x = float(text)
    except ValueError:
        x = float("nan")
    if not 0 < x <= 1:  # nan fails too
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return x


def _size(text: str) -> int:
    """argparse type: bytes, as digits or with a unit ('8GiB', '8G', '512MiB'; argparse names the flag)."""
    from sparrow.engine.kv_budget import parse_size
    from sparrow.errors import InvalidRequestError

    try:
        return parse_size(text, "value")
    except InvalidRequestError:
        raise argparse.ArgumentTypeError(f"expected bytes, e.g. 8589934592, '8GiB', '8G' or '512MiB', "
                                         f"got {text!r}") from None


def _json_object(text: str) -> dict:
    """argparse type: a JSON object (argparse names the flag in the error)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _add_model_args(p: argparse.ArgumentParser, kv_cache: bool = True) -> None:
    from sparrow.config import DEFAULT_MAX_MODEL_LEN_CAP, CacheConfig, EngineConfig  # the defaults are the config's

    p.add_argument("--model", default=None,
                   help="HF checkpoint folder or .gguf file (default: the packaged Gemma 3 270M Q4_K_M)")
    p.add_argument("--device", default=EngineConfig.device, help=f"auto | cpu | cuda (default: {EngineConfig.device})")
    p.add_argument("--dtype", default=EngineConfig.dtype,
                   help=f"auto | float32 | bfloat16 | float16 (default: {EngineConfig.dtype}; auto: bf16 on GPU and on "
                        "CPUs with native bf16, else fp32)")
    p.add_argument("--max-model-len", type=_int_at_least(2), default=EngineConfig.max_model_len,
                   help=f"longest prompt + output in tokens, at least 2 (default: the model's, at most "
                        f"{DEFAULT_MAX_MODEL_LEN_CAP})")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=CacheConfig.gpu_memory_utilization,
                   metavar="FRACTION", help=f"fraction of the GPU's memory the engine may use, weights + KV pool, in "
                                            f"(0, 1] (default {CacheConfig.gpu_memory_utilization}; GPU only)")
    if kv_cache:
        p.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                       help="speculative decoding, vLLM's dict: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' or "
                            "'{\"method\": \"draft_model\", \"model\": PATH, \"num_speculative_tokens\": 4}' "
                            "(default: off)")
        from sparrow.kv_cache import KV_CACHE_DTYPES

        p.add_argument("--kv-cache-dtype", default=CacheConfig.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                       help="KV cache storage: auto (the model dtype), fp8 / fp8_e4m3 (e4m3 with per-layer k/v "
                            f"scales, about twice the tokens; default {CacheConfig.kv_cache_dtype})")
        p.add_argument("--calculate-kv-scales", action="store_true",
                       help="with an fp8 KV cache: measure each layer's k/v scales on the first prefill (amax / "
                            "448; default: the checkpoint's k_scale / v_scale, else 1.0)")
        p.add_argument("--kv-cache-dtype-skip-layers", default="", metavar="LAYERS",
                       help="with an fp8 KV cache: layers kept in the model dtype, comma-separated: sliding_window "
                            "and / or attention-layer indices (default: none)")
        p.add_argument("--num-kv-blocks", type=_positive_int, default=CacheConfig.num_blocks,
                       help=f"KV cache size in blocks of {CacheConfig.block_size} tokens (default: what "
                            "max-model-len x the request's completions need, up to 1 GiB on CPU, up to "
                            "--gpu-memory-utilization on GPU)")
        p.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", dest="kv_cache_memory", type=_size,
                       default=CacheConfig.kv_cache_memory, metavar="BYTES",
                       help="KV cache size in bytes, e.g. 8GiB, 8G (= 8GiB), 512MiB, 8GB (10^9); overrides "
                            "--gpu-memory-utilization; not with --num-kv-blocks (default: off)")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="CPU threads of torch's ops (default 1 on a machine with <= 2 cores, else half the cores, "
                        "whatever OMP_NUM_THREADS says; the same for LLM())")
    from sparrow.quant import get_quantization, supported_quantization
    from sparrow.quant.registry import checkpoint_quantization

    names, methods = supported_quantization(), checkpoint_quantization()
    p.add_argument("--quantization", default=None, choices=names + methods, type=str.lower,
                   help="; ".join([*(get_quantization(n).help or n for n in names), f"{', '.join(methods)}: the "
                                   "checkpoint's own format, named as its quantization_config does (optional)"]))
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="with quantized linears (e.g. --quantization fp8 or an FP8 checkpoint): the LM head in the "
                        "format too (FP8: half its bytes; rounds the logits)")


def _add_lora_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora", default=None, metavar="PATH",
                   help="apply this PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors "
                        "or .bin)")


def _lora_request(args):
    """The LoRARequest of ``--lora`` (None without it)."""
    if getattr(args, "lora", None) is None:
        return None
    from sparrow.lora.request import LoRARequest

    return LoRARequest(os.path.basename(os.path.normpath(args.lora)) or "adapter", 1, args.lora)


def _lora_rank(path: str) -> int:
    """The adapter's largest rank from its adapter_config.json: r and its rank_pattern's per-module ranks (64 when
    it cannot be read: loading it reports why)."""
    try:
        with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        ranks = [cfg.get("r"), *(cfg.get("rank_pattern") or {}).values()]
    except (OSError, ValueError, AttributeError):
        return 64
    ranks = [r for r in ranks if isinstance(r, int) and not isinstance(r, bool) and r > 0]
    return max(ranks) if ranks else 64


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int, full: bool = False) -> None:
    from sparrow.sampling_params import SamplingParams

    doc = field_docs(SamplingParams)
    p.add_argument("--max-tokens", type=int, default=max_tokens, help=f"tokens to generate (default {max_tokens})")
    p.add_argument("--temperature", type=float, default=0.0, help="softmax temperature; 0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help=doc.get("top_p", "") + " (default 1)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = disabled (default)")
    p.add_argument("--min-p", type=float, default=0.0, help=doc.get("min_p", "") + " (default 0)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help=doc.get("repetition_penalty", "")
                   + " (default 1 = off)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help=doc.get("presence_penalty", ""))
    p.add_argument("--frequency-penalty", type=float, default=0.0, help=doc.get("frequency_penalty", ""))
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the request's own random generator (fp32: the same tokens whatever the batch; "
                        "bf16: see SamplingParams.seed; default: unseeded)")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help=doc.get("stop", "") + " (repeat for several)")
    p.add_argument("--min-tokens", type=int, default=0, help=doc.get("min_tokens", ""))
    p.add_argument("--ignore-eos", action="store_true", help=doc.get("ignore_eos", ""))
    if full:
        p.add_argument("--n", type=int, default=1, help=doc.get("n", "") + " (printed one after another)")
        p.add_argument("--logprobs", type=int, default=None, metavar="K",
                       help="print each generated token's log-probability and the K most likely tokens (to stderr)")


def _sampling(args):
    """SamplingParams from the flags; a bad value is reported under its flag's name (--max-tokens=0 ...)."""
    import re

    from sparrow.errors import InvalidRequestError
    from sparrow.sampling_params import SamplingParams

    try:
        return SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty, seed=args.seed, max_tokens=args.max_tokens,
            stop=args.stop, min_tokens=args.min_tokens, ignore_eos=args.ignore_eos, n=getattr(args, "n", 1),
            logprobs=getattr(args, "logprobs", None))
    except InvalidRequestError as e:
        raise InvalidRequestError(re.sub(r"SamplingParams\.(\w+)=", lambda m: f"--{m[1].replace('_', '-')}=",
                                         str(e))) from None


def _llm(args, tokenizer=None):
    import torch

    from sparrow.engine.llm import LLM

    status = sys.stderr.isatty() or args.verbose  # a status line for people, not for pipes and tests
    if status:  # and the loader's first-use steps (GGUF index, tokenizer conversion: tens of seconds)
        for name in ("sparrow.loader.gguf", "sparrow.tokenizer", "sparrow.default_model"):
            logging.getLogger(name).setLevel(logging.INFO)
        print(f"sparrow: loading {args.model or 'the packaged default model'} "
              f"({_plural(torch.get_num_threads(), 'CPU thread')}) ...", file=sys.stderr, flush=True)
    lora = {} if getattr(args, "lora", None) is None else dict(enable_lora=True, max_loras=1,
                                                             max_lora_rank=_lora_rank(args.lora))
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
              quantization=args.quantization, quantize_lm_head=args.quantize_lm_head,
              num_kv_blocks=args.num_kv_blocks, max_num_seqs=max(1, getattr(args, "n", 1)),
              gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory=args.kv_cache_memory,
              speculative_config=args.speculative_config, tokenizer=tokenizer, **kv_cache_args(args), **lora)
    if lora:  # read and check the adapter now: chat would report a bad one at each turn
        llm.engine.runner.lora.load(_lora_request(args))
    # max_num_seqs = the completions of one request: the CPU KV pool is sized to them, not to 64 sequences
    if status:
        c, runner = llm.config, llm.engine.runner
        tokens = runner.num_blocks * c.cache.block_size
        weights = sum(p.numel() * p.element_size() for p in runner.model.parameters()) / 2**20
        peak = "GPU allocator" if c.device.startswith("cuda") else "RSS"
        print(f"sparrow: loaded {c.model.architecture} in {llm.load_time:.1f} s ({c.device}, {c.dtype}, "
              f"max_model_len {c.max_model_len}; weights {weights:.0f} MiB, peak {peak} while loading "
              f"{llm.load_peak_memory / 2**20:.0f} MiB, KV cache {tokens} tokens = "
              f"{tokens * runner.kv_cache.bytes_per_token / 2**20:.0f} MiB, {c.cache.kv_cache_dtype})",
              file=sys.stderr, flush=True)
    return llm


def _read_prompt(args) -> str:
    from sparrow.errors import InvalidRequestError

    if args.file is not None:
        if args.prompt is not None:
            raise InvalidRequestError("give a prompt or --file, not both")
        try:
            with open(args.file, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidRequestError(f"cannot read the prompt file {args.file}: {e}") from None
    if args.prompt is None:
        raise InvalidRequestError("no prompt: give one, '-' to read stdin, or --file PATH")
    return sys.stdin.read() if args.prompt == "-" else args.prompt


def cmd_generate(args) -> int:
    from sparrow.errors import InvalidRequestError

    params = _sampling(args)  # validate before the slow model load
    prompt = _read_prompt(args)
    if prompt == "":
        raise InvalidRequestError("empty prompt: give at least one character or token")
    chat = args.chat or args.system
    messages = [{"role": "system", "content": args.system}] if args.system else []
    llm = _llm(args, _chat_tokenizer(args, messages) if chat else None)
    if chat:
        prompt = _chat_prompt(llm.tokenizer, [*messages, {"role": "user", "content": prompt}])
    lora = _lora_request(args)
    try:
        if params.n == 1 and params.logprobs is None:
            for piece in llm.stream(prompt, params, lora_request=lora):
                sys.stdout.write(piece)
                sys.stdout.flush()
            out = llm.last_output
            sys.stdout.write("\n")
        else:
            out = llm.generate(prompt, params, lora_request=lora)[0]
            for comp in out.outputs:
                if params.n > 1:
                    sys.stdout.write(f"--- completion {comp.index}\n")
                sys.stdout.write(comp.text + "\n")
                for tid, lps in zip(comp.token_ids, comp.logprobs or []):
                    alts = ", ".join(f"{lp.decoded_token!r} {lp.logprob:.3f}" for t, lp in lps.items() if t != tid)
                    print(f"{lps[tid].decoded_token!r}\t{lps[tid].logprob:.4f}\t[{alts}]", file=sys.stderr)
    except KeyboardInterrupt:
        sys.stdout.write("\n")  # the shell prompt starts on its own line
        sys.stdout.flush()
        raise
    sys.stdout.flush()  # here, not at exit, so a closed pipe is reported by main
    if out is not None:
        note = length_note(out, params.max_tokens, llm.config.max_model_len)
        if note is not None:
            print(note, file=sys.stderr)
        print(stats_line(out, llm.load_time), file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    from sparrow.errors import InvalidRequestError

    params = _sampling(args)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    # fail early (exit 2, before the weights load) without a template, or with one that refuses the system message
    llm = _llm(args, _chat_tokenizer(args, messages))
    if sys.stdin.isatty():
        line_editing()
    print("sparrow chat: type a message, /reset to start over, /exit or Ctrl-D to quit; Ctrl-C stops a reply",
          file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
            print("\n(/exit or Ctrl-D to quit)", file=sys.stderr)
            continue
        if line.strip() in ("/exit", "/quit", "/bye"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        reply = []
        stream = None
        try:
            stream = llm.stream(_chat_prompt(llm.tokenizer, messages), params, lora_request=_lora_request(args))
            for piece in stream:
                reply.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except InvalidRequestError as e:  # outgrew max_model_len, or the template refused it: this turn only
            messages.pop()
            print(f"sparrow: error: {' '.join(str(e).split())} (/reset starts a new conversation)", file=sys.stderr)
            continue
        except KeyboardInterrupt:  # stop this reply only (llama.cpp, Ollama); the turn is dropped
            if stream is not None:
                stream.close()  # aborts the request, freeing its KV blocks
            messages.pop()
            sys.stdout.write("\n")
            sys.stdout.flush()
            print("(reply stopped; the turn is dropped)", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
        if args.verbose and llm.last_output is not None:
            print(stats_line(llm.last_output, None), file=sys.stderr)


def cmd_serve(args) -> int:
    from sparrow.server.main import run_server

    return run_server(args)


def cmd_bench(args) -> int:
    from sparrow.bench import run_bench

    return run_bench(args)


def _lora_module(text: str) -> tuple[str, str]:
    """'NAME=PATH' or vLLM's JSON form '{"name": NAME, "path": PATH}' -> (name, path)."""
    if text.lstrip().startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("path"), str):
            raise argparse.ArgumentTypeError(f"{text!r}: expected an object with string fields name and path")
        return obj["name"], obj["path"]
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=PATH")
    return name, path


class _Parser(argparse.ArgumentParser):
    """argparse with sparrow's error format: one line, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"sparrow: error: {' '.join(message.split())}\n")


def build_parser() -> argparse.ArgumentParser:
    from sparrow import __version__
    from sparrow.config import LoRAConfig
    from sparrow.model_shapes import SHAPES

    parser = _Parser(prog="sparrow", description="sparrow: an LLM inference engine for MoE models")
    parser.add_argument("-v", "--verbose", action="store_true", help="log loading and engine details")
    parser.add_argument("--version", action="version", version=f"sparrow {__version__}")
    verbose = _Parser(add_help=False)  # -v after the subcommand too; SUPPRESS keeps one given before it
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                         help="log loading and engine details")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    g = sub.add_parser("generate", parents=[verbose], help="stream the continuation of a prompt to stdout")
    g.add_argument("prompt", nargs="?", default=None, help="the prompt text; '-' reads it from stdin")
    g.add_argument("--file", "-f", default=None, metavar="PATH", help="read the prompt from this file")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--system", default=None, help="system message (implies --chat)")
    _add_model_args(g)
    _add_lora_arg(g)
    _add_sampling_args(g, 128, full=True)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", parents=[verbose], help="interactive conversation using the model's chat template")
    c.add_argument("--system", default=None, help="system message")
    _add_model_args(c)
    _add_lora_arg(c)
    _add_sampling_args(c, 512)
    c.set_defaults(func=cmd_chat)
    s = sub.add_parser("serve", parents=[verbose],
                       help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    _add_model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=_int_at_least(1, 65535), default=8000, help="port (default 8000)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health, /version and /metrics")
    from sparrow.server.guards import add_http_args

    add_http_args(s)
    from sparrow.server.tool_choice import add_tool_args

    add_tool_args(s)
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's name(s) in the API: the first is the id responses and /v1/models report, a "
                        "request may give any (default: the model's folder or file name; --model-shape's name)")
    s.add_argument("--max-num-seqs", type=_positive_int, default=None, help="most sequences in one batch")
    s.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    s.add_argument("--model-shape", default=None, metavar="NAME",
                   help="serve a random-weight model of a named shape instead of --model, without a tokenizer: "
                        "prompts as token ids, answers as token ids (" + ", ".join(SHAPES) + ")")
    s.add_argument("--seed", type=int, default=0,
                   help="seed of the sampler's generator that requests without their own seed draw from (vLLM's "
                        "--seed: a fresh server given the same requests in the same order repeats its samples) and "
                        "of --model-shape's random weights (default 0)")
    s.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (--lora-modules)")
    s.add_argument("--enable-runtime-lora", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --enable-lora; vLLM's "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING): anyone who can reach the API then loads adapters from "
                        "the server's disk")
    s.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None, metavar="NAME=PATH",
                   help="PEFT adapter folders, each served as the model NAME (also as JSON: "
                        "'{\"name\": NAME, \"path\": PATH}')")
    s.add_argument("--max-loras", type=_positive_int, default=4, help="adapters on the device at once (default 4)")
    s.add_argument("--max-lora-rank", type=_positive_int, default=64, help="largest adapter rank (default 64)")
    s.add_argument("--max-cpu-loras", type=_positive_int, default=None,
                   help=field_docs(LoRAConfig).get("max_cpu_loras", ""))
    s.set_defaults(func=cmd_serve)
    sub.add_parser("models", parents=[verbose], help="list the installed packaged models and their paths "
                   "(for --model)").set_defaults(func=cmd_models)
    b = sub.add_parser("bench", parents=[verbose],
                       help="prefill / decode tok/s of sparrow and of HF transformers on the same weights")
    _add_model_args(b, kv_cache=False)
    b.add_argument("--batch-sizes", default=None, help="comma-separated batch sizes (default 1,8,64 on GPU, 1,8 on CPU)")
    b.add_argument("--prompt-len", "--prompt-lens", dest="prompt_len", default=None,
                   help="comma-separated prompt lengths in tokens (default 128,2048 on GPU, 128 on CPU)")
    b.add_argument("--decode-tokens", type=int, default=None,
                   help="tokens decoded per sequence (default 64 on GPU, 32 on CPU)")
    b.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    b.add_argument("--model-shape", default=None,
                   help="benchmark a random-weight model of a named shape instead of --model "
                        "(" + ", ".join(SHAPES) + ")")
    b.add_argument("--profile", action="store_true",
                   help="print torch.profiler's top ops for one decode step of each engine (batch: --profile-batch)")
    b.add_argument("--profile-batch", type=_positive_int, default=1, metavar="N",
                   help="batch size of the --profile step (default 1)")
    b.add_argument("--profile-prefill", action="store_true",
                   help="print torch.profiler's top ops for sparrow's prefill of the largest batch x longest prompt")
    b.add_argument("--out", default=None, help="also write every number to this JSON file")
    b.add_argument("--repeats", type=int, default=1, help="timed runs per point; the best is reported (default 1)")
    b.add_argument("--enforce-eager", action="store_true", help="sparrow without CUDA graphs")
    b.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts (default 0)")
    from sparrow.kv_cache import KV_CACHE_DTYPES

    b.add_argument("--kv-cache-dtype", default=None, choices=KV_CACHE_DTYPES,
                   help="sparrow's KV cache storage: auto (the model dtype) or fp8 / fp8_e4m3 (default auto)")
    b.add_argument("--hf-dtype", default=None,
                   help="run transformers in this dtype instead of sparrow's (with --model; e.g. its float32 default)")
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # bare `sparrow`: the help, as git and ollama print it
        parser.print_help()
        return 0
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    from sparrow.devices import cpu_threads

    with cpu_threads(getattr(args, "threads", None)):  # in-process callers (tests) get their count back
        return _run(args)


def _run(args) -> int:
    try:
        return args.func(args)
    except SparrowError as e:
        print(f"sparrow: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader closed stdout (e.g. `| head`): stop without a traceback
        try:  # point the descriptor at /dev/null so the flush at exit does not fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):  # no descriptor (stdout replaced in-process)
            pass
        return 1


if __name__ == "__main__":
    sys.exit(main())
