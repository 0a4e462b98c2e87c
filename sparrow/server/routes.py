"""POST /v1/completions and /v1/chat/completions: request -> engine prompts and SamplingParams -> the engine
loop -> an OpenAI body (non-stream) or ``*.chunk`` SSE events ending in ``data: [DONE]`` (stream).

A completion's choices are numbered prompt-major (``prompt_index * n + i``, as OpenAI's and vLLM's servers).
``echo`` with ``max_tokens`` 0 runs one step for the prompt's logprobs and drops the sampled token (the
log-likelihood request lm-eval sends). ``return_token_ids`` (vLLM's; always on for a model without a tokenizer,
whose text is empty) adds ``prompt_token_ids`` and ``token_ids`` to each completion choice. An error after a stream started ends it with an ``{"error": ...}``
event and ``[DONE]``.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from fastapi.sse import format_sse_event

from sparrow.server.protocol import ChatCompletionRequest, CompletionRequest
from sparrow.server.tool_choice import ChoiceOutput, constrain, plan_tools, stream_choices, whole_choice
from sparrow.server.serving import ApiError, Choice, LegacyLogprobs, chat_logprobs, check_context, usage

log = logging.getLogger(__name__)


def _sse(obj) -> bytes:
    return format_sse_event(data_str=obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False))


async def _completion_prompts(server, prompt) -> list[dict]:
    """Engine prompts of a completions ``prompt``: a string, strings, token ids, or lists of token ids."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise ApiError(400, "prompt: give at least one prompt", "prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    out = []
    for p in prompt:
        if isinstance(p, str):
            out.append({"prompt_token_ids": await server.encode(p), "prompt": p})
        else:
            vocab = server.vocab_size
            if not p or any(not 0 <= t < vocab for t in p):
                raise ApiError(400, f"prompt: token ids must be a non-empty list of ids in [0, {vocab})", "prompt")
            out.append({"prompt_token_ids": list(p), "prompt": server.decode(p)})
    return out


class _AbortingStream(StreamingResponse):
    """An SSE response that aborts its requests when it ends for any reason: a client that disconnects before
    the first chunk cancels the response before its generator starts, so the generator's own cleanup would
    never run (aborting a finished request is a no-op)."""

    def __init__(self, content, request_ids: list[str], loop):
        super().__init__(content, media_type="text/event-stream")
        self._request_ids, self._loop = request_ids, loop

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for rid in self._request_ids:
                self._loop.abort(rid)


@dataclass
class _CompletionRun:
    """A /v1/completions request on its way through the engine: its prompts, streams and output options."""

    body: CompletionRequest
    lora: object
    rid: str
    prompts: list[dict]
    streams: list
    queue: asyncio.Queue
    drop: bool
    """max_tokens 0 (echo): one token is sampled for the prompt's logprobs and not returned."""
    want_ids: bool
    """Choices carry prompt_token_ids and token_ids (asked, or a model without a tokenizer)."""

    @property
    def n_prompt(self) -> int:
        return sum(len(p["prompt_token_ids"]) for p in self.prompts)


