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
                                 kv_cache_args, length_note, line_editing, parallel_args, stats_line)
from sparrow import cli_args
from sparrow.errors import SparrowError


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


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

    from sparrow.llm import LLM

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
              speculative_config=args.speculative_config, tokenizer=tokenizer, **kv_cache_args(args),
              **parallel_args(args), **lora)
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


def build_parser() -> argparse.ArgumentParser:
    """The ``sparrow`` parser (``sparrow.cli_args``), its subcommands bound to the commands here."""
    return cli_args.build_parser({"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve,
                                  "models": cmd_models, "bench": cmd_bench})


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
