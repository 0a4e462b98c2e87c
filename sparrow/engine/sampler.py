"""Sampler: the step's logits -> one token per row, with vLLM's sampling semantics.

Shape legend: R = rows of the step (one sequence each), V = vocabulary, S = rows that sample at random,
K = candidate tokens kept per row after top-k / top-p (sorted by decreasing logit).

Order of operations (vLLM ``SamplingParams`` docs; HF ``generate`` where vLLM is silent), after the model runner
masked the tokens a structured-output row's grammar forbids (``sparrow.engine.grammar.apply_bitmask``):
  logprobs of the raw logits -> repetition penalty (CTRL, arXiv:1909.05858) -> frequency / presence
  penalties (OpenAI API) -> min_tokens suppression -> greedy argmax, or temperature -> top-k -> top-p
  (nucleus, arXiv:1904.09751) -> min-p (arXiv:2407.01082) -> exponential-race draw argmax(p / q),
  q ~ Exp(1), which picks token i with probability p_i.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

import torch

from sparrow.sampling_params import SamplingParams

TOP_P_CANDIDATES = 1024
"""Top-p without top-k first looks for the nucleus among this many best tokens (a partial top-k); rows
whose nucleus is larger retry with 16x more, and sort the whole vocabulary past V / 4."""


@dataclass
class SamplingState:
    """What the sampler needs to know about one row (one sequence) of the step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Tokens generated so far, before this step."""
    generator: torch.Generator | None
    """The sequence's own RNG (``make_generator``) when ``params.seed`` is set, else None."""
    eos_token_ids: set[int]
    """The model's end-of-sequence id(s)."""


@dataclass
class SamplerOutput:
    tokens: torch.Tensor
    """[R] int64 the sampled token of every row, on the logits' device."""
    logprobs: list[dict[int, tuple[float, int]] | None]
    """[R] token id -> (logprob, rank) for the top ``params.logprobs`` tokens plus the sampled one, from
    the raw logits; None for rows whose ``params.logprobs`` is None."""

    @property
    def token_ids(self) -> list[int]:
        """[R] the sampled tokens on the host (waits for the device)."""
        return self.tokens.tolist()


class Candidates(NamedTuple):
    """The tokens a random row may still draw, best first: ``ids[i, :count[i]]`` with ``logits[i, :count[i]]``."""

    logits: torch.Tensor
    """[S, K] float32 temperature-scaled logits, decreasing along K (-inf past the top-k)."""
    ids: torch.Tensor
    """[S, K] int64 token ids."""
    count: torch.Tensor
    """[S] int64 how many leading candidates survive top-k, top-p and min-p (>= 1)."""


def make_generator(seed: int, index: int, device: torch.device | str) -> torch.Generator:
    """The RNG of sequence ``index`` (0 <= index < n) of a request with ``params.seed == seed``.

    Like vLLM's parallel sampling, sequence ``index`` is seeded with ``seed + index``, so index 0 of an
    n > 1 request draws exactly what the same request with n = 1 draws.
    """
    g = torch.Generator(device=device)
    g.manual_seed((seed + index) % 2**64)
    return g


