"""The ``sparrow`` command line's parser: the argument types (each error names the value), the flag groups the
subcommands share (model, LoRA, sampling) and the subcommands' parsers. ``sparrow.cli`` runs the commands."""
from __future__ import annotations

import argparse
import json

from sparrow.cli_support import field_docs


def int_at_least(low: int, high: int | None = None):
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


positive_int = int_at_least(1)


def fraction(text: str) -> float:
    """argparse type: a number in (0, 1] (argparse names the flag in the error)."""
    try:
        x = float(text)
    except ValueError:
        x = float("nan")
    if not 0 < x <= 1:  # nan fails too
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return x


def size(text: str) -> int:
    """argparse type: bytes, as digits or with a unit ('8GiB', '8G', '512MiB'; argparse names the flag)."""
    from sparrow.engine.kv_budget import parse_size
    from sparrow.errors import InvalidRequestError

    try:
        return parse_size(text, "value")
    except InvalidRequestError:
        raise argparse.ArgumentTypeError(f"expected bytes, e.g. 8589934592, '8GiB', '8G' or '512MiB', "
                                         f"got {text!r}") from None


def json_object(text: str) -> dict:
    """argparse type: a JSON object (argparse names the flag in the error)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_model_args(p: argparse.ArgumentParser, kv_cache: bool = True, gguf_recipes: bool = False) -> None:
    """The model, device and quantization flags (``kv_cache``: the KV-cache ones too; ``gguf_recipes``:
    --quantization also takes the random-block GGUF recipes of a --model-shape, ``sparrow.random_gguf``)."""
    from sparrow.config import DEFAULT_MAX_MODEL_LEN_CAP, CacheConfig, EngineConfig  # the defaults are the config's

    p.add_argument("--model", default=None,
                   help="HF checkpoint folder or .gguf file (default: the packaged Gemma 3 270M Q4_K_M)")
    p.add_argument("--device", default=EngineConfig.device, help=f"auto | cpu | cuda (default: {EngineConfig.device})")
    p.add_argument("--dtype", default=EngineConfig.dtype,
                   help=f"auto | float32 | bfloat16 | float16 (default: {EngineConfig.dtype}; auto: bf16 on GPU and on "
                        "CPUs with native bf16, else fp32)")
    p.add_argument("--max-model-len", type=int_at_least(2), default=EngineConfig.max_model_len,
                   help=f"longest prompt + output in tokens, at least 2 (default: the model's, at most "
                        f"{DEFAULT_MAX_MODEL_LEN_CAP})")
    p.add_argument("--gpu-memory-utilization", type=fraction, default=CacheConfig.gpu_memory_utilization,
                   metavar="FRACTION", help=f"fraction of the GPU's memory the engine may use, weights + KV pool, in "
                                            f"(0, 1] (default {CacheConfig.gpu_memory_utilization}; GPU only)")
    if kv_cache:
        p.add_argument("--speculative-config", type=json_object, default=None, metavar="JSON",
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
        p.add_argument("--num-kv-blocks", type=positive_int, default=CacheConfig.num_blocks,
                       help=f"KV cache size in blocks of {CacheConfig.block_size} tokens (default: what "
                            "max-model-len x the request's completions need, up to 1 GiB on CPU, up to "
                            "--gpu-memory-utilization on GPU)")
        p.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", dest="kv_cache_memory", type=size,
                       default=CacheConfig.kv_cache_memory, metavar="BYTES",
                       help="KV cache size in bytes, e.g. 8GiB, 8G (= 8GiB), 512MiB, 8GB (10^9); overrides "
                            "--gpu-memory-utilization; not with --num-kv-blocks (default: off)")
    from sparrow.config import ParallelConfig

    par = field_docs(ParallelConfig)
    p.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=ParallelConfig.tensor_parallel_size,
                   metavar="N", help=par.get("tensor_parallel_size", "") + " sparrow starts ranks 1..N-1 itself "
                   f"(default {ParallelConfig.tensor_parallel_size})")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help=par.get("enable_expert_parallel", "") + " (with --tensor-parallel-size > 1)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads of torch's ops (default 1 on a machine with <= 2 cores, else half the cores, "
                        "whatever OMP_NUM_THREADS says; the same for LLM())")
    from sparrow.quant import get_quantization, supported_quantization
    from sparrow.quant.registry import checkpoint_quantization

    names, methods = supported_quantization(), checkpoint_quantization()
    helps = [*(get_quantization(n).help or n for n in names), f"{', '.join(methods)}: the checkpoint's own format, "
             "named as its quantization_config does"]
    recipes = ()
    if gguf_recipes:
        from sparrow.random_gguf import RECIPES

        recipes = tuple(RECIPES)
        helps.append(f"{', '.join(recipes)}: with --model-shape, random GGUF blocks in llama.cpp's "
                     f"{' / '.join(ftype for ftype, _ in RECIPES.values())} type mix")
    p.add_argument("--quantization", default=None, choices=names + methods + recipes, type=str.lower,
                   help="; ".join(helps) + " (optional)")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="with quantized linears (e.g. --quantization fp8 or an FP8 checkpoint): the LM head in the "
                        "format too (FP8: half its bytes; rounds the logits)")


def add_lora_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora", default=None, metavar="PATH",
                   help="apply this PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors "
                        "or .bin)")


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int, full: bool = False) -> None:
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


def lora_module(text: str) -> tuple[str, str]:
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


class Parser(argparse.ArgumentParser):
    """argparse with sparrow's error format: one line, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"sparrow: error: {' '.join(message.split())}\n")


