"""sparrow's on-disk cache (``$SPARROW_CACHE``, default ~/.cache/sparrow): the assembled default model, converted
GGUF tokenizers and GGUF tensor indexes."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """A folder under the cache root (not created)."""
    return Path(os.environ.get("SPARROW_CACHE", Path.home() / ".cache" / "sparrow")).joinpath(*parts)


def file_key(path: Path, length: int = 16) -> str:
    """A key for what is derived from a file: changes when its path, size or mtime change."""
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:length]