def apply_penalties(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Repetition, frequency and presence penalties and min_tokens suppression, in place.

    logits: [R, V] float32, modified in place and returned.
    - repetition_penalty (CTRL, arXiv:1909.05858, as HF ``RepetitionPenaltyLogitsProcessor``) on every
      token of prompt + output: a logit < 0 is multiplied by the penalty, otherwise divided;
    - frequency_penalty * count and presence_penalty * (count > 0) are subtracted, counting OUTPUT
      tokens only (OpenAI / vLLM);
    - while fewer than ``min_tokens`` tokens were generated, the EOS ids and ``stop_token_ids`` get -inf.
    """
    V = logits.shape[1]
    flat = logits.view(-1)
    rep_idx: list[int] = []
    rep_val: list[float] = []
    pen_idx: list[int] = []
    pen_val: list[float] = []
    ban_idx: list[int] = []
    for r, st in enumerate(states):
        p, base = st.params, r * V
        if p.repetition_penalty != 1.0:
            seen = set(st.prompt_token_ids)
            seen.update(st.output_token_ids)
            rep_idx.extend(base + t for t in seen)
            rep_val.extend([p.repetition_penalty] * len(seen))
        if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and st.output_token_ids:
            for t, c in Counter(st.output_token_ids).items():
                pen_idx.append(base + t)
                pen_val.append(p.frequency_penalty * c + p.presence_penalty)
        if len(st.output_token_ids) < p.min_tokens:
            ban = set(st.eos_token_ids) | set(p.stop_token_ids or ())
            ban_idx.extend(base + t for t in ban if 0 <= t < V)
    dev = logits.device
    if rep_idx:
        idx = torch.tensor(rep_idx, device=dev)
        pen = torch.tensor(rep_val, device=dev)
        vals = flat[idx]
        flat[idx] = torch.where(vals < 0, vals * pen, vals / pen)
    if pen_idx:
        idx = torch.tensor(pen_idx, device=dev)
        flat[idx] -= torch.tensor(pen_val, device=dev)
    if ban_idx:
        flat[torch.tensor(ban_idx, device=dev)] = float("-inf")
    return logits


def argmax_only(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether the sampler only takes the argmax of a row's raw logits for a sequence with ``num_output_tokens``
    generated: greedy, no logprobs, no repetition / frequency / presence penalty and min_tokens reached (so
    nothing bans EOS). The engine then skips the sampler and may feed the argmax to a queued next step."""
    return (params.temperature == 0.0 and params.logprobs is None and params.repetition_penalty == 1.0
            and params.frequency_penalty == 0.0 and params.presence_penalty == 0.0
            and num_output_tokens >= params.min_tokens)


def _needs_penalties(st: SamplingState) -> bool:
    p = st.params
    return (
        p.repetition_penalty != 1.0
        or ((p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and bool(st.output_token_ids))
        or len(st.output_token_ids) < p.min_tokens
    )


def truncate(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    max_candidates: int = TOP_P_CANDIDATES,
) -> Candidates:
    """Temperature, top-k, then top-p, then min-p, as HF's warpers chain them.

    logits: [S, V] float32 (penalized, not yet scaled); temperature: [S] float32 > 0; top_k: [S] int64
    (0 = off); top_p: [S] float32 in (0, 1] (1 = off);
    min_p: [S] float32 in [0, 1]. Every row has top-k or top-p on (rows with neither need no sort).
    - top-k keeps the k largest logits;
    - top-p (arXiv:1904.09751) keeps the smallest prefix whose probability, renormalized over what
      top-k kept, reaches top_p: token i is kept iff the mass strictly before it is < top_p;
    - min-p (arXiv:2407.01082) then drops tokens with p < min_p * p_max.
    Each step keeps a prefix of the sorted tokens, so the result is one count per row.
    """
    S, V = logits.shape
    has_k = (top_k > 0) & (top_k < V)
    k = torch.where(has_k, top_k, V)
    k_max = int(k[has_k].max()) if bool(has_k.any()) else 0
    K = min(V, k_max if bool(has_k.all()) else max(k_max, max_candidates))
    if 4 * K >= V:
        K = V
        vals, ids = torch.sort(logits, dim=-1, descending=True)
    else:
        vals, ids = torch.topk(logits, K, dim=-1)
    vals = vals / temperature[:, None]          # scaling keeps the order: only the candidates are scaled
    in_k = torch.arange(K, device=logits.device) < k[:, None]
    vals = vals.masked_fill(~in_k, float("-inf"))
    # Unnormalized probabilities, 1 at the top token. Row sums come from a sequential cumsum (top-k) or a
    # full-row reduction (no top-k), so a row's result does not depend on the other rows or on K.
    e = torch.exp(vals - vals[:, :1])
    cum = torch.cumsum(e, dim=-1)
    total = cum.gather(1, (k.clamp(max=K) - 1)[:, None]).squeeze(1)
    if not bool(has_k.all()):
        inv_t = (1.0 / temperature)[:, None]
        full_sum = torch.addcmul(-vals[:, :1], logits, inv_t).exp_().sum(-1)    # sum exp(x/T - max)
        total = torch.where(has_k, total, full_sum)
    p_on = top_p < 1.0
    keep = in_k & torch.where(p_on[:, None], (cum - e) < (top_p * total)[:, None], True)
    keep &= e >= min_p[:, None]
    count = keep.sum(-1).clamp_(min=1)
    if K < V:
        # without top-k the nucleus must end inside the K candidates: their mass reaches top_p
        short = p_on & ~has_k & (cum[:, -1] < top_p * total)
        if bool(short.any()):
            rows = short.nonzero().flatten()
            full = truncate(logits[rows], temperature[rows], top_k[rows], top_p[rows], min_p[rows],
                            max_candidates=16 * K)      # 16x more candidates, a full sort past V / 4
            pad = full.logits.shape[1] - K
            vals = torch.cat([vals, vals.new_full((S, pad), float("-inf"))], dim=1)
            ids = torch.cat([ids, ids.new_zeros((S, pad))], dim=1)
            vals[rows], ids[rows], count[rows] = full.logits, full.ids, full.count
    return Candidates(vals, ids, count)


class Sampler:
    """Picks the next token of every row of a step.

    ``seed`` seeds the sampler-wide generator that rows without ``params.seed`` draw from (random when
    None). A seeded row draws only from its own generator, in a way that does not depend on the other
    rows of the batch or their order.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def reseed(self, seed: int | None) -> None:
        """Seed the sampler-wide generator with ``seed`` from the next draw on (None: a random seed)."""
        self._seed = seed
        self._generators.clear()

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        g = self._generators.get(device)
        if g is None:
            g = torch.Generator(device=device)
            if self._seed is None:
                g.seed()
            else:
                g.manual_seed(self._seed)
            self._generators[device] = g
        return g

    def __call__(self, logits: torch.Tensor, states: list[SamplingState]) -> SamplerOutput:
        """logits: [R, V] float (any device), one row per state. Returns the tokens and logprobs.

        Raises ValueError when the logits are not 2-D or their row count differs from len(states).
        """
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(
                f"sampler: logits of shape {tuple(logits.shape)} do not match {len(states)} sampling states"
            )
        R = logits.shape[0]
        lp_rows = [r for r, st in enumerate(states) if st.params.logprobs is not None]
        raw_lp = None
        if lp_rows:
            src = logits if len(lp_rows) == R else logits[lp_rows]
            raw_lp = torch.log_softmax(src.float(), dim=-1)

        x = logits.float()
        if any(_needs_penalties(st) for st in states):
            x = apply_penalties(x.clone() if x is logits else x, states)
        greedy = [r for r, st in enumerate(states) if st.params.temperature == 0.0]
        if len(greedy) == R:
            tokens = x.argmax(dim=-1)
        else:
            tokens = torch.empty(R, dtype=torch.long, device=x.device)
            if greedy:
                gi = torch.tensor(greedy, device=x.device)
                tokens[gi] = x[gi].argmax(dim=-1)
            rand = [r for r in range(R) if states[r].params.temperature != 0.0]
            tokens[torch.tensor(rand, device=x.device)] = self._sample(x, rand, [states[r] for r in rand])
        logprobs: list[dict[int, tuple[float, int]] | None] = [None] * R
        if raw_lp is not None:
            token_ids = tokens.tolist()
            for r, d in zip(lp_rows, _logprob_dicts(raw_lp, [token_ids[r] for r in lp_rows],
                                                     [states[r].params.logprobs for r in lp_rows])):
                logprobs[r] = d
        return SamplerOutput(tokens, logprobs)

    def _sample(self, x: torch.Tensor, rows: list[int], states: list[SamplingState]) -> torch.Tensor:
        """x: [R, V] float32 penalized logits (not modified); rows: the S rows to sample, states: theirs.
        Returns [S] int64 tokens."""
        S, V = len(rows), x.shape[1]

        def take(sel: list[int]) -> torch.Tensor:  # [len(sel), V] rows of x; x itself when it is all of them
            xr = [rows[i] for i in sel]
            return x if xr == list(range(x.shape[0])) else x[xr]

        dev = x.device
        temp = torch.tensor([st.params.temperature for st in states], dtype=torch.float32, device=dev)
        trunc = [i for i, st in enumerate(states) if 0 < st.params.top_k < V or st.params.top_p < 1.0]
        full = [i for i in range(S) if i not in set(trunc)]
        out = torch.empty(S, dtype=torch.long, device=dev)
        if full:
            sub = [states[i] for i in full]
            y = take(full)
            if any(st.params.temperature != 1.0 for st in sub):
                y = y / temp[full][:, None]
            probs = torch.softmax(y, dim=-1)
            min_p = torch.tensor([st.params.min_p for st in sub], dtype=torch.float32, device=dev)
            if bool((min_p > 0).any()):
                probs.masked_fill_(probs < min_p[:, None] * probs.amax(-1, keepdim=True), 0.0)
            q = self._exp_noise(sub, torch.full((len(full),), V, device=dev), V, dev)
            out[torch.tensor(full, device=dev)] = probs.div_(q).argmax(-1)
        if trunc:
            sub = [states[i] for i in trunc]
            cand = truncate(
                take(trunc),
                temp[trunc],
                torch.tensor([max(st.params.top_k, 0) for st in sub], device=dev),
                torch.tensor([st.params.top_p for st in sub], dtype=torch.float32, device=dev),
                torch.tensor([st.params.min_p for st in sub], dtype=torch.float32, device=dev),
            )
            K = cand.logits.shape[1]
            probs = torch.exp(cand.logits - cand.logits[:, :1])   # unnormalized; row max -> 1
            q = self._exp_noise(sub, cand.count, K, dev)
            j = (probs / q).argmax(-1, keepdim=True)
            out[torch.tensor(trunc, device=dev)] = cand.ids.gather(1, j).squeeze(1)
        return out

    def _exp_noise(self, states: list[SamplingState], count: torch.Tensor, K: int, dev) -> torch.Tensor:
        """[S, K] float32 Exp(1) noise, +inf past each row's ``count``.

        A seeded row fills its first ``count`` entries from its own generator, so its draw depends only
        on itself; unseeded rows share one draw from the sampler-wide generator.
        Exp(1) = -log(U), U ~ U[0, 1) (U = 0 gives +inf: that token is never picked).
        """
        S = len(states)
        q = torch.empty(S, K, dtype=torch.float32, device=dev)
        counts = count.tolist()
        unseeded = [i for i, st in enumerate(states) if st.generator is None]
        if unseeded:
            g = self._shared_generator(q.device)
            if len(unseeded) == S:
                q.uniform_(0.0, 1.0, generator=g)
            else:
                q[unseeded] = torch.rand(len(unseeded), K, generator=g, device=dev)
        for i, st in enumerate(states):
            if st.generator is not None:
                q[i, : counts[i]] = torch.rand(counts[i], generator=st.generator, device=dev)
        q.log_().neg_()
        if min(counts) < K:
            q.masked_fill_(torch.arange(K, device=dev) >= count[:, None], float("inf"))
        return q


def _logprob_dicts(
    lp: torch.Tensor, sampled: list[int], top_n: list[int]
) -> list[dict[int, tuple[float, int]]]:
    """lp: [L, V] log_softmax of raw logits. Returns per row {token: (logprob, rank)} for the top_n[i]
    tokens plus sampled[i]; rank = 1 + number of tokens with a strictly larger logprob."""
    L, V = lp.shape
    tok = torch.tensor(sampled, device=lp.device)
    tok_lp = lp.gather(1, tok[:, None])                                  # [L, 1]
    tok_rank = ((lp > tok_lp).sum(-1) + 1).tolist()
    tok_lp = tok_lp.squeeze(1).tolist()
    n = min(max(top_n), V)
    if n > 0:
        top_v, top_i = torch.topk(lp, n, dim=-1)                       # [L, n] decreasing
        neg = (-top_v).contiguous()
        top_r = (torch.searchsorted(neg, neg) + 1).tolist()              # strictly larger ones come first
        top_v, top_i = top_v.tolist(), top_i.tolist()
    out = []
    for i in range(L):
        d = {top_i[i][j]: (top_v[i][j], top_r[i][j]) for j in range(min(top_n[i], n))} if n > 0 else {}
        d[sampled[i]] = (tok_lp[i], tok_rank[i])
        out.append(d)
    return out


def prompt_logprob_rows(logits: torch.Tensor, targets: list[int], top_n: int) -> list[dict[int, tuple[float, int]]]:
    """Prompt logprobs of m rows: logits [m, V] (row r predicts prompt token targets[r]). Returns per row
    {token: (logprob, rank)} for the target plus the top ``top_n`` tokens (vLLM's ``prompt_logprobs``), from the
    raw logits; rank = 1 + number of tokens with a strictly larger logprob."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    tgt = torch.tensor(targets, device=lp.device)
    chosen = lp.gather(1, tgt[:, None])[:, 0]
    ranks = ((lp > chosen[:, None]).sum(1) + 1).tolist()
    chosen = chosen.tolist()
    top = lp.topk(top_n, dim=-1) if top_n > 0 else None
    top_v, top_i = (top.values.tolist(), top.indices.tolist()) if top is not None else ([], [])
    rows = []
    for r, t in enumerate(targets):
        d = {t: (chosen[r], ranks[r])}
        for j in range(top_n):
            d.setdefault(top_i[r][j], (top_v[r][j], j + 1))
        rows.append(d)
    return rows
