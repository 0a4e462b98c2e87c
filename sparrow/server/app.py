"""The OpenAI-compatible HTTP server (FastAPI): /v1/completions, /v1/chat/completions, /v1/models, /health,
/version, /tokenize, /detokenize, /metrics.

The app runs in the front end's process (``sparrow.server.frontend``), apart from the engine's: handlers
tokenize, check the request and hand it to the ``EngineClient``; they read its updates from an asyncio queue,
merging the updates that queued up while they were busy into one chunk. A stream's client closing the
connection cancels its generator, whose cleanup aborts the request (blocks freed before the next step); a
non-stream handler polls for a disconnect while it waits. Every error is answered in OpenAI's shape
(``ApiError.body``), with no traceback.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import re
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import sparrow
from sparrow.errors import SparrowError
from sparrow.server.engine_client import EngineClient
from sparrow.server.messages import StreamError, Update, merge_updates
from sparrow.server.guards import HttpOptions, RequestGuard, prompt_char_limit
from sparrow.server.lora_routes import add_lora_routes
from sparrow.server.openapi import install_openapi
from sparrow.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                     unknown_fields)
from sparrow.server.routes import add_generation_routes
from sparrow.server.served_model import ServedModel
from sparrow.server.serving import ApiError

log = logging.getLogger(__name__)
access_log = logging.getLogger("sparrow.server.access")


_BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


def _allowed_range(model, name: str) -> str | None:
    """A field's declared bounds as an interval ('[0.0, 2.0]', '(0.0, 1.0]', '>= 1'), None without bounds."""
    field = model.model_fields.get(name) if model is not None else None
    if field is None:
        return None
    lo = hi = None
    for m in field.metadata:
        for attr, side in (("ge", "["), ("gt", "("), ("le", "]"), ("lt", ")")):
            if getattr(m, attr, None) is not None:
                if side in "[(":
                    lo = (side, getattr(m, attr))
                else:
                    hi = (side, getattr(m, attr))
    if lo and hi:
        return f"{lo[0]}{lo[1]}, {hi[1]}{hi[0]}"
    if lo:
        return f"{'>=' if lo[0] == '[' else '>'} {lo[1]}"
    if hi:
        return f"{'<=' if hi[0] == ']' else '<'} {hi[1]}"
    return None


