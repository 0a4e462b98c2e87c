"""Speculative decoding's settings (vLLM's ``speculative_config``); the decoder is ``sparrow.spec_decode``."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from sparrow.config.values import check_int
from sparrow.errors import InvalidRequestError

MAX_SPECULATIVE_TOKENS = 15
"""Most draft tokens per verify step (k + 1 <= 16 rows per sequence: the range of the small-row kernels)."""

SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config``): a proposer drafts up to ``num_speculative_tokens``
    tokens per sequence and step, the target verifies them in one step of k + 1 rows. Built from a dict by
    ``from_dict``; raises InvalidRequestError naming the bad key or value."""

    method: str
    """'ngram' (prompt lookup: the tokens after the latest earlier occurrence of the context's last n tokens) or
    'draft_model' (a smaller model with the target's vocabulary, greedy, with its own KV cache)."""
    num_speculative_tokens: int
    """k: most draft tokens verified per sequence and step (1 .. MAX_SPECULATIVE_TOKENS)."""
    prompt_lookup_max: int = 4
    """ngram: longest suffix n looked up (tried first)."""
    prompt_lookup_min: int = 2
    """ngram: shortest suffix n looked up."""
    model: str | None = None
    """draft_model: path of the draft model (HF folder or .gguf)."""

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise InvalidRequestError(f"speculative_config method={self.method!r} is not supported "
                                      f"(supported: {', '.join(SPECULATIVE_METHODS)})")
        check_int("speculative_config num_speculative_tokens", self.num_speculative_tokens)
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise InvalidRequestError(f"speculative_config num_speculative_tokens={self.num_speculative_tokens} "
                                      f"exceeds {MAX_SPECULATIVE_TOKENS}")
        check_int("speculative_config prompt_lookup_min", self.prompt_lookup_min)
        check_int("speculative_config prompt_lookup_max", self.prompt_lookup_max)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise InvalidRequestError(f"speculative_config prompt_lookup_min={self.prompt_lookup_min} exceeds "
                                      f"prompt_lookup_max={self.prompt_lookup_max}")
        if self.method == "draft_model" and not self.model:
            raise InvalidRequestError("speculative_config method='draft_model' needs 'model' (the draft's path)")
        if self.method == "ngram" and self.model is not None:
            raise InvalidRequestError("speculative_config method='ngram' takes no 'model'")

    @classmethod
    def from_dict(cls, spec: "dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """The config of vLLM's dict form, e.g. {'method': 'ngram', 'num_speculative_tokens': 4,
        'prompt_lookup_max': 4, 'prompt_lookup_min': 2} or {'method': 'draft_model', 'model': PATH,
        'num_speculative_tokens': 4} ('method' may be left out when 'model' is given); None stays None."""
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if not isinstance(spec, dict):
            raise InvalidRequestError(f"speculative_config must be a dict, got {type(spec).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise InvalidRequestError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))} "
                                      f"(known: {', '.join(sorted(known))})")
        spec = dict(spec)
        if "method" not in spec:
            if not spec.get("model"):
                raise InvalidRequestError("speculative_config needs 'method' ('ngram' or 'draft_model')")
            spec["method"] = "draft_model"
        if "num_speculative_tokens" not in spec:
            raise InvalidRequestError("speculative_config needs 'num_speculative_tokens'")
        if spec.get("model") is not None and not isinstance(spec["model"], (str, os.PathLike)):
            raise InvalidRequestError(f"speculative_config model={spec['model']!r} must be a path")
        if spec.get("model") is not None:
            spec["model"] = os.fspath(spec["model"])
        return cls(**spec)
