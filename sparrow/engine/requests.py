"""Turning a user's request into sequences: prompt parsing and validation, the request's own SamplingParams copy,
and the stop checks applied to every appended token."""
from __future__ import annotations

import dataclasses
import operator

import torch

from sparrow.engine.detokenizer import find_stop
from sparrow.engine.sequence import Sequence
from sparrow.errors import InvalidRequestError
from sparrow.sampling_params import SamplingParams
from sparrow.tokenizer import encode_prompt


def own_params(params: SamplingParams | None) -> SamplingParams:
    """A validated copy of ``params`` (SamplingParams() for None) that shares no list with the caller's object
    (``dataclasses.replace`` runs ``__post_init__`` again). Raises InvalidRequestError for another type or
    values changed after construction into invalid ones."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")

    def own(v):
        return list(v) if isinstance(v, (list, tuple)) else v

    return dataclasses.replace(params, stop=own(params.stop), stop_token_ids=own(params.stop_token_ids))


def parse_prompt(prompt, tokenizer, hidden_size: int, vocab_size: int, max_model_len: int
                 ) -> tuple[str | None, list[int], torch.Tensor | None, list[int]]:
    """(text, token ids, soft_embeds [n, H] or None, soft positions) of a text prompt, a dict {'prompt': text}
    (vLLM's TextPrompt) or a dict {'prompt_token_ids': [...], optional 'prompt', 'soft_embeds', 'soft_positions'}. Raises InvalidRequestError
    for an empty prompt, one of max_model_len tokens or more, ids outside the vocabulary, non-integer ids, bad
    soft embeddings, or a text prompt without a tokenizer."""
    soft, pos = None, []
    if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str):
        prompt = prompt["prompt"]  # vLLM's TextPrompt {'prompt': str}
    if isinstance(prompt, dict):
        if "prompt_token_ids" not in prompt:
            raise InvalidRequestError("a dict prompt needs 'prompt_token_ids' (vLLM's TokensPrompt) or a string "
                                      "'prompt' (TextPrompt)")
        try:  # operator.index takes Python and numpy integers, refuses floats, strings and None
            ids = [operator.index(t) for t in prompt["prompt_token_ids"]]
        except TypeError:
            raise InvalidRequestError("prompt_token_ids must be a list of integer token ids") from None
        soft, pos = prompt.get("soft_embeds"), list(prompt.get("soft_positions") or [])
        if soft is not None:
            if soft.dim() != 2 or soft.shape[1] != hidden_size:
                raise InvalidRequestError(f"soft_embeds must be [n, {hidden_size}], got {tuple(soft.shape)}")
            if len(pos) != soft.shape[0] or len(set(pos)) != len(pos) or any(not 0 <= p < len(ids) for p in pos):
                raise InvalidRequestError(
                    f"soft_positions must be {soft.shape[0]} distinct prompt positions in [0, {len(ids)})")
        text = prompt.get("prompt")
    else:
        if tokenizer is None:
            raise InvalidRequestError("text prompts need a tokenizer; pass {'prompt_token_ids': [...]}")
        text, ids = prompt, encode_prompt(tokenizer, prompt)
    if not ids:
        raise InvalidRequestError("empty prompt: give at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise InvalidRequestError(f"prompt has {len(ids)} tokens, longer than max_model_len={max_model_len} "
                                  f"allows (at most {max_model_len - 1})")
    return text, ids, soft, pos


def check_stop(seq: Sequence, tid: int, new_text: str, max_model_len: int) -> None:
    """Set ``seq.finish_reason`` (and ``stop_reason``) after token ``tid`` was appended with ``new_text``: EOS
    (unless ignore_eos), a stop token id or a stop string (once min_tokens are out; a stop string is cut from
    the text unless include_stop_str_in_output), then max_tokens or max_model_len ('length')."""
    p = seq.params
    n_out = len(seq.output_token_ids)
    if tid in seq.eos_token_ids and not p.ignore_eos and n_out > p.min_tokens - 1:
        seq.finish_reason = "stop"
    elif p.stop_token_ids and tid in p.stop_token_ids and n_out >= p.min_tokens:
        seq.finish_reason, seq.stop_reason = "stop", tid
    elif p.stop_strings and new_text and n_out >= p.min_tokens:
        hit = find_stop(seq.text, len(new_text), p.stop_strings, p.include_stop_str_in_output)
        if hit is not None:
            seq.text = seq.text[: hit[0]]
            seq.finish_reason, seq.stop_reason = "stop", hit[1]
    if seq.finish_reason is None and seq.at_length_limit(max_model_len):
        seq.finish_reason = "length"


def held_back(seq: Sequence) -> int:
    """Characters at the end of ``seq.text`` not reported yet: while a stop string (not kept in the output) may
    still complete, the last len(longest stop string) - 1 characters, so reported text never needs taking back
    (vLLM's output processor does the same)."""
    p = seq.params
    if seq.finish_reason is not None or p.include_stop_str_in_output or not p.stop_strings:
        return 0
    return max(len(s) for s in p.stop_strings) - 1
