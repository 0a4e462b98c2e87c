"""Every runtime switch, read once from the environment (placeholder: the kernels' switches join here)."""
from __future__ import annotations

import os

OVERLAP: bool = os.environ.get("SPARROW_OVERLAP", "1") != "0"
"""SPARROW_OVERLAP (bool, default on): queue the next greedy decode step before reading this one's tokens."""
