"""What the HTTP front end checks before a request reaches a handler: the Host header, the API key, the body's
size and its Content-Type (one ASGI middleware, ``RequestGuard``), and the options that set them
(``HttpOptions``, from ``sparrow serve``'s flags).

Order: Host (400 for a host not in ``allowed_hosts``: a page served by another site cannot reach a server on
localhost through DNS rebinding), then the API key (401), then Content-Type (415 for a POST whose body is not
``application/json``), then the size (413 when ``Content-Length`` says more than the limit, or when a chunked
body grows past it while it is read: the handler never sees it).
"""
from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi import HTTPException
from fastapi.responses import JSONResponse

from sparrow.server.serving import ApiError

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 2**20
"""4 MiB: a prompt of a million or so characters, beyond any context sparrow serves today."""

OPEN_PATHS = frozenset({"/health", "/version"})
"""Routes answered without the API key (a load balancer's probes)."""


@dataclass(frozen=True)
class HttpOptions:
    """The front end's request checks (``sparrow serve`` flags of the same names)."""

    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    """Largest request body in bytes; a larger one is answered 413 before it is parsed."""
    allowed_hosts: tuple[str, ...] | None = None
    """Host header values accepted (a host name, 'name:port', or '*' for any); None: any host."""
    metrics_need_api_key: bool = False
    """With an API key set: /metrics needs it too (default: /metrics is open, as Prometheus scrapes it)."""
    reject_unknown_fields: bool = True
    """A request field the server does not know is a 400 naming it; False: logged and ignored (vLLM's way)."""


def host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    """Whether a Host header value (``name`` or ``name:port``, any case) is one of ``allowed``: an entry matches
    the name alone or with its port; '*' matches any."""
    host = host.strip().lower()
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host  # '[::1]:8000' -> '[::1]'
    for a in allowed:
        a = a.strip().lower()
        if a == "*" or a == host or a == name:
            return True
    return False


class _TooLarge(HTTPException):
    """Raised from ``receive`` when a body grows past the limit; FastAPI passes an HTTPException raised while it
    reads the body on to the app's handler, which answers it (413)."""


class RequestGuard:
    """ASGI middleware applying ``HttpOptions`` and the API key to every HTTP request (see the module's
    docstring). A plain ASGI callable, not ``@app.middleware("http")``: that one relays every chunk of a
    streamed response through an extra task and memory stream."""

    def __init__(self, app, api_key: str | None, options: HttpOptions):
        self.app, self.api_key, self.options = app, api_key, options

    def _refusal(self, scope) -> ApiError | None:
        """The error a request's head earns (None: it may go on)."""
        headers = dict(scope["headers"])
        opts = self.options
        if opts.allowed_hosts is not None:
            host = headers.get(b"host", b"").decode("latin-1")
            if not host_allowed(host, opts.allowed_hosts):
                return ApiError(400, f"the Host header {host!r} is not one this server answers "
                                     "(sparrow serve --allowed-hosts)", None, "invalid_host")
        path = scope["path"]
        needs_key = path not in OPEN_PATHS and (path != "/metrics" or opts.metrics_need_api_key)
        if self.api_key is not None and needs_key:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
                return ApiError(401, "missing or wrong API key (send Authorization: Bearer KEY)", None,
                                "invalid_api_key")
        if scope["method"] in ("POST", "PUT", "PATCH"):
            ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if ctype != b"application/json":
                shown = ctype.decode("latin-1") or "none"
                return ApiError(415, f"Content-Type must be application/json (got {shown})", None,
                                "unsupported_media_type")
            length = headers.get(b"content-length")
            if length is not None and (not length.isdigit() or int(length) > opts.max_request_body_bytes):
                return self._too_large()
        return None

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the request body is larger than {self.options.max_request_body_bytes} bytes "
                             "(sparrow serve --max-request-body-bytes)", None, "request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        err = self._refusal(scope)
        if err is not None:
            await JSONResponse(err.body(), status_code=err.status)(scope, receive, send)
            return
        limit, seen, started = self.options.max_request_body_bytes, [0], [False]

        async def counted_receive():
            msg = await receive()
            if msg["type"] == "http.request":
                seen[0] += len(msg.get("body", b""))
                if seen[0] > limit:
                    raise _TooLarge(413, self._too_large().message)
            return msg

        async def tracked_send(msg):
            if msg["type"] == "http.response.start":
                started[0] = True
            await send(msg)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _TooLarge:
            if started[0]:
                raise
            err = self._too_large()
            await JSONResponse(err.body(), status_code=413)(scope, receive, send)


