"""Command line: ``sparrow generate | chat | serve | bench`` (also ``python -m sparrow``).

Errors a user can cause (missing model, bad prompt, bad sampling value, ...) print one line naming the
problem and exit with status 2, without a traceback."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from sparrow.errors import SparrowError


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (the error names the value)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def _add_model_args(p: argparse.ArgumentParser) -> None:
    from sparrow.config import DEFAULT_MAX_MODEL_LEN_CAP, EngineConfig  # the defaults are the config's

    p.add_argument("--model", default=None,
                   help="HF checkpoint folder or .gguf file (default: the packaged Gemma 3 270M Q4_K_M)")
    p.add_argument("--device", default=EngineConfig.device, help=f"auto | cpu | cuda (default: {EngineConfig.device})")
    p.add_argument("--dtype", default=EngineConfig.dtype,
                   help=f"auto | float32 | bfloat16 | float16 (default: {EngineConfig.dtype}; auto: bf16 on GPU and on "
                        "CPUs with native bf16, else fp32)")
    p.add_argument("--max-model-len", type=int, default=EngineConfig.max_model_len,
                   help=f"longest prompt + output in tokens (default: the model's, at most "
                        f"{DEFAULT_MAX_MODEL_LEN_CAP})")
    from sparrow.quant import get_quantization, supported_quantization

    names = supported_quantization()
    p.add_argument("--quantization", default=None, choices=names,
                   help="; ".join(get_quantization(n).help or n for n in names))
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="with quantized linears (e.g. --quantization fp8 or an FP8 checkpoint): the LM head in the "
                        "format too (FP8: half its bytes; rounds the logits)")


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens, help=f"tokens to generate (default {max_tokens})")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = disabled")
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def _sampling(args):
    from sparrow.sampling_params import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, seed=args.seed, max_tokens=args.max_tokens)


def _llm(args):
    from sparrow.engine.llm import LLM

    return LLM(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
               quantization=args.quantization, quantize_lm_head=args.quantize_lm_head)


def cmd_generate(args) -> int:
    from sparrow.tokenizer import apply_chat_template

    from sparrow.errors import InvalidRequestError

    params = _sampling(args)  # validate before the slow model load
    if args.prompt == "":
        raise InvalidRequestError("empty prompt: give at least one character or token")
    llm = _llm(args)
    prompt = args.prompt
    if args.chat:
        prompt = apply_chat_template(llm.tokenizer, [{"role": "user", "content": prompt}])
    for piece in llm.stream(prompt, params):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()  # here, not at exit, so a closed pipe is reported by main
    return 0


def cmd_chat(args) -> int:
    from sparrow.errors import InvalidRequestError
    from sparrow.tokenizer import apply_chat_template

    params = _sampling(args)
    llm = _llm(args)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    # fail early (exit 2) without a template, or with one that refuses the system message
    apply_chat_template(llm.tokenizer, [*messages, {"role": "user", "content": "hi"}])
    print("sparrow chat: type a message, /reset to start over, /exit or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        reply = []
        try:
            for piece in llm.stream(apply_chat_template(llm.tokenizer, messages), params):
                reply.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except InvalidRequestError as e:  # outgrew max_model_len, or the template refused it: this turn only
            messages.pop()
            print(f"sparrow: error: {' '.join(str(e).split())} (/reset starts a new conversation)", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})


def cmd_serve(args) -> int:
    from sparrow.server.main import run_server

    return run_server(args)


def cmd_bench(args) -> int:
    from sparrow.bench import run_bench

    return run_bench(args)


class _Parser(argparse.ArgumentParser):
    """argparse with sparrow's error format: one line, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"sparrow: error: {' '.join(message.split())}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sparrow", description="sparrow: an LLM inference engine for MoE models")
    parser.add_argument("-v", "--verbose", action="store_true", help="log loading and engine details")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="stream the continuation of a prompt to stdout")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _add_model_args(g)
    _add_sampling_args(g, 128)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive conversation using the model's chat template")
    c.add_argument("--system", default=None, help="system message")
    _add_model_args(c)
    _add_sampling_args(c, 512)
    c.set_defaults(func=cmd_chat)
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    _add_model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=_positive_int, default=8000, help="port (default 8000)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    s.add_argument("--served-model-name", default=None, help="the model's name in the API (default: its path)")
    s.add_argument("--max-num-seqs", type=_positive_int, default=None, help="most sequences in one batch")
    s.add_argument("--num-kv-blocks", type=_positive_int, default=None,
                   help="KV-cache blocks (default: sized from free memory)")
    s.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    s.set_defaults(func=cmd_serve)
    b = sub.add_parser("bench", help="prefill / decode tok/s of sparrow and of HF transformers on the same weights")
    _add_model_args(b)
    b.add_argument("--batch-sizes", default=None, help="comma-separated batch sizes (default 1,8,64 on GPU, 1,8 on CPU)")
    b.add_argument("--prompt-len", "--prompt-lens", dest="prompt_len", default=None,
                   help="comma-separated prompt lengths in tokens (default 128,2048 on GPU, 128 on CPU)")
    b.add_argument("--decode-tokens", type=int, default=None,
                   help="tokens decoded per sequence (default 64 on GPU, 32 on CPU)")
    b.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    b.add_argument("--model-shape", default=None,
                   help="benchmark a random-weight model of a named shape instead of --model "
                        "(gemma4-26b-a4b, qwen3-30b-a3b, llama3-8b, gemma3-270m, tiny-moe, tiny-gemma4, tiny-dense)")
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
    b.add_argument("--hf-dtype", default=None,
                   help="run transformers in this dtype instead of sparrow's (with --model; e.g. its float32 default)")
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
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
