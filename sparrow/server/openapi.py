"""The server's OpenAPI document, made to say what the server does (``install_openapi``): FastAPI's generated
document declares a 422 validation body the server never sends, JSON for every answer, and nothing of
streaming. Here each operation declares its error answers (400, 401, 404, 413, 415: OpenAI's
``{"error": {...}}``, schema ``ErrorResponse``), the generation routes both their JSON body and their
``text/event-stream`` (``stream: true``), ``/health`` an empty 200, ``/metrics`` Prometheus text, and the JSON
answers their shapes (``RESPONSES``), so a client generated from it, and schemathesis's conformance checks, see
the server as it is."""
from __future__ import annotations

_STR, _INT, _NUM = {"type": "string"}, {"type": "integer"}, {"type": "number"}
_NULL_STR = {"type": ["string", "null"]}


def _obj(required: dict, optional: dict | None = None) -> dict:
    return {"type": "object", "required": list(required), "properties": {**required, **(optional or {})}}


ERROR = _obj({"error": _obj({"message": _STR, "type": _STR, "param": _NULL_STR, "code": _NULL_STR})})
"""OpenAI's error body."""

_USAGE = _obj({"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT})
_HEAD = {"id": _STR, "object": _STR, "created": _INT, "model": _STR}
_FINISH = {"finish_reason": {"type": ["string", "null"]}}
_COMPLETION = _obj({**_HEAD, "choices": {"type": "array", "items": _obj(
    {"index": _INT, "text": _STR, **_FINISH}, {"logprobs": {"type": ["object", "null"]}})}, "usage": _USAGE})
_CHAT = _obj({**_HEAD, "choices": {"type": "array", "items": _obj(
    {"index": _INT, "message": _obj({"role": _STR}, {"content": _NULL_STR}), **_FINISH},
    {"logprobs": {"type": ["object", "null"]}})}, "usage": _USAGE})
_MODEL = _obj({"id": _STR, "object": _STR, "created": _INT, "owned_by": _STR},
              {"root": _NULL_STR, "parent": _NULL_STR, "max_model_len": _INT})

RESPONSES: dict[str, dict] = {
    "/version": _obj({"version": _STR}),
    "/v1/models": _obj({"object": _STR, "data": {"type": "array", "items": _MODEL}}),
    "/tokenize": _obj({"count": _INT, "max_model_len": _INT, "tokens": {"type": "array", "items": _INT}}),
    "/detokenize": _obj({"prompt": _STR}),
    "/v1/completions": _COMPLETION,
    "/v1/chat/completions": _CHAT,
}
"""Path -> the JSON schema of its 200 body (the fields every answer has; others may be added)."""

_ERRORS = {"400": "invalid request (a field named in error.param)", "401": "missing or wrong API key",
           "404": "unknown model", "413": "request body too large", "415": "Content-Type is not application/json"}
_SSE = {"text/event-stream": {"schema": {
    **_obj({"data": {"type": "string", "description": "a chunk's JSON (the final event: [DONE])"}}),
    "description": "one server-sent event (data: {chunk JSON} events, then data: [DONE])"}}}
_TEXT = {"/metrics": "text/plain"}


REQUEST_BODIES = ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest")


def fix_openapi(doc: dict, closed_bodies: bool = True) -> dict:
    """``doc`` (FastAPI's generated document) rewritten in place as described in the module's docstring.
    ``closed_bodies``: the request bodies declare ``additionalProperties: false`` (the server answers an unknown
    field with a 400; the fields it accepts without implementing them are not declared)."""
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in REQUEST_BODIES if closed_bodies else ():
        if name in schemas:
            schemas[name]["additionalProperties"] = False
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    schemas["ErrorResponse"] = ERROR
    error_ref = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for path, ops in doc.get("paths", {}).items():
        for method, op in ops.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            ok = responses.setdefault("200", {"description": "OK"})
            if path == "/health":
                ok.pop("content", None)
                ok["description"] = "the engine is up (an empty body)"
                continue
            if path in _TEXT:
                ok["content"] = {_TEXT[path]: {"schema": {"type": "string"}}}
            elif path in RESPONSES:
                ok["content"] = {"application/json": {"schema": RESPONSES[path]}}
            if path in ("/v1/completions", "/v1/chat/completions"):
                ok["content"].update(_SSE)
                ok["description"] = "the answer; with stream: true, server-sent events"
            codes = ["400", "401", "404", "413", "415"] if "requestBody" in op else ["400", "401"]
            for code in codes:
                responses.setdefault(code, {"description": _ERRORS[code], "content": error_ref})
    return doc


def install_openapi(app, closed_bodies: bool = True) -> None:
    """Serve ``fix_openapi`` of FastAPI's document as the app's /openapi.json (built once, on first use)."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = fix_openapi(get_openapi(title=app.title, version=app.version, routes=app.routes),
                                             closed_bodies)
        return app.openapi_schema

    app.openapi = openapi