class GenerationRoutes:
    """The two generation routes; ``server``: the app's shared state (app._Server)."""

    def __init__(self, server):
        self.server = server

    def register(self, app: FastAPI) -> None:
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)

    def base(self, kind: str, rid: str, lora) -> dict:
        """A response's (or chunk's) common fields; ``model``: the adapter's name under ``lora`` (a LoRARequest),
        else the base model's."""
        model = lora.lora_name if lora is not None else self.server.model_name
        return {"id": rid, "object": kind, "created": int(time.time()), "model": model}

    @staticmethod
    async def sse(events, final_usage):
        """Frame an async iterator of chunk dicts as SSE, then the usage chunk (when asked) and [DONE]; an error
        becomes an error event before [DONE] (the status line is sent already)."""
        try:
            async with contextlib.aclosing(events) as it:
                async for chunk in it:
                    yield _sse(chunk)
            if final_usage is not None:
                yield _sse(final_usage())
        except ApiError as e:
            yield _sse(e.body())
        except Exception:
            log.exception("stream failed")
            yield _sse(ApiError(500, "internal server error").body())
        yield _sse("[DONE]")

    def stream_response(self, events, final_usage, streams) -> StreamingResponse:
        return _AbortingStream(self.sse(events, final_usage), [s.request_id for s in streams], self.server.loop)

    def check_fields(self, body) -> None:
        """400 for an unknown field, a field this server does not implement, or stop_token_ids outside the
        vocabulary."""
        server = self.server
        server.check_unknown(body)
        refused = body.unsupported()
        if refused is not None:
            raise ApiError(400, refused[1], refused[0])
        vocab = server.vocab_size
        if body.stop_token_ids and any(not 0 <= t < vocab for t in body.stop_token_ids):
            raise ApiError(400, f"stop_token_ids: ids must be in [0, {vocab})", "stop_token_ids")

    # ------------------------------------------------------------------------------------------ completions

    async def completions(self, body: CompletionRequest, raw: Request):
        run = await self._start_completion(body)
        if body.stream:
            generated = [0]
            final = (lambda: {**self.base("text_completion", run.rid, run.lora), "choices": [], "usage": usage(
                run.n_prompt, generated[0])}) if body.include_usage else None
            return self.stream_response(self._completion_events(run, generated), final, run.streams)
        return await self._whole_completion(run, raw)

    async def _start_completion(self, body: CompletionRequest) -> _CompletionRun:
        """Check the request, build its engine prompts and SamplingParams, and add them to the engine loop."""
        server = self.server
        lora = server.check_model(body.model)
        self.check_fields(body)
        await body.check_structured_outputs()
        if body.stop and server.tokenizer is None:
            raise ApiError(400, "stop: stop strings need a tokenizer, and this model has none (use stop_token_ids)",
                           "stop")
        if body.max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens: must be >= 1 (0 only with echo, for the prompt's logprobs)",
                           "max_tokens")
        prompts = await _completion_prompts(server, body.prompt)
        echo_lp = body.echo and body.logprobs is not None
        params = []
        for p in prompts:
            mt = check_context(len(p["prompt_token_ids"]), body.max_tokens, server.max_model_len, "prompt")
            params.append(body._params(max(mt, 1), body.logprobs, body.logprobs if echo_lp else None))
        queue: asyncio.Queue = asyncio.Queue()
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = [server.loop.add(p, sp, queue, "cmpl", lora, rid if len(prompts) == 1 else f"{rid}-{k}")
                   for k, (p, sp) in enumerate(zip(prompts, params))]
        return _CompletionRun(body, lora, rid, prompts, streams, queue, drop=body.max_tokens == 0,
                              want_ids=body.return_token_ids or server.tokenizer is None)

    def _legacy(self, body: CompletionRequest) -> LegacyLogprobs | None:
        return LegacyLogprobs(body.logprobs, self.server.decode_token) if body.logprobs is not None else None

    async def _completion_events(self, run: _CompletionRun, generated: list[int]):
        """The chunk dicts of a streamed completion (``generated[0]`` counts the tokens sent)."""
        body, n, prompts = run.body, run.body.n, run.prompts
        lps = [self._legacy(body) for _ in range(len(prompts) * n)]
        started, ids_started = set(), set()
        async with contextlib.aclosing(self.server.updates(run.queue, run.streams)) as it:
            async for k, upd in it:
                for d in upd.deltas:
                    idx = k * n + d.index
                    text, tids = ("", []) if run.drop else (d.text, d.token_ids)
                    if body.echo and idx not in started:
                        text = prompts[k]["prompt"] + text
                        if lps[idx] is not None:  # the prompt's logprobs first (the first one null)
                            p_ids = prompts[k]["prompt_token_ids"]
                            for t, dd in zip(p_ids, upd.prompt_logprobs or [None] * len(p_ids)):
                                lps[idx].add(t, dd)
                    started.add(idx)
                    generated[0] += len(tids)
                    lp = None
                    if lps[idx] is not None:
                        for t, dd in zip(tids, d.logprobs or []):
                            lps[idx].add(t, dd)
                        lp = lps[idx].take()
                    if text or d.finish_reason is not None or ((lp is not None or run.want_ids) and tids):
                        choice = {"index": idx, "text": text, "logprobs": lp,
                                  "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}
                        if run.want_ids:
                            if idx not in ids_started:
                                choice["prompt_token_ids"] = prompts[k]["prompt_token_ids"]
                                ids_started.add(idx)
                            choice["token_ids"] = list(tids)
                        yield {**self.base("text_completion", run.rid, run.lora), "choices": [choice],
                               "usage": None}

    async def _whole_completion(self, run: _CompletionRun, raw: Request) -> dict:
        body, n = run.body, run.body.n
        choices = [Choice(i) for i in range(len(run.prompts) * n)]
        prompt_lps: dict[int, list] = {}
        async with contextlib.aclosing(self.server.updates(run.queue, run.streams, raw)) as it:
            async for k, upd in it:
                for d in upd.deltas:
                    choices[k * n + d.index].add(d)
                if upd.prompt_logprobs is not None:
                    prompt_lps[k] = upd.prompt_logprobs
        out, generated = [], 0
        for idx, c in enumerate(choices):
            k = idx // n
            p = run.prompts[k]
            tids, text, glps = (([], "", []) if run.drop else (c.token_ids, c.text, c.logprobs))
            generated += len(tids)
            lp = self._legacy(body)
            if body.echo:
                if lp is not None:
                    pl = prompt_lps.get(k) or [None] * len(p["prompt_token_ids"])
                    for t, dd in zip(p["prompt_token_ids"], pl):
                        lp.add(t, dd)
                text = p["prompt"] + text
            if lp is not None:
                for t, dd in zip(tids, glps):
                    lp.add(t, dd)
            out.append({"index": idx, "text": text, "logprobs": lp.body() if lp is not None else None,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
            if run.want_ids:
                out[-1].update(prompt_token_ids=p["prompt_token_ids"], token_ids=list(tids))
        return {**self.base("text_completion", run.rid, run.lora), "choices": out,
                "usage": usage(run.n_prompt, generated)}

    # ------------------------------------------------------------------------------------- chat completions

    async def chat_completions(self, body: ChatCompletionRequest, raw: Request):
        server = self.server
        lora = server.check_model(body.model)
        self.check_fields(body)
        await body.check_structured_outputs()
        plan = plan_tools(body, server.model)
        text = await server.chat_prompt(body.messages, tools=plan.tools)
        ids = await server.encode(text)
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        mt = check_context(len(ids), asked, server.max_model_len, "messages")
        k_top = body.top_logprobs or 0
        if body.top_logprobs and not body.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs=true", "top_logprobs")
        params = body._params(mt, k_top if body.logprobs else None)
        await constrain(plan, params)
        outputs = [ChoiceOutput(plan, server.model.reasoning_parser is not None) for _ in range(body.n)] \
            if plan.tools or server.model.reasoning_parser else None
        queue: asyncio.Queue = asyncio.Queue()
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = [server.loop.add({"prompt_token_ids": ids, "prompt": text}, params, queue, "chat", lora, rid)]
        if body.stream:
            generated = [0]
            final = (lambda: {**self.base("chat.completion.chunk", rid, lora), "choices": [],
                              "usage": usage(len(ids), generated[0])}) if body.include_usage else None
            events = self._chat_events(body, lora, rid, ids, outputs, queue, streams, generated)
            return self.stream_response(events, final, streams)
        return await self._whole_chat(body, lora, rid, ids, outputs, queue, streams, raw)

    async def _chat_events(self, body, lora, rid: str, ids: list[int], outputs, queue, streams, generated: list[int]):
        """The chunk dicts of a streamed chat completion: the role chunks, then the deltas (``generated[0]``
        counts the tokens)."""
        k_top = body.top_logprobs or 0
        for i in range(body.n):
            chunk = {**self.base("chat.completion.chunk", rid, lora), "choices": [{
                "index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}]}
            if body.return_token_ids and i == 0:
                chunk["prompt_token_ids"] = ids
            yield chunk
        async with contextlib.aclosing(self.server.updates(queue, streams)) as it:
            async for _, upd in it:
                for d in upd.deltas:
                    generated[0] += len(d.token_ids)
                    if not (d.text or d.finish_reason is not None
                            or ((body.logprobs or body.return_token_ids) and d.token_ids)):
                        continue  # a token held back (part of a character, or a stop string)
                    lp = chat_logprobs(d.token_ids, d.logprobs, k_top) if body.logprobs else None
                    tids = list(d.token_ids) if body.return_token_ids else None
                    for choice in stream_choices(outputs, d, lp, tids):
                        yield {**self.base("chat.completion.chunk", rid, lora), "choices": [choice]}

    async def _whole_chat(self, body, lora, rid: str, ids: list[int], outputs, queue, streams, raw: Request) -> dict:
        k_top = body.top_logprobs or 0
        choices = [Choice(i) for i in range(body.n)]
        async with contextlib.aclosing(self.server.updates(queue, streams, raw)) as it:
            async for _, upd in it:
                for d in upd.deltas:
                    choices[d.index].add(d)
        out = [{"index": c.index, **whole_choice(outputs[c.index] if outputs else None, c),
                "logprobs": chat_logprobs(c.token_ids, c.logprobs, k_top) if body.logprobs else None,
                "stop_reason": c.stop_reason} for c in choices]
        extra = {}
        if body.return_token_ids:
            extra["prompt_token_ids"] = ids
            for o, c in zip(out, choices):
                o["token_ids"] = list(c.token_ids)
        return {**self.base("chat.completion", rid, lora), "choices": out, **extra,
                "usage": usage(len(ids), sum(len(c.token_ids) for c in choices))}


def add_generation_routes(app: FastAPI, server) -> None:
    """Register the two generation routes on ``app``; ``server``: the app's shared state (app._Server)."""
    GenerationRoutes(server).register(app)