_UNION_FORMS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of such lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts ({\"type\": \"text\", \"text\": ...})",
    "tool_choice": "\"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
}


def _validation_message(exc: RequestValidationError, path: str) -> tuple[str, str | None]:
    """(message, param) of pydantic's first error: the field's dotted path, what it must be, and the field's
    allowed range when it declares one."""
    err = exc.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {err.get('msg')}", None
    msg = err.get("msg", "invalid value")
    for i, part in enumerate(loc):  # a field of several accepted forms: pydantic names the member it tried last
        if part in _UNION_FORMS and i + 1 < len(loc):
            loc, msg = loc[:i + 1], f"must be {_UNION_FORMS[part]}"
            break
    value = err.get("input")
    if isinstance(value, float) and value != value:
        msg = "must be a number, not NaN"
    param = ".".join(loc) or None
    allowed = _allowed_range(_BODIES.get(path), loc[0]) if len(loc) == 1 else None
    if allowed:
        msg += f" (allowed: {allowed})"
    return (f"{param}: {msg}" if param else f"request body: {msg}"), param


def _ids_json(head: dict, ids: list[int], chunk: int = 65536) -> bytes:
    """``{**head, "tokens": ids}`` as JSON bytes, written a chunk of ids at a time (for a worker thread: the C
    encoder holds the GIL for a whole call, and 3M ids take 0.5 s; FastAPI's own encoder takes seconds)."""
    parts = [json.dumps(head)[:-1].encode(), b', "tokens": [']
    for i in range(0, len(ids), chunk):
        parts.append((b"," if i else b"") + json.dumps(ids[i:i + chunk])[1:-1].encode())
    parts.append(b"]}")
    return b"".join(parts)


async def _wait_disconnect(raw: Request) -> None:
    """Return when the client of ``raw`` (a request whose body was read) disconnects."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


class _Server:
    """What the handlers share: the engine client, tokenizer, served name, limits."""

    def __init__(self, model: ServedModel, tokenizer, client: EngineClient, api_key: str | None,
                 options: HttpOptions):
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = model.max_model_len
        self.vocab_size = model.vocab_size
        self.model_name = model.name
        self.api_key = api_key
        self.options = options
        self.max_prompt_chars = prompt_char_limit(tokenizer, model.max_model_len) if tokenizer is not None else None
        self.created = int(time.time())
        self.metrics = client.metrics
        self.loop = client

    def check_model(self, model: str | None):
        """The LoRARequest a request's ``model`` names (None: the base model, or no model given). Raises ApiError
        404 naming the served models for another name."""
        if model is None or model in self.model.names:
            return None
        lora = self.model.loras.get(model)
        if lora is None:
            served = ", ".join(repr(n) for n in [*self.model.names, *self.model.loras])
            raise ApiError(404, f"the model {model!r} does not exist (this server serves {served})", "model",
                           "model_not_found")
        return lora

    def need_tokenizer(self, what: str, param: str | None) -> None:
        """ApiError 400 naming ``what`` when the model has no tokenizer (a random-weight --model-shape)."""
        if self.tokenizer is None:
            raise ApiError(400, f"{what} needs a tokenizer, and {self.model_name!r} has none (a random-weight "
                                f"shape served without one): send /v1/completions with prompt as token ids", param)

    def check_unknown(self, body) -> None:
        """400 naming a request field the server does not know (``protocol.unknown_fields``), or with
        ``reject_unknown_fields`` off a logged warning."""
        names = unknown_fields(body)
        if not names:
            return
        if self.options.reject_unknown_fields:
            raise ApiError(400, f"{names[0]}: unknown field (not a request field of this server; check its "
                                "spelling)", names[0])
        log.warning("request fields ignored (unknown): %s", ", ".join(names))

    async def encode(self, text: str, param: str = "prompt", bounded: bool = True) -> list[int]:
        """The prompt's token ids, tokenized on a worker thread (the event loop keeps answering others). Raises
        ApiError 400 without a tokenizer, and (``bounded``) before tokenizing for a text too long for the
        context by its character count alone (``guards.prompt_char_limit``; /tokenize counts any length)."""
        from sparrow.tokenizer import encode_prompt

        self.need_tokenizer("a text prompt", param)
        if bounded:
            self.check_chars(text, param)
        return await asyncio.to_thread(encode_prompt, self.tokenizer, text)

    def check_chars(self, text: str, param: str) -> None:
        limit = self.max_prompt_chars
        if limit is not None and len(text) > limit:
            raise ApiError(400, f"this model's maximum context length is {self.max_model_len} tokens, and the "
                                f"{param} has {len(text)} characters: more than {limit} (the longest token's "
                                f"characters x {self.max_model_len}) cannot fit", param)

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``; '' without a tokenizer."""
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def decode_token(self, tid: int) -> str:
        """One token's text; 'token_id:N' without a tokenizer (as logprobs name a token with no text)."""
        return self.tokenizer.decode([tid]) if self.tokenizer is not None else f"token_id:{tid}"

    async def chat_prompt(self, messages, bounded: bool = True, tools: list[dict] | None = None) -> str:
        """The conversation rendered with the chat template (given ``tools``, as HF's ``tools=``), on a worker
        thread; ``bounded``: as ``encode``."""
        from sparrow.tokenizer import apply_chat_template

        self.need_tokenizer("a chat request (the chat template)", "messages")
        dicts = [m.as_template_dict(i) for i, m in enumerate(messages)]
        if bounded:
            self.check_chars("".join(str(d.get("content") or "") for d in dicts), "messages")
        return await asyncio.to_thread(apply_chat_template, self.tokenizer, dicts, tools=tools)

    async def updates(self, queue: asyncio.Queue, streams, raw: Request | None = None):
        """Yield (stream position, Update) until every stream ended; a request's updates that queued up while
        the consumer was busy come merged into one. Raises ApiError for a StreamError. With ``raw`` (a
        non-stream request), returns early when its client disconnects. Unfinished requests are aborted on
        exit."""
        pos = {s.request_id: k for k, s in enumerate(streams)}
        live = set(pos)
        gone = asyncio.ensure_future(_wait_disconnect(raw)) if raw is not None else None
        pending: collections.deque = collections.deque()
        try:
            while live:
                if not pending:
                    if gone is None:
                        pending.append(await queue.get())
                    elif not queue.empty():
                        pending.append(queue.get_nowait())
                    else:
                        get = asyncio.ensure_future(queue.get())
                        await asyncio.wait((get, gone), return_when=asyncio.FIRST_COMPLETED)
                        if not get.done():
                            get.cancel()
                            return
                        pending.append(get.result())
                while not queue.empty():
                    pending.append(queue.get_nowait())
                rid, item = pending.popleft()
                while isinstance(item, Update) and pending and pending[0][0] == rid and isinstance(pending[0][1], Update):
                    item = merge_updates(item, pending.popleft()[1])
                if item is None:
                    live.discard(rid)
                    self._log_access(streams[pos[rid]])
                elif isinstance(item, StreamError):
                    live.discard(rid)
                    raise ApiError(400 if item.invalid_request else 500, item.message)
                else:
                    yield pos[rid], item
        finally:
            if gone is not None:
                gone.cancel()
            for rid in live:
                self.loop.abort(rid)
                self._log_access(streams[pos[rid]], "abort")

    @staticmethod
    def _log_access(s, finish: str | None = None) -> None:
        """The request's access line: its id (the response's id, ``-k`` for prompt k of several), prompt and
        generated tokens, TTFT, total time and finish reason(s) (``abort`` for a client that went away)."""
        end = time.monotonic()
        ttft = f"{s.first_token - s.arrival:.3f}s" if s.first_token is not None else "-"
        access_log.info("%s prompt_tokens=%d generated_tokens=%d ttft=%s total=%.3fs finish=%s", s.request_id,
                        len(s.prompt["prompt_token_ids"]), s.num_generated, ttft, end - s.arrival,
                        finish or ",".join(r or "-" for r in s.finish_reasons))


def build_app(model: ServedModel, tokenizer, client: EngineClient, api_key: str | None = None,
              on_engine_lost=None, options: HttpOptions | None = None) -> FastAPI:
    """The FastAPI app serving ``model`` through ``client`` (its engine runs in another process). api_key:
    required as ``Authorization: Bearer KEY`` on every route but /health and /version (and /metrics unless
    ``options.metrics_need_api_key``) when set; ``options``: the request checks (``guards.HttpOptions``). Without a tokenizer (None: a
    random-weight shape, ``skip_tokenizer_init``) the model is served on token ids: completions take prompts as
    token ids and answer with ``token_ids`` (text empty); chat, text prompts, /tokenize and /detokenize answer
    400 naming the missing tokenizer. ``on_engine_lost()``: called when the engine's connection closes."""
    options = options or HttpOptions()
    server = _Server(model, tokenizer, client, api_key, options)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        client.attach(asyncio.get_running_loop(), on_engine_lost or (lambda: None))
        yield

    app = FastAPI(title="sparrow", version=sparrow.__version__, lifespan=lifespan, redirect_slashes=False)
    app.state.server = server

    _add_error_handlers(app)
    app.add_middleware(RequestGuard, api_key=api_key, options=options)
    _add_info_routes(app, server)
    _add_token_routes(app, server)
    add_generation_routes(app, server)
    if model.runtime_lora:
        add_lora_routes(app, server)
    install_openapi(app, closed_bodies=options.reject_unknown_fields)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error answered in OpenAI's shape (``ApiError.body``): 400 for a refused request (a SparrowError, a
    validation error), the HTTP status of routing errors (404, 405 with its Allow), 500 with no detail."""

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(SparrowError)
    async def _sparrow_error(request, exc: SparrowError):
        msg = " ".join(str(exc).split())
        named = re.match(r"invalid SamplingParams\.(\w+)=", msg)  # SamplingParams names the field it refuses
        return JSONResponse(ApiError(400, msg, named.group(1) if named else None).body(), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc: RequestValidationError):
        msg, param = _validation_message(exc, request.url.path)
        return JSONResponse(ApiError(400, msg, param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code,
                            headers=exc.headers)  # a 405's Allow

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        return JSONResponse(ApiError(500, "internal server error").body(), status_code=500)


def _add_info_routes(app: FastAPI, server: "_Server") -> None:
    """/health (empty 200), /version, /metrics (Prometheus text) and /v1/models."""
    model = server.model

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": sparrow.__version__}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        """vLLM's model list: one card per served name, then one per LoRA adapter (``parent``: the base's id)."""
        base = {"object": "model", "created": server.created, "owned_by": "sparrow", "root": model.root,
                "parent": None, "max_model_len": server.max_model_len}
        names = [{"id": name, **base} for name in model.names]
        adapters = [{"id": name, **base, "root": lora.lora_path, "parent": server.model_name}
                    for name, lora in model.loras.items()]
        return {"object": "list", "data": [*names, *adapters]}


def _add_token_routes(app: FastAPI, server: "_Server") -> None:
    """/tokenize and /detokenize (vLLM's bodies)."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        server.check_model(body.model)
        server.check_unknown(body)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt and messages", "prompt")
        server.need_tokenizer("/tokenize", "prompt")
        text = body.prompt if body.messages is None else await server.chat_prompt(body.messages, bounded=False)
        if body.add_special_tokens and text:
            ids = await server.encode(text, bounded=False)
        else:
            ids = (await asyncio.to_thread(server.tokenizer, text, add_special_tokens=False))["input_ids"]
        body = await asyncio.to_thread(_ids_json, {"count": len(ids), "max_model_len": server.max_model_len}, ids)
        return Response(body, media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        server.check_model(body.model)
        server.check_unknown(body)
        server.need_tokenizer("/detokenize", "tokens")
        vocab = server.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise ApiError(400, f"tokens: ids must be in [0, {vocab})", "tokens")
        return {"prompt": server.tokenizer.decode(body.tokens)}
