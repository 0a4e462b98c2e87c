"""Structured-output request fields of /v1/completions and /v1/chat/completions -> one StructuredOutputsParams.

Accepted forms (OpenAI's and vLLM's names), at most one per request:
- ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any JSON object),
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`` (OpenAI's);
- ``guided_json`` (a schema, object or string), ``guided_regex``, ``guided_choice``, ``guided_grammar`` (EBNF in
  xgrammar's dialect), vLLM's older extra fields;
- ``structured_outputs``: vLLM's dict form, the keys of ``sparrow.StructuredOutputsParams``
  (``{"choice": [...]}``, ``{"json": {...}, "disable_any_whitespace": true}``, ...); given with options only
  (``{"disable_any_whitespace": true}``) beside another field, its options apply to that field's constraint (as
  vLLM merges ``response_format`` into ``structured_outputs``).

A bad schema / regex / grammar, an unknown key, or two constraints at once -> ApiError 400 naming the field.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from sparrow.errors import InvalidRequestError
from sparrow.server.serving import ApiError
from sparrow.structured_outputs import CONSTRAINTS, StructuredOutputsParams

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
"""vLLM's guided_* request fields -> the StructuredOutputsParams field each sets."""
PARAMS_KEYS = tuple(f.name for f in dataclasses.fields(StructuredOutputsParams) if not f.name.startswith("_"))
"""The keys ``structured_outputs`` takes."""


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    name: str
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    """Accepted; the output always follows the schema (xgrammar's strict mode: no extra properties unless the
    schema allows them)."""


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredFields(BaseModel):
    """The request fields that constrain the output (a base of the completions and chat request bodies)."""

    model_config = ConfigDict(strict=True, extra="allow")

    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    _params_made: tuple = PrivateAttr(default=())

    @property
    def constrained(self) -> bool:
        """Whether a structured-output field is set (``response_format`` text counts as unset)."""
        rf = self.response_format
        return ((rf is not None and rf.type != "text") or self.structured_outputs is not None
                or any(getattr(self, name) is not None for name in GUIDED_FIELDS))

    async def check_structured_outputs(self) -> None:
        """Build the request's StructuredOutputsParams on a worker thread (the first one imports xgrammar and
        torch, seconds on a small machine: not on the event loop); ``structured_outputs_params`` then returns it.
        Raises what that raises."""
        if self.constrained:
            await asyncio.to_thread(self.structured_outputs_params)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's constraint, None when it has none (built once per request). Raises ApiError 400 naming the field for two
        constraints at once, a json_schema format without its schema, an unknown ``structured_outputs`` key, or a
        schema / regex / choice list / grammar that cannot be compiled (xgrammar's reason quoted)."""
        if not self._params_made:
            self._params_made = (self._make_params(),)
        return self._params_made[0]

    def _make_params(self) -> StructuredOutputsParams | None:
        given: list[tuple[str, dict]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise ApiError(400, "response_format: type json_schema needs a json_schema object "
                                    "({'name': ..., 'schema': {...}})", "response_format")
            given.append(("response_format", {"json": rf.json_schema.json_schema}))
        for name, key in GUIDED_FIELDS.items():
            value = getattr(self, name)
            if value is not None:
                given.append((name, {key: value}))
        options = {}
        if self.structured_outputs is not None:
            unknown = [k for k in self.structured_outputs if k not in PARAMS_KEYS]
            if unknown:
                raise ApiError(400, f"structured_outputs.{unknown[0]}: unknown key (known: {', '.join(PARAMS_KEYS)})",
                               "structured_outputs")
            if any(k in CONSTRAINTS for k in self.structured_outputs) or not given:
                given.append(("structured_outputs", dict(self.structured_outputs)))
            else:  # options only (disable_any_whitespace, ...): they apply to the other field's constraint
                options = dict(self.structured_outputs)
        if not given:
            return None
        if len(given) > 1:
            names = ", ".join(name for name, _ in given)
            raise ApiError(400, f"{names}: give at most one structured output constraint", given[1][0])
        name, kwargs = given[0]
        try:
            return StructuredOutputsParams(**kwargs, **options)
        except InvalidRequestError as e:
            raise ApiError(400, f"{name}: {' '.join(str(e).split())}", name) from None
