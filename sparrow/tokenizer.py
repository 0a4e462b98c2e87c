"""Tokenization through transformers' AutoTokenizer (from an HF folder, or built from a GGUF file's
vocabulary), chat templates, and the BOS rule: a prompt never gets a second BOS."""
from __future__ import annotations

import logging
from pathlib import Path

from sparrow.cache import cache_dir, file_key
from sparrow.errors import InvalidRequestError, ModelLoadError

log = logging.getLogger(__name__)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model",
                   "tiktoken.model")
"""Files of which an HF folder needs at least one for AutoTokenizer to build a tokenizer."""


def load_tokenizer(path: str | Path):
    """AutoTokenizer for a model path. For a GGUF file transformers converts the embedded vocabulary
    (slow for large vocabularies), so the converted tokenizer is saved under ~/.cache/sparrow/tokenizers
    keyed by the file's path, size and mtime, and reloaded from there next time. Raises ModelLoadError for an
    HF folder with none of TOKENIZER_FILES (saying how to run without a tokenizer) or a tokenizer
    transformers cannot load (its message quoted on one line)."""
    from transformers import AutoTokenizer

    path = Path(path)
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"cannot load a tokenizer for {path}: no tokenizer files found "
                             f"({', '.join(TOKENIZER_FILES)}); "
                             "add them, or run without a tokenizer: LLM(..., skip_tokenizer_init=True) with prompts "
                             "as {'prompt_token_ids': [...]}")
    try:
        if path.is_file():
            cached = cache_dir("tokenizers", f"{path.stem}-{file_key(path)}")
            if (cached / "tokenizer_config.json").is_file():
                return AutoTokenizer.from_pretrained(str(cached))
            log.info("building the tokenizer from %s's vocabulary (first use only; cached in %s)", path.name, cached)
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            try:
                tok.save_pretrained(str(cached))
            except OSError as e:  # a read-only cache is not fatal
                log.warning("could not cache the tokenizer at %s: %s", cached, e)
            return tok
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises many types for a broken tokenizer
        msg = " ".join(str(e).split())  # transformers' messages span lines; ours is one
        raise ModelLoadError(f"cannot load a tokenizer for {path}: {type(e).__name__}: {msg}") from None


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Token ids of a text prompt, with BOS added once when the tokenizer adds one, and not added when the
    text already starts with the BOS token (e.g. a rendered chat template). Raises InvalidRequestError on ''."""
    if not isinstance(prompt, str):
        raise InvalidRequestError(f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
    if prompt == "":
        raise InvalidRequestError("empty prompt: give at least one character or token")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # e.g. undecodable command-line bytes arrive as lone surrogates
        raise InvalidRequestError(f"the prompt is not valid UTF-8 text (at character {e.start})") from None
    bos = tokenizer.bos_token
    has_bos = bool(bos) and prompt.startswith(bos)
    ids = tokenizer(prompt, add_special_tokens=not has_bos)["input_ids"]
    if len(ids) >= 2 and tokenizer.bos_token_id is not None and ids[0] == ids[1] == tokenizer.bos_token_id:
        ids = ids[1:]
    return ids


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                        continue_final_message: bool = False, chat_template: str | None = None,
                        chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> str:
    """Render a conversation (a list of {'role': str, 'content': str}; assistant turns may carry ``tool_calls``,
    ``tool`` turns a ``tool_call_id``) with the model's chat template (or ``chat_template``, a Jinja string), ending
    with the assistant turn's opening (``add_generation_prompt``) or, with ``continue_final_message``, inside the
    last message (left open, to be continued); ``chat_template_kwargs`` are passed to the template (e.g.
    ``enable_thinking``). vLLM's arguments; both flags at once is an error. ``tools``: OpenAI's tool list, passed
    as transformers' ``tools=`` (a template that ignores tools renders without them).

    Raises InvalidRequestError when there is no tokenizer or no chat template, for messages that are not
    role-keyed dicts or that the template cannot render, and when the template refuses the conversation (it
    raises jinja2's TemplateError, e.g. Gemma 2's "System role not supported": that message is quoted);
    ModelLoadError when the template does not parse (a TemplateSyntaxError is the model's fault, not the
    request's)."""
    from jinja2.exceptions import TemplateError, TemplateSyntaxError

    if tokenizer is None:
        raise InvalidRequestError("chat needs a tokenizer (this LLM was built without one)")
    if add_generation_prompt and continue_final_message:
        raise InvalidRequestError("add_generation_prompt and continue_final_message cannot both be true (set "
                                  "add_generation_prompt=False to continue the last message)")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise InvalidRequestError("chat_template_kwargs must be a dict")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model has no chat template: give it a plain prompt (LLM.generate, the server's "
                                  "/v1/completions, sparrow generate without --chat)")
    if not isinstance(messages, (list, tuple)) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise InvalidRequestError("messages must be a non-empty list of {'role': str, 'content': ...} dicts")
    try:
        return tokenizer.apply_chat_template(list(messages), tools=tools or None, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message,
                                             chat_template=chat_template, **(chat_template_kwargs or {}))
    except TemplateSyntaxError as e:
        raise ModelLoadError(f"the model's chat template does not parse: {' '.join(str(e).split())}") from None
    except TemplateError as e:
        raise InvalidRequestError(f"the model's chat template refused the conversation: "
                                  f"{' '.join(str(e).split())}") from None
    except (TypeError, KeyError, AttributeError) as e:  # the template met a message shape it cannot render
        raise InvalidRequestError(f"the model's chat template cannot render these messages: "
                                  f"{type(e).__name__}: {' '.join(str(e).split())}") from None
