"""StructuredOutputsParams: constrain a request's output to a JSON schema, a regex, a list of choices or an EBNF
grammar. Field names and the one-constraint rule follow vLLM's ``StructuredOutputsParams``; the grammars are
xgrammar's (https://xgrammar.mlc.ai): its JSON-schema and regex converters and its EBNF dialect.

Validation runs when the params are built (bad schema / regex / grammar -> InvalidRequestError, a ValueError, whose
message names the field and xgrammar's reason); it converts the constraint to an xgrammar ``Grammar`` without a
tokenizer (well under a millisecond for common schemas). The tokenizer-dependent compile happens in the engine
(sparrow/engine/grammar.py) and is cached by ``cache_key``.
"""
from __future__ import annotations

import json as _json
import re

from dataclasses import dataclass, field

from sparrow.errors import InvalidRequestError

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
"""The fields of which exactly one is set."""
JSON_OBJECT_SCHEMA = '{"type": "object"}'
"""The schema ``json_object=True`` compiles to: any JSON object (not an array or scalar at top level)."""
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: (Check failed: .*? is false: )?")


def _xgrammar_reason(exc: Exception) -> str:
    """xgrammar's error message without its timestamp / C++ source prefix."""
    return _XGR_PREFIX.sub("", str(exc).strip()).strip()


def _quote_ebnf(s: str) -> str:
    """An EBNF string literal for ``s`` (xgrammar's dialect takes JSON-style escapes)."""
    return _json.dumps(s, ensure_ascii=False)


@dataclass
class StructuredOutputsParams:
    """A constraint on the generated text; exactly one of ``json``, ``regex``, ``choice``, ``grammar``,
    ``json_object`` is set.

    Raises InvalidRequestError (a ValueError) naming the fields when none or several are set, and naming the field
    and the reason when the schema, regex, choices or grammar cannot be converted to a grammar.
    """

    json: str | dict | None = None
    """A JSON schema (a JSON string or a dict): the output is one JSON value that validates against it."""
    regex: str | None = None
    """A regular expression the whole output matches (xgrammar's regex dialect, ECMAScript-like)."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF grammar in xgrammar's dialect (GBNF-like, start rule ``root``); the output is a sentence of it."""
    json_object: bool | None = None
    """True: the output is any JSON object (OpenAI's ``response_format={"type": "json_object"}``)."""
    disable_any_whitespace: bool = False
    """JSON constraints only: no optional whitespace between tokens (compact JSON); default allows any."""
    disable_additional_properties: bool = False
    """JSON schemas: objects without ``additionalProperties`` accept no extra keys. xgrammar's strict mode (the
    default here, as in vLLM's xgrammar backend) already does that, so this flag changes nothing."""
    whitespace_pattern: str | None = None
    """vLLM's outlines-only option; xgrammar has no such setting, so a value here raises InvalidRequestError."""
    _key: tuple = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        set_fields = [name for name in CONSTRAINTS if self._is_set(name)]
        if len(set_fields) != 1:
            what = "none is" if not set_fields else f"{len(set_fields)} are ({', '.join(set_fields)})"
            raise InvalidRequestError(
                f"StructuredOutputsParams needs exactly one of {', '.join(CONSTRAINTS)}, but {what} set")
        if self.whitespace_pattern is not None:
            raise InvalidRequestError(
                "StructuredOutputsParams.whitespace_pattern is not supported (xgrammar has no whitespace pattern); "
                "use disable_any_whitespace=True for compact JSON")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"StructuredOutputsParams.{name} must be a boolean")
        self._key = self._normalize(set_fields[0])
        self.build_grammar()  # validation: raises InvalidRequestError naming the field

    def _is_set(self, name: str) -> bool:
        value = getattr(self, name)
        return bool(value) if name == "json_object" else value is not None

    def _normalize(self, kind: str) -> tuple:
        """(kind, text, any_whitespace): the constraint as a hashable key; JSON schemas re-serialized sorted."""
        any_ws = not self.disable_any_whitespace
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = _json.loads(schema)
                except ValueError as e:
                    raise InvalidRequestError(f"StructuredOutputsParams.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError(
                    f"StructuredOutputsParams.json must be a JSON schema object, got {type(schema).__name__}")
            try:
                text = _json.dumps(schema, sort_keys=True, ensure_ascii=False)
            except (TypeError, ValueError) as e:
                raise InvalidRequestError(f"StructuredOutputsParams.json cannot be serialized: {e}") from None
            return ("json", text, any_ws)
        if kind == "json_object":
            if self.json_object is not True:
                raise InvalidRequestError("StructuredOutputsParams.json_object must be True or None")
            return ("json", JSON_OBJECT_SCHEMA, any_ws)
        if kind == "regex":
            if not isinstance(self.regex, str) or not self.regex:
                raise InvalidRequestError("StructuredOutputsParams.regex must be a non-empty string")
            return ("regex", self.regex, any_ws)
        if kind == "grammar":
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise InvalidRequestError("StructuredOutputsParams.grammar must be a non-empty EBNF string")
            return ("grammar", self.grammar, any_ws)
        choice = self.choice
        if (not isinstance(choice, (list, tuple)) or not choice
                or any(not isinstance(c, str) or c == "" for c in choice)):
            raise InvalidRequestError("StructuredOutputsParams.choice must be a non-empty list of non-empty strings")
        return ("grammar", "root ::= " + " | ".join(_quote_ebnf(c) for c in choice), any_ws)

    @property
    def kind(self) -> str:
        """The set constraint's field name (one of CONSTRAINTS)."""
        return next(name for name in CONSTRAINTS if self._is_set(name))

    @property
    def cache_key(self) -> tuple:
        """(xgrammar kind, text, any_whitespace): equal constraints share one compiled grammar. ``kind`` is
        "json" (a schema, json_object included), "regex" or "grammar" (EBNF; choices are turned into one)."""
        return self._key

    def build_grammar(self):
        """The constraint as an ``xgrammar.Grammar`` (tokenizer-independent). Raises InvalidRequestError naming the
        field and xgrammar's reason when it cannot be converted."""
        import xgrammar as xgr  # imports torch: only when a constraint is used

        kind, text, any_ws = self._key
        try:
            if kind == "json":
                return xgr.Grammar.from_json_schema(text, any_whitespace=any_ws, strict_mode=True)
            if kind == "regex":
                return xgr.Grammar.from_regex(text)
            return xgr.Grammar.from_ebnf(text)
        except (RuntimeError, ValueError) as e:
            raise InvalidRequestError(
                f"invalid StructuredOutputsParams.{self.kind}: {_xgrammar_reason(e)}") from None
