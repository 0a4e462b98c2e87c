"""What the front end knows of the served model (the engine and its weights live in the engine process), and the
model's ids: ``--served-model-name`` (vLLM's: one or more names, the first is the id reported, a request may give any)
or the folder's or file's name, never a path."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from sparrow.errors import InvalidRequestError


@dataclass
class ServedModel:
    """What the front end knows of the served model (the engine and its weights live in the engine process)."""

    name: str
    """The model's id in the API: the first served name (responses' ``model``, adapters' ``parent``)."""
    root: str | None
    """Its path (None for a random-weight shape)."""
    max_model_len: int
    vocab_size: int
    spec_k: int | None = None
    """Draft tokens per verify step with speculative decoding on; None: off."""
    loras: dict = field(default_factory=dict)
    """Served LoRA adapters: name (a ``model`` value) -> LoRARequest."""
    max_loras: int | None = None
    """Most distinct LoRA adapters in one step (``LoRAConfig.max_loras``); None: LoRA off."""
    aliases: tuple[str, ...] = ()
    """The other served names: a request's ``model`` may give any of them (vLLM's --served-model-name)."""
    runtime_lora: bool = False
    """Whether /v1/load_lora_adapter and /v1/unload_lora_adapter are served (``sparrow.server.lora_routes``)."""
    tool_call_parser: str | None = None
    """``--tool-call-parser``: the ``sparrow.server.tool_parsers`` name reading the model's tool calls."""
    enable_auto_tool_choice: bool = False
    """``--enable-auto-tool-choice``: ``tool_choice: "auto"`` lets the model call tools (needs a parser)."""
    reasoning_parser: str | None = None
    """``--reasoning-parser``: split ``<think>`` reasoning into ``reasoning_content`` (``server.reasoning``)."""

    @property
    def names(self) -> tuple[str, ...]:
        """Every served name of the base model, the id first."""
        return (self.name, *self.aliases)

    @classmethod
    def of(cls, llm, served_model_name: str | list[str] | tuple[str, ...] | None = None, loras: dict | None = None,
           runtime_lora: bool = False) -> "ServedModel":
        """``served_model_name``: one name or several (the first is the id); None: ``model_id(llm.model_path)``.
        Raises InvalidRequestError for an empty list, an empty or repeated name."""
        spec, lora = llm.config.speculative, llm.config.lora
        names = served_names(served_model_name, llm.model_path)
        return cls(names[0], llm.model_path, llm.config.max_model_len, llm.config.model.vocab_size,
                   spec.num_speculative_tokens if spec is not None else None, dict(loras or {}),
                   lora.max_loras if lora is not None else None, names[1:], runtime_lora)


def model_id(path: str | None) -> str:
    """The id a model is served under without --served-model-name: its folder's or file's name (never the path:
    ``/models/SmolLM2-135M`` -> ``SmolLM2-135M``, ``gemma-3-270m-Q4_K_M.gguf`` as it is); ``sparrow-model`` for a
    model without a path."""
    if path is None:
        return "sparrow-model"
    return os.path.basename(os.path.normpath(path)) or "sparrow-model"


def served_names(served_model_name, path: str | None) -> tuple[str, ...]:
    """The served names: ``served_model_name`` (a name or a list of names) or ``(model_id(path),)``."""
    if served_model_name is None:
        return (model_id(path),)
    names = (served_model_name,) if isinstance(served_model_name, str) else tuple(served_model_name)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise InvalidRequestError(f"--served-model-name: give one or more non-empty names, got {served_model_name!r}")
    if len(set(names)) != len(names):
        raise InvalidRequestError(f"--served-model-name: each name once, got {list(names)!r}")
    return names
