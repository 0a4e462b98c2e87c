"""``sparrow serve``: load the model, log a startup banner, run the app under uvicorn until Ctrl-C."""
from __future__ import annotations

import logging
import signal

log = logging.getLogger("sparrow.server")


def _build_llm(args):
    """The LLM the flags ask for: ``--model`` (or the packaged default) with its tokenizer, or a random-weight
    ``--model-shape`` without one (``model_shapes.random_llm``). Raises SparrowError for a bad model or engine
    argument, or for both --model and --model-shape."""
    from sparrow.errors import InvalidRequestError

    from sparrow.cli_support import kv_cache_args, parallel_args

    engine = dict(device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                  num_kv_blocks=args.num_kv_blocks, enforce_eager=args.enforce_eager,
                  gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory=args.kv_cache_memory,
                  speculative_config=args.speculative_config, **kv_cache_args(args), **parallel_args(args))
    if args.max_num_seqs is not None:
        engine["max_num_seqs"] = args.max_num_seqs
    if args.enable_lora:
        engine.update(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                      max_cpu_loras=args.max_cpu_loras)
    quant = dict(quantization=args.quantization, quantize_lm_head=args.quantize_lm_head)
    shape = getattr(args, "model_shape", None)
    if shape is None:
        from sparrow.llm import LLM

        return LLM(args.model, seed=args.seed, **quant, **engine)
    if args.model is not None:
        raise InvalidRequestError("give --model or --model-shape, not both")
    from sparrow.model_shapes import random_llm

    return random_llm(shape, seed=args.seed, **quant, **engine)


def run_server(args) -> int:
    """Serve ``args`` (the ``serve`` subcommand's namespace) until Ctrl-C or the front end exits. Raises
    SparrowError for a bad model or engine argument (before anything listens) or a port that cannot be bound."""
    from sparrow.errors import InvalidRequestError
    from sparrow.server.guards import http_options
    from sparrow.server.launch import start_server
    from sparrow.server.tool_choice import chat_options

    if args.lora_modules and not args.enable_lora:
        raise InvalidRequestError("--lora-modules needs --enable-lora")
    if args.enable_runtime_lora and not args.enable_lora:
        raise InvalidRequestError("--enable-runtime-lora needs --enable-lora")
    logging.getLogger("sparrow.server").setLevel(logging.INFO)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(name)s: %(message)s")
    options = http_options(args)  # a bad flag fails before the model loads
    chat = chat_options(args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser)
    llm = _build_llm(args)
    shape = getattr(args, "model_shape", None)
    loras = dict(args.lora_modules or [])
    if len(loras) != len(args.lora_modules or []):
        raise InvalidRequestError("--lora-modules: each adapter needs a name of its own")
    srv = start_server(llm, host=args.host, port=args.port, served_model_name=args.served_model_name or shape,
                       api_key=args.api_key, lora_modules=loras, background=False,
                       enable_runtime_lora=args.enable_runtime_lora, http_options=options, chat=chat)
    cfg = llm.config
    kv_tokens = llm.engine.block_manager.num_blocks * cfg.cache.block_size
    source = f"random-weight shape {shape}, no tokenizer: token-id prompts" if shape else llm.model_path
    quant = f", {args.quantization}" if args.quantization else ""
    adapters = f"; LoRA adapters {', '.join(srv.model.loras)}" if srv.model.loras else ""
    if args.enable_runtime_lora:
        adapters += "; runtime LoRA loading on (/v1/load_lora_adapter)"
    named = ", ".join(srv.model.names) + ("" if srv.model.name == source else f" ({source})")
    peak = "" if llm.load_peak_memory is None else \
        f"; peak {'GPU allocator' if cfg.device.startswith('cuda') else 'RSS'} while loading " \
        f"{llm.load_peak_memory / 2**30:.2f} GiB"
    log.info("sparrow serve: model %s on %s, %s%s; KV cache %d tokens; max_model_len %d%s%s; "
             "listening on %s/v1", named, cfg.device, cfg.dtype, quant, kv_tokens, cfg.max_model_len, peak, adapters,
             srv.url)
    def _terminate(signum, frame):  # SIGTERM (docker stop, kill): the same orderly stop as Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    try:
        srv.serve()  # the engine loop, on this (the main) thread, until the front end exits
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()
    if srv.exitcode not in (0, None, -2):  # -2: SIGINT (Ctrl-C reached the front end too)
        log.error("the HTTP front end exited with code %s; the server stopped", srv.exitcode)
        return 1
    return 0
