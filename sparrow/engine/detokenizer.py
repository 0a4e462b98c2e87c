"""Incremental detokenization (UTF-8 safe) and stop-string search.

Technique: vLLM's ``detokenize_incrementally`` (prefix offset / read offset). Each step decodes a short
window of recent tokens twice with the tokenizer's own decoder: ``ids[prefix:read]`` (text already
emitted) and ``ids[prefix:]``; the difference is the new text. While the window's text ends in U+FFFD
(a multi-byte character split across byte tokens) nothing is emitted and the offsets stay, so a
partial character is never returned. Decoding a window rather than single tokens keeps what depends on
neighbours (SentencePiece spaces, byte runs) exactly as ``tokenizer.decode`` renders it.

Byte-fallback tokenizers (SentencePiece ``<0xNN>`` tokens, e.g. Gemma, Llama) decode a run of byte
tokens all or nothing: one invalid byte turns the whole run into U+FFFD. So text is also held back while
the last token is a byte token, and released when the run ends: a character spelled in bytes arrives one
token later, and the streamed text always equals ``decode`` of all tokens. A skipped special token (e.g.
``<bos>`` with skip_special_tokens) does not end a run: it is dropped before the byte decoder, so the bytes on
both sides of it form one run (transformers' ``decode`` gives U+FFFD for every byte of a run that is not valid
UTF-8 as a whole, so a character complete inside a run cannot be released before the run ends). The prompt
tokens decoded for context stop before any byte run or incomplete character at the prompt's end, so output bytes
never complete a character the prompt began (``decode`` of the output alone renders them as U+FFFD).
"""
from __future__ import annotations

import weakref

PROMPT_CONTEXT = 5
"""Prompt tokens decoded before the first output token, so its leading space renders as in context."""

_REPLACEMENT = "\ufffd"
_BYTE_TOKENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_RENDERS_EMPTY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def byte_token_ids(tokenizer) -> frozenset[int]:
    """Ids of the byte-fallback tokens ``<0x00>`` .. ``<0xFF>`` (empty for byte-level BPE), cached."""
    ids = _BYTE_TOKENS.get(tokenizer)
    if ids is None:
        found = set()
        unk = tokenizer.unk_token_id
        for b in range(256):
            t = f"<0x{b:02X}>"
            i = tokenizer.convert_tokens_to_ids(t)
            if isinstance(i, int) and i != unk and tokenizer.convert_ids_to_tokens(i) == t:
                found.add(i)
        ids = frozenset(found)
        _BYTE_TOKENS[tokenizer] = ids
    return ids


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text, one token at a time.

    tokenizer: a transformers ``PreTrainedTokenizer`` / ``PreTrainedTokenizerFast``.
    After ``flush()``, ``text == tokenizer.decode(output_ids, skip_special_tokens=...,
    clean_up_tokenization_spaces=False)`` for tokenizers whose decoder does not strip the first token's
    leading space (byte-level BPE, Gemma's SentencePiece). With a stripping decoder (Llama 2's) the first
    output token keeps its space, as it reads after the prompt.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._byte_ids = byte_token_ids(tokenizer)
        self._renders_empty: dict[int, bool] = _RENDERS_EMPTY.setdefault(tokenizer, {}).setdefault(
            skip_special_tokens, {})
        context = self._whole_characters(list(prompt_token_ids[-PROMPT_CONTEXT:]) if PROMPT_CONTEXT else [])
        self._ids: list[int] = context           # context + output ids
        self._prefix = 0                          # window start: first token of the already-emitted text
        self._read = len(context)                 # first token whose text is not yet emitted
        self._prefix_text: str | None = None      # decode(ids[prefix:read]), cached
        self._text = ""
        self._in_byte_run = False
        self.output_token_ids: list[int] = []
        """Every id passed to ``add``."""

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        return self._text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip, clean_up_tokenization_spaces=False
        )

    def _emit(self, allow_partial: bool) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(self._prefix_text) or (
            not allow_partial and new_text.endswith(_REPLACEMENT)
        ):
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = None
        self._text += delta
        return delta

    def add(self, token_id: int) -> str:
        """Appends one output token; returns the text it completes ("" while a character is incomplete
        or the token renders as nothing, e.g. a skipped special token)."""
        self._ids.append(token_id)
        self.output_token_ids.append(token_id)
        if token_id in self._byte_ids:   # a byte run renders only once it ends
            self._in_byte_run = True
            return ""
        if self._in_byte_run and self._skipped(token_id):
            return ""                    # decode drops it first: the run goes on through it
        self._in_byte_run = False
        return self._emit(allow_partial=False)

    def _whole_characters(self, context: list[int]) -> list[int]:
        """``context`` without its tail of byte tokens, skipped special tokens and tokens whose text ends in an
        incomplete character: the output's first bytes must not join a character begun in the prompt, which
        ``decode(output_ids)`` renders as U+FFFD."""
        while context and (context[-1] in self._byte_ids or self._skipped(context[-1])
                           or self._decode(context).endswith(_REPLACEMENT)):
            context.pop()
        return context

    def _skipped(self, token_id: int) -> bool:
        """Whether ``token_id`` renders as nothing on its own (a skipped special token), cached per tokenizer and
        skip_special_tokens."""
        empty = self._renders_empty.get(token_id)
        if empty is None:
            empty = self._renders_empty[token_id] = self._decode([token_id]) == ""
        return empty

    def flush(self) -> str:
        """At the end of the sequence: returns what is still held back, an incomplete character
        included (rendered as U+FFFD, as ``decode`` renders it)."""
        return self._emit(allow_partial=True)


def find_stop(
    text: str, new_text_len: int, stop: list[str], include_stop_str_in_output: bool
) -> tuple[int, str] | None:
    """Looks for a stop string that ends inside the last ``new_text_len`` characters of ``text``.

    Earlier text was checked on earlier steps, so the search starts ``len(s) - 1`` characters before the
    new text (a stop string may straddle the boundary). When several match, the one that ends first
    wins (it would have stopped generation first), the longer one on a tie.
    Returns (length to truncate the text to, matched stop string) or None. The length is the match's
    start, or its end with ``include_stop_str_in_output`` (vLLM ``SamplingParams`` semantics).
    """
    n = len(text)
    best: tuple[int, int, str] | None = None
    for s in stop:
        i = text.find(s, max(0, n - new_text_len - len(s) + 1))
        if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
            best = (i + len(s), i, s)
    if best is None:
        return None
    end, start, s = best
    return (end if include_stop_str_in_output else start), s
