"""``sparrow serve``: load the model, log a startup banner, run the app under uvicorn until Ctrl-C."""
from __future__ import annotations

import logging

log = logging.getLogger("sparrow.server")


def run_server(args) -> int:
    """Serve ``args`` (the ``serve`` subcommand's namespace). Raises SparrowError for a bad model or engine
    argument (before anything listens)."""
    import uvicorn

    from sparrow.engine.llm import LLM
    from sparrow.server.app import build_app

    extra = {"max_num_seqs": args.max_num_seqs} if args.max_num_seqs is not None else {}
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
              quantization=args.quantization, quantize_lm_head=args.quantize_lm_head,
              num_kv_blocks=args.num_kv_blocks, enforce_eager=args.enforce_eager, **extra)
    app = build_app(llm, served_model_name=args.served_model_name, api_key=args.api_key)
    server = app.state.server
    cfg = llm.config
    kv_tokens = llm.engine.block_manager.num_blocks * cfg.cache.block_size
    logging.getLogger("sparrow.server").setLevel(logging.INFO)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(name)s: %(message)s")
    log.info("sparrow serve: model %s (%s) on %s, %s; KV cache %d tokens; max_model_len %d; "
             "listening on http://%s:%d/v1", server.model_name, llm.model_path, cfg.device, cfg.dtype, kv_tokens,
             cfg.max_model_len, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0
