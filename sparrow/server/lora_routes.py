"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes, bodies and answers), registered when the
server runs with runtime LoRA updating on (``sparrow serve --enable-lora --enable-runtime-lora``; vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``); the engine's side is ``sparrow.server.lora_updates``.

- load ``{"lora_name": NAME, "lora_path": FOLDER}``: the adapter is read and checked on a thread of the engine
  process, then served as the model NAME (listed in /v1/models with ``parent`` the base model's id). Answers 200
  with the text ``Success: LoRA adapter 'NAME' added successfully.``; 400 for an empty field, a name in use (an
  adapter's or the base model's) or an adapter sparrow cannot use (the message names the problem: a rank over
  --max-lora-rank, a target module the model lacks, ...); 404 when the path holds no adapter (as vLLM's "No adapter
  found"). With ``"load_inplace": true`` (vLLM's) a loaded NAME is replaced: new requests run the new adapter (a new
  lora_int_id, so no cached prefix of the old one is reused), the old one is unloaded once the requests running it
  finish.
- unload ``{"lora_name": NAME}`` (vLLM's optional ``lora_int_id`` must match when given): NAME is no longer served
  from now on (requests naming it get 404 ``model_not_found``); the answer waits until the requests that run it
  have finished (at most ``SPARROW_LORA_UNLOAD_TIMEOUT_S`` seconds, default 60: those still running then end with
  an error naming the unload), its slot is then free. 200 ``Success: LoRA adapter 'NAME' removed successfully.``;
  404 for a name that is not a loaded adapter.
"""
from __future__ import annotations

import asyncio
import itertools
import logging

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from sparrow.lora.request import LoRARequest
from sparrow.server.serving import ApiError

log = logging.getLogger(__name__)


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body of /v1/load_lora_adapter (strict types: a JSON string for a name, true / false for a flag;
    another field is unknown: ``_Server.check_unknown``)."""

    model_config = ConfigDict(strict=True, extra="allow")

    lora_name: str
    lora_path: str
    load_inplace: bool = False
    """Replace the adapter loaded under lora_name (vLLM's): requests that run the old one finish with it."""


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's body of /v1/unload_lora_adapter (strict types and unknown fields as the load's)."""

    model_config = ConfigDict(strict=True, extra="allow")

    lora_name: str
    lora_int_id: int | None = None


def add_lora_routes(app: FastAPI, server) -> None:
    """Register the two routes on ``app``; ``server``: the app's shared state (app._Server), whose
    ``model.loras`` (name -> LoRARequest) they update."""
    loras = server.model.loras
    pending: set[str] = set()
    ids = itertools.count(max((r.lora_int_id for r in loras.values()), default=0) + 1)
    retiring: set[asyncio.Task] = set()

    async def load(request: LoRARequest) -> tuple[int, str]:
        status, message = await server.loop.load_lora(request)
        if status == 200:  # here, not in the handler: a client gone meanwhile still leaves the adapter served
            old = loras.get(request.lora_name)
            loras[request.lora_name] = request
            log.info("LoRA adapter %r loaded from %s", request.lora_name, request.lora_path)
            if old is not None:  # load_inplace: the old id goes once its requests are done
                task = asyncio.ensure_future(server.loop.unload_lora(old.lora_int_id, old.lora_name))
                retiring.add(task)
                task.add_done_callback(retiring.discard)
        return status, message

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        server.check_unknown(body)
        name, path = body.lora_name, body.lora_path
        if not name or not path:
            raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.", "lora_name" if not name
                           else "lora_path")
        if name in server.model.names:
            raise ApiError(400, f"The name {name!r} is the base model's served name: give the adapter another "
                                "lora_name.", "lora_name")
        if (name in loras and not body.load_inplace) or name in pending:
            raise ApiError(400, f"The lora adapter {name!r} has already been loaded.", "lora_name")
        pending.add(name)
        try:
            status, message = await asyncio.shield(load(LoRARequest(name, next(ids), path)))
        finally:
            pending.discard(name)
        if status != 200:
            raise ApiError(status, message, "lora_path")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        server.check_unknown(body)
        name = body.lora_name
        if not name:
            raise ApiError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
        request = loras.get(name)
        if request is None or body.lora_int_id not in (None, request.lora_int_id):
            raise ApiError(404, f"The lora adapter {name!r} cannot be found.", "lora_name")
        del loras[name]  # no new request names it from now on
        status, message = await asyncio.shield(server.loop.unload_lora(request.lora_int_id, name))
        if status != 200:
            raise ApiError(status, message)
        return PlainTextResponse(" ".join(filter(None, [f"Success: LoRA adapter '{name}' removed successfully.",
                                                        message])))
