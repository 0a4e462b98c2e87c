"""N-gram (prompt lookup) proposer: the tokens that followed the latest earlier occurrence of the context's last n
tokens, for n from ``prompt_lookup_max`` down to ``prompt_lookup_min`` (Saxena 2023, "Prompt Lookup Decoding";
vLLM's ``method="ngram"``).

Each sequence's tokens live in a numpy buffer that grows with its output (only new tokens are copied), and one
lookup is a vectorized comparison over the context: O(L n) element operations, no Python loop over L.
"""
from __future__ import annotations

import numpy as np

from sparrow.engine.sequence import Sequence


class _Tokens:
    """A sequence's prompt + output as a growing int64 buffer."""

    def __init__(self, seq: Sequence):
        self.buf = np.empty(max(64, 2 * seq.num_tokens), dtype=np.int64)
        self.n = 0
        self.sync(seq)

    def sync(self, seq: Sequence) -> np.ndarray:
        """Bring the buffer up to ``seq``'s tokens (outputs only grow); returns the [L] view."""
        total = seq.num_tokens
        if total > self.buf.shape[0]:
            grown = np.empty(2 * total, dtype=np.int64)
            grown[:self.n] = self.buf[:self.n]
            self.buf = grown
        if total > self.n:
            self.buf[self.n:total] = seq.tokens(self.n, total)
            self.n = total
        return self.buf[:total]


def lookup(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens of ``tokens`` [L], for the
    largest n in [n_min, n_max] that occurs; [] when none does."""
    L = tokens.shape[0]
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n:]
        starts = L - n  # candidate occurrences start at 0 .. L - n - 1 (not the suffix itself)
        hit = np.ones(starts, dtype=bool)
        for j in range(n):
            hit &= tokens[j:j + starts] == suffix[j]
        where = np.flatnonzero(hit)
        if where.size:
            follow = int(where[-1]) + n
            return tokens[follow:follow + k].tolist()
    return []


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max
        self._tokens: dict[Sequence, _Tokens] = {}

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        """For each (sequence, most drafts k') the draft tokens (at most k', possibly none)."""
        return [lookup(self._synced(seq), self.n_min, self.n_max, k) for seq, k in requests]

    def _synced(self, seq: Sequence) -> np.ndarray:
        """``seq``'s tokens so far, from its buffer (made on first use)."""
        buf = self._tokens.get(seq)
        if buf is None:
            buf = self._tokens[seq] = _Tokens(seq)
        return buf.sync(seq)

    def can_draft(self, seq: Sequence) -> bool:
        """Whether a lookup on ``seq``'s tokens so far finds a draft. Asked before the step that appends the
        next token: when it finds none, the next lookup (one token later) most likely finds none either, so the
        engine may queue that step ahead (``SpeculativeDecoder.paused``) instead of waiting to propose."""
        return bool(lookup(self._synced(seq), self.n_min, self.n_max, 1))

    def release(self, seq: Sequence) -> None:
        """Forget a sequence that left the running batch."""
        self._tokens.pop(seq, None)