_KEEPS_TEXT = {"pre_tokenizer": {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split"}, "normalizer": {"Prepend", "NFD"}}


def _keeps_every_character(part: dict | None, kind: str) -> bool:
    """Whether a tokenizers normalizer / pre-tokenizer (its JSON) never removes a character: none, Prepend, NFD,
    a Replace whose content is no shorter than its pattern, a Split that does not remove its matches, ByteLevel,
    Metaspace, and Sequences of these."""
    if part is None:
        return True
    t = part.get("type")
    if t == "Sequence":
        return all(_keeps_every_character(p, kind) for p in part.get(f"{kind}s", part.get("normalizers", [])))
    if t == "Replace":
        pattern = part.get("pattern", {}).get("String")
        return pattern is not None and len(part.get("content", "")) >= len(pattern)
    if t == "Split" and str(part.get("behavior", "")).lower() == "removed":
        return False
    return t in _KEEPS_TEXT[kind]


def prompt_char_limit(tokenizer, max_model_len: int) -> int | None:
    """The most characters a prompt of fewer than ``max_model_len`` tokens can have, or None where no cheap sound
    bound exists. Sound for a fast tokenizer whose normalizer and pre-tokenizer keep every character and whose
    BPE model spells unknown characters in byte tokens (byte-level BPE, SentencePiece with byte fallback: GPT-2,
    Llama 3, SmolLM2, Gemma): each character of the text is then spelled by at least one character of some
    token's string, so ``chars <= tokens * L`` with ``L`` the longest token string of the vocabulary (special
    tokens included). A longer prompt cannot fit and is refused before it is tokenized."""
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except (ValueError, AttributeError):
        return None
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer")
    byte_level = pre is not None and "ByteLevel" in json.dumps(pre)
    if model.get("type") != "BPE" or not (byte_level or model.get("byte_fallback")):
        return None
    if not (_keeps_every_character(spec.get("normalizer"), "normalizer")
            and _keeps_every_character(pre, "pre_tokenizer")):
        return None
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return max_model_len * longest


def add_http_args(p) -> None:
    """``sparrow serve``'s flags of ``HttpOptions`` (argparse)."""
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES, metavar="BYTES",
                   help=f"largest request body; a larger one is answered 413 before it is parsed (default "
                        f"{DEFAULT_MAX_REQUEST_BODY_BYTES} = 4 MiB)")
    p.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                   help="Host header values answered ('name' or 'name:port'; others get a 400), e.g. localhost "
                        "127.0.0.1 (default: any host)")
    p.add_argument("--metrics-need-api-key", action="store_true",
                   help="with --api-key: /metrics needs the key too (default: /metrics, /health and /version are "
                        "open)")
    p.add_argument("--allow-unknown-fields", action="store_true",
                   help="log and ignore request fields the server does not know (default: 400 naming the field)")


def http_options(args) -> HttpOptions:
    """HttpOptions from ``add_http_args``'s flags. Raises InvalidRequestError for a body limit below 1."""
    from sparrow.errors import InvalidRequestError

    if args.max_request_body_bytes < 1:
        raise InvalidRequestError(f"--max-request-body-bytes={args.max_request_body_bytes} must be >= 1")
    return HttpOptions(max_request_body_bytes=args.max_request_body_bytes,
                       allowed_hosts=tuple(args.allowed_hosts) if args.allowed_hosts else None,
                       metrics_need_api_key=args.metrics_need_api_key,
                       reject_unknown_fields=not args.allow_unknown_fields)
