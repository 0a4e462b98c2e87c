"""The one KV-cache object: per-layer pools, storage dtype (model dtype or FP8 e4m3 with per-layer scales),
allocation and the write path (``cache.py``)."""
from sparrow.kv_cache.cache import (
    KV_CACHE_DTYPES, KVCache, LayerKVCache, check_kv_cache_dtype, kv_bytes_per_token, layer_kv_dtype,
    parse_skip_layers,
)

__all__ = ["KV_CACHE_DTYPES", "KVCache", "LayerKVCache", "check_kv_cache_dtype", "kv_bytes_per_token",
           "layer_kv_dtype", "parse_skip_layers"]
