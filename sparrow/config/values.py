"""Checks and parsers of single config values, shared by the engine configs and their users: integers with a
minimum, byte sizes ('8GiB'), the KV cache dtype and the layers an FP8 KV cache keeps in the model dtype. Each
raises InvalidRequestError naming the argument and the value."""
from __future__ import annotations

import re
from typing import Any, Iterable

from sparrow.errors import InvalidRequestError

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
"""Accepted ``kv_cache_dtype`` values (vLLM's names): "auto" = the model dtype; "fp8" = "fp8_e4m3"."""
SKIP_LAYER_KINDS = ("sliding_window",)
"""Layer kinds ``kv_cache_dtype_skip_layers`` names besides layer indices."""

_UNITS = {"": 1, "k": 1 << 10, "ki": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mi": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gi": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "ti": 1 << 40, "tib": 1 << 40,
          "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def check_int(name: str, value: Any, minimum: int = 1) -> None:
    """Raise InvalidRequestError unless ``value`` is an int (not a bool) >= ``minimum``; the message names it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name}={value!r} must be an integer")
    if value < minimum:
        raise InvalidRequestError(f"{name}={value} must be at least {minimum}")


def parse_size(value: int | str, name: str = "kv_cache_memory") -> int:
    """Bytes from an int or a string: '8GiB', '8G', '8Gi', '512MiB', '1.5GiB' (K / M / G / T with or without
    'i' / 'iB': powers of 1024; 'kB' / 'MB' / 'GB' / 'TB': powers of 1000; any case), or plain digits.
    Raises InvalidRequestError naming ``name`` and the value for anything else or a size below 1 byte."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidRequestError(f"{name}={value!r} must be a number of bytes (an int, or a string like '8GiB')")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE.fullmatch(value)
        unit = _UNITS.get(m[2].lower()) if m else None
        if unit is None:
            raise InvalidRequestError(f"{name}={value!r} is not a size: give bytes, or a number with a unit "
                                      "(K, M, G, T, KiB, MiB, GiB, TiB, kB, MB, GB, TB), e.g. '8GiB'")
        n = int(float(m[1]) * unit)
    if n < 1:
        raise InvalidRequestError(f"{name}={value!r} must be at least 1 byte")
    return n


def check_kv_cache_dtype(kv_cache_dtype) -> str:
    """``kv_cache_dtype`` if it is one of KV_CACHE_DTYPES; raises InvalidRequestError naming it otherwise."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise InvalidRequestError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported (supported: "
                                  f"{', '.join(KV_CACHE_DTYPES)})")
    return kv_cache_dtype


def parse_skip_layers(skip) -> tuple:
    """``kv_cache_dtype_skip_layers`` as a tuple of "sliding_window" and non-negative ints: from an iterable of
    those (digit strings taken as ints) or one comma-separated string ("sliding_window,0,3"). Raises
    InvalidRequestError naming a bad entry."""
    if skip is None:
        return ()
    if isinstance(skip, str):
        skip = [s.strip() for s in skip.split(",") if s.strip()]
    if not isinstance(skip, Iterable):
        raise InvalidRequestError(f"kv_cache_dtype_skip_layers={skip!r} must be a list of layer indices and / or "
                                  f"{', '.join(map(repr, SKIP_LAYER_KINDS))}")
    out = []
    for s in skip:
        if isinstance(s, str) and s.strip().isdigit():
            s = int(s)
        if isinstance(s, bool) or not (s in SKIP_LAYER_KINDS or (isinstance(s, int) and s >= 0)):
            raise InvalidRequestError(f"kv_cache_dtype_skip_layers entry {s!r} is neither a layer index (int >= 0) "
                                      f"nor one of {', '.join(map(repr, SKIP_LAYER_KINDS))}")
        out.append(s)
    return tuple(dict.fromkeys(out))