def build_parser(commands: dict) -> argparse.ArgumentParser:
    """The ``sparrow`` parser; ``commands``: subcommand name -> the function its parsed args go to (``args.func``)."""
    from sparrow import __version__

    parser = Parser(prog="sparrow", description="sparrow: an LLM inference engine for MoE models")
    parser.add_argument("-v", "--verbose", action="store_true", help="log loading and engine details")
    parser.add_argument("--version", action="version", version=f"sparrow {__version__}")
    verbose = Parser(add_help=False)  # -v after the subcommand too; SUPPRESS keeps one given before it
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                         help="log loading and engine details")
    sub = parser.add_subparsers(dest="command", parser_class=Parser)
    g = sub.add_parser("generate", parents=[verbose], help="stream the continuation of a prompt to stdout")
    g.add_argument("prompt", nargs="?", default=None, help="the prompt text; '-' reads it from stdin")
    g.add_argument("--file", "-f", default=None, metavar="PATH", help="read the prompt from this file")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--system", default=None, help="system message (implies --chat)")
    add_model_args(g)
    add_lora_arg(g)
    add_sampling_args(g, 128, full=True)
    g.set_defaults(func=commands["generate"])
    c = sub.add_parser("chat", parents=[verbose], help="interactive conversation using the model's chat template")
    c.add_argument("--system", default=None, help="system message")
    add_model_args(c)
    add_lora_arg(c)
    add_sampling_args(c, 512)
    c.set_defaults(func=commands["chat"])
    _add_serve_parser(sub, verbose, commands["serve"])
    sub.add_parser("models", parents=[verbose], help="list the installed packaged models and their paths "
                   "(for --model)").set_defaults(func=commands["models"])
    _add_bench_parser(sub, verbose, commands["bench"])
    return parser


def _add_serve_parser(sub, verbose, func) -> None:
    from sparrow.config import LoRAConfig
    from sparrow.model_shapes import SHAPES

    s = sub.add_parser("serve", parents=[verbose],
                       help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    add_model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int_at_least(1, 65535), default=8000, help="port (default 8000)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health, /version and /metrics")
    from sparrow.server.guards import add_http_args

    add_http_args(s)
    from sparrow.server.tool_choice import add_tool_args

    add_tool_args(s)
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's name(s) in the API: the first is the id responses and /v1/models report, a "
                        "request may give any (default: the model's folder or file name; --model-shape's name)")
    s.add_argument("--max-num-seqs", type=positive_int, default=None, help="most sequences in one batch")
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
    s.add_argument("--lora-modules", nargs="+", type=lora_module, default=None, metavar="NAME=PATH",
                   help="PEFT adapter folders, each served as the model NAME (also as JSON: "
                        "'{\"name\": NAME, \"path\": PATH}')")
    s.add_argument("--max-loras", type=positive_int, default=4, help="adapters on the device at once (default 4)")
    s.add_argument("--max-lora-rank", type=positive_int, default=64, help="largest adapter rank (default 64)")
    s.add_argument("--max-cpu-loras", type=positive_int, default=None,
                   help=field_docs(LoRAConfig).get("max_cpu_loras", ""))
    s.set_defaults(func=func)


def _add_bench_parser(sub, verbose, func) -> None:
    from sparrow.model_shapes import SHAPES

    b = sub.add_parser("bench", parents=[verbose],
                       help="prefill / decode tok/s of sparrow and of HF transformers on the same weights")
    add_model_args(b, kv_cache=False, gguf_recipes=True)
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
    b.add_argument("--profile-batch", type=positive_int, default=1, metavar="N",
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
    b.set_defaults(func=func)
