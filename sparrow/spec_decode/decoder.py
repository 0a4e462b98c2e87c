"""``SpeculativeDecoder``, the engine's ``Speculator`` (``sparrow.engine.speculator``): which sequences get drafts
this step and how many (limits and back-off), the proposer call, the acceptance of drafts from the sampled ids
(``accept``: the leading drafts equal to the token sampled at the row before each), the acceptance counters
(vLLM's spec_decode metrics) and the step timing.

Back-off, per sequence: a sequence that got no draft, or whose drafts were all rejected, pauses proposing for
its next 2, 4, 8 .. 32 tokens (doubling with each miss in a row; an accepted draft resets it), so text the
proposer cannot predict runs as plain decode steps, which the engine may overlap (``paused``), after a few
misses.

Overlap: a step the engine queues ahead (behind the one running) cannot carry drafts, since its sequences'
last tokens are not on the host yet. It does so when ``paused``: every sequence is backing off, or (n-gram)
finds no draft on its tokens so far, so that text the proposer cannot match runs at plain decoding's overlapped
speed without a back-off (a step that waits to propose costs more than an overlapped one).

Back-off, per step: a verify step costs more than a decode step (more rows, and the engine cannot queue the
next step behind it), and every sequence of the step pays it, drafted or not. The decoder times the steps the
engine runs (``step_done`` -> ``observe_step``: the wall time between the ends of consecutive steps, per
rows-per-sequence q) and
keeps each sequence's recent acceptance rate; a step whose B decoding sequences hold drafts d_i verifies them
only when the tokens it expects to gain pay for its cost (t measured per q and per power-of-two bucket of B, since
the relative cost of a verify step grows with the batch):

    sum_i rate_i * len(d_i)  >=  (t(q) / t(1) - 1) * B,     q = 1 + max len(d_i)

With switches.SPEC_CLOSED_BATCH and no request waiting for a slot, the batch ends with its sequences with the
most tokens left, so each of them (within k of the longest) must draft and gain the cost alone:
rate_i * len(d_i) >= t(q) / t(1) - 1 (with the sum, tokens gained by sequences that end early shorten nothing
unless a waiting request takes their slot).
Otherwise its drafts are dropped and proposing pauses for 4, 8 .. 32 steps (doubling while it keeps losing),
which the engine overlaps; after the longest pause one verify step runs regardless, so costs and rates stay
measured.

Seeded requests (``SamplingParams.seed``): a verify step draws k + 1 numbers from a sequence's generator where a
decode step draws one, so the per-step rule, which rests on measured times, would make a seed's tokens depend on
timing. A seeded sequence's drafts therefore always verify (its own back-off, which rests on its tokens, still
applies), also while the batch's drafting is paused; outside such a pause, a step that carries them carries the
other sequences' drafts too. The same seed then gives the same tokens run after run, as vLLM's seeded sampling
does. (A batch whose seeded sequences draft therefore verifies in most steps, and every sequence of the batch
pays the verify step's cost.)
"""
from __future__ import annotations

import time

from sparrow import switches
from sparrow.config import SpeculativeConfig
from sparrow.engine.sequence import Sequence
from sparrow.engine.step_plan import ScheduledSeq, StepPlan
from sparrow.spec_decode.ngram import NgramProposer

MAX_BACKOFF_STEPS = 32
"""Longest pause, in steps, of a sequence whose drafts keep being rejected, and of the whole batch's drafting."""
FIRST_HOLD_STEPS = 4
"""First pause, in steps, of the batch's drafting when a verify step would not pay."""
MAX_DRAFT_VOCAB_PADDING = 128
"""Most tokens a draft model's vocabulary may lack against the target's: the same tokenizer with the embedding
padded to another multiple (Qwen2.5 0.5B-7B: 151,936 rows, 14B-72B: 152,064), as vLLM and llama.cpp allow; a
sequence holding a token past the draft's vocabulary gets no drafts (``DraftModelProposer``)."""
INITIAL_RATE = 0.7
"""Acceptance rate assumed for a sequence before its first verified draft."""
EMA = 0.25
"""Weight of the newest sample in the step-time and acceptance-rate averages."""


def _seeded(seq: Sequence) -> bool:
    """Whether ``seq`` samples from its own seeded generator (``SamplingParams.seed``)."""
    return seq.params.seed is not None


def accepted_drafts(item: ScheduledSeq, sampled: list[int]) -> int:
    """How many of ``item``'s draft tokens the step accepts: the leading ones equal to the token sampled at the
    row before each. With deterministic drafts this is rejection sampling (``sparrow.spec_decode``): exact for
    greedy rows, and for random rows every appended token is a sample of the target given the tokens before it."""
    n = 0
    for draft, target in zip(item.draft_token_ids, sampled):
        if draft != target:
            break
        n += 1
    return n


def batch_bucket(n: int) -> int:
    """The power of two >= n (at least 1) whose step times a step of n sequences shares."""
    return 1 << max(0, n - 1).bit_length()


def tokens_left(seq: Sequence, max_model_len: int) -> int:
    """Tokens ``seq`` may still append before max_tokens or max_model_len (EOS and stops aside)."""
    left = max_model_len - seq.num_tokens
    if seq.params.max_tokens is not None:
        left = min(left, seq.params.max_tokens - len(seq.output_token_ids))
    return left


def draft_limit(seq: Sequence, k: int, max_model_len: int) -> int:
    """Most drafts ``seq`` may verify in its next step: k, less what would pass max_tokens or max_model_len
    (a verify step of k' drafts appends up to k' + 1 tokens), never below 0."""
    return max(0, min(k, tokens_left(seq, max_model_len) - 1))


class _BackOff:
    __slots__ = ("misses", "resume_at")

    def __init__(self):
        self.misses = 0
        self.resume_at = 0
        """Output tokens the sequence must have before it proposes again."""

    def miss(self, num_output_tokens: int) -> None:
        self.misses += 1
        self.resume_at = num_output_tokens + min(2 ** self.misses, MAX_BACKOFF_STEPS)


class SpeculativeDecoder:
    """The ``Speculator``: ``propose(running)`` -> {sequence: draft ids} for the scheduler, ``accept(item,
    sampled)`` after a step (``record`` counts it), ``paused``, ``release``, ``step_done``."""

    def __init__(self, config: SpeculativeConfig, proposer, max_model_len: int):
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer = proposer
        self.max_model_len = max_model_len
        self._backoff: dict[Sequence, _BackOff] = {}
        self.num_drafts = 0
        """Verify steps of a sequence with at least one draft token (vLLM's spec_decode_num_drafts)."""
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * self.k
        """[k] how often the draft at position i (0-based) was accepted."""
        self.step_seconds: dict[tuple[int, int], float] = {}
        """(batch bucket, q) -> average wall seconds of a decode (q = 1) or verify step of q rows per sequence,
        by ``batch_bucket`` of its sequences (a step's cost grows with the batch differently for each q)."""
        self._rate: dict[Sequence, float] = {}
        self._last_step_end: float | None = None  # perf_counter() at the end of the last decode / verify step
        self._steps = 0
        self._hold_until = 0
        self._hold = 0

    def propose(self, running: list[Sequence], waiting: int = 0) -> dict[Sequence, list[int]]:
        """Drafts for the running sequences in their decode phase (their last token not yet computed), outside
        back-off, with room for at least one draft; sequences that left the batch are forgotten. ``waiting``:
        requests queued for a slot (none: the batch is closed, ``pays``)."""
        live = set(running)
        for seq in [s for s in self._backoff if s not in live]:
            del self._backoff[seq]
            self._rate.pop(seq, None)
            self.proposer.release(seq)
        held = self._steps < self._hold_until
        requests = []
        decoding = []
        for seq in running:
            if seq.num_computed_tokens != seq.num_tokens - 1 or not seq.output_token_ids:
                continue
            decoding.append(seq)
            state = self._backoff.get(seq)
            if state is None:
                state = self._backoff[seq] = _BackOff()
            if len(seq.output_token_ids) < state.resume_at or (held and not _seeded(seq)):
                continue
            k = draft_limit(seq, self.k, self.max_model_len)
            if k > 0:
                requests.append((seq, k))
        if not requests:
            return {}
        drafts = self.proposer.propose(requests)
        for (seq, _), d in zip(requests, drafts):
            if not d:
                self._backoff[seq].miss(len(seq.output_token_ids))
        out = {seq: d for (seq, _), d in zip(requests, drafts) if d}
        if held or any(_seeded(seq) for seq in out):  # a seeded sequence's drafts always verify (module doc)
            return out
        if out and not self.pays(out, decoding, waiting):
            self._hold = min(max(FIRST_HOLD_STEPS, 2 * self._hold), MAX_BACKOFF_STEPS)
            self._hold_until = self._steps + self._hold
            return {}
        if out and self._hold < MAX_BACKOFF_STEPS:
            self._hold = 0
        return out

    def pays(self, drafts: dict[Sequence, list[int]], decoding: list[Sequence], waiting: int = 0) -> bool:
        """Whether verifying ``drafts`` in a step of the ``decoding`` sequences is expected to beat a decode
        step (the rule above; with switches.SPEC_CLOSED_BATCH and no request ``waiting``, every sequence with
        the most tokens left, within k, must draft and gain the cost alone). Unmeasured step times count as
        equal (verify, so that they get measured); after the longest pause it pays once regardless."""
        if self._hold >= MAX_BACKOFF_STEPS:
            self._hold = 0
            return True
        q, b = 1 + max(len(d) for d in drafts.values()), batch_bucket(len(decoding))
        t1, tq = self.step_seconds.get((b, 1)), self.step_seconds.get((b, q))
        if t1 is None or tq is None:
            return True
        cost = tq / t1 - 1.0

        def gain(seq: Sequence) -> float:
            return self._rate.get(seq, INITIAL_RATE) * len(drafts.get(seq, ()))

        if switches.SPEC_CLOSED_BATCH and not waiting and len(decoding) > 1:
            left = {seq: tokens_left(seq, self.max_model_len) for seq in decoding}
            longest = max(left.values())
            return all(gain(seq) >= cost for seq in decoding if left[seq] >= longest - self.k)
        return sum(gain(seq) for seq in drafts) >= cost * len(decoding)

    def observe_step(self, q: int, seconds: float, batch: int = 1) -> None:
        """A decode (q = 1) or verify step of ``batch`` sequences and at most q rows per sequence took
        ``seconds`` (end to end, as the engine saw it: the time since the previous step ended). A sample over 4x
        the average so far (a pause of the caller, not the step) is capped there."""
        self._steps += 1
        key = (batch_bucket(batch), q)
        old = self.step_seconds.get(key)
        if old is None:
            self.step_seconds[key] = seconds
        else:
            self.step_seconds[key] = old + EMA * (min(seconds, 4 * old) - old)

    def paused(self, seqs: list[Sequence], ahead: int = 2) -> bool:
        """Whether none of ``seqs`` would propose within its next ``ahead`` tokens (back-off of each, or of the
        batch), or would find no draft (a proposer with ``can_draft``, asked on the tokens so far: the n-gram
        one): the engine may then queue decode steps ahead without asking the proposer."""
        held = self._steps + ahead <= self._hold_until
        can_draft = getattr(self.proposer, "can_draft", None)
        for seq in seqs:
            if held and not _seeded(seq):
                continue
            state = self._backoff.get(seq)
            if state is not None and len(seq.output_token_ids) + ahead < state.resume_at:
                continue
            if can_draft is None or can_draft(seq):
                return False
        return True

    def release(self, seq: Sequence) -> None:
        """Forget a sequence that finished or was aborted (the proposer frees what it holds for it)."""
        self._backoff.pop(seq, None)
        self._rate.pop(seq, None)
        self.proposer.release(seq)

    def accept(self, item: ScheduledSeq, sampled: list[int]) -> int:
        """How many of ``item``'s drafts the ids ``sampled`` at its rows accept (``accepted_drafts``), counted
        (``record``)."""
        accepted = accepted_drafts(item, sampled)
        self.record(item, accepted)
        return accepted

    def step_done(self, plan: StepPlan) -> None:
        """The engine applied ``plan``: a decode or verify step that followed another one is timed (the interval
        between their ends: what a step costs the batch, overlap and host work included; ``observe_step``)."""
        now = time.perf_counter()
        q = plan.max_query_len()
        last, self._last_step_end = self._last_step_end, (now if q is not None else None)
        if q is not None and last is not None:
            self.observe_step(q, now - last, len(plan.seqs))

    def record(self, item: ScheduledSeq, accepted: int) -> None:
        """Count a verified item's drafts and accepted drafts; start or reset the sequence's back-off."""
        k = len(item.draft_token_ids)
        if not k:
            return
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.num_accepted_tokens_per_pos[i] += 1
        old = self._rate.get(item.seq, INITIAL_RATE)
        self._rate[item.seq] = old + EMA * (accepted / k - old)
        state = self._backoff.get(item.seq)
        if state is None:
            return
        if accepted:
            state.misses = 0
        else:
            state.miss(len(item.seq.output_token_ids))

    def metrics(self) -> dict:
        """The counters under vLLM's names (``sparrow:`` prefix)."""
        return {
            "sparrow:spec_decode_num_drafts": self.num_drafts,
            "sparrow:spec_decode_num_draft_tokens": self.num_draft_tokens,
            "sparrow:spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "sparrow:spec_decode_num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
        }


def make_speculative_decoder(config, num_blocks: int, draft_model=None) -> SpeculativeDecoder:
    """The decoder of ``config.speculative`` (an EngineConfig's): an n-gram proposer, or a draft-model proposer
    on ``draft_model`` with a KV pool of ``num_blocks`` blocks (the target's). Raises InvalidRequestError when a
    draft model is missing, or its vocabulary is larger than the target's, or it cannot hold max_model_len."""
    import dataclasses

    from sparrow.errors import InvalidRequestError

    spec = config.speculative
    if spec.method == "ngram":
        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    else:
        from sparrow.spec_decode.draft_model import DraftModelProposer

        if draft_model is None:
            raise InvalidRequestError("speculative_config method='draft_model': no draft model was loaded")
        dcfg = draft_model.config
        if dcfg.vocab_size > config.model.vocab_size:
            raise InvalidRequestError(f"draft model vocabulary ({dcfg.vocab_size} tokens) is larger than the "
                                      f"target's ({config.model.vocab_size}): drafts must be target tokens")
        if config.model.vocab_size - dcfg.vocab_size > MAX_DRAFT_VOCAB_PADDING:
            raise InvalidRequestError(
                f"draft model vocabulary ({dcfg.vocab_size} tokens) is smaller than the target's "
                f"({config.model.vocab_size}) by more than padding ({MAX_DRAFT_VOCAB_PADDING}): the draft must "
                "share the target's tokenizer")
        try:
            draft_config = config.replace(model=dcfg, speculative=None, lora=None,
                                          cache=dataclasses.replace(config.cache, num_blocks=num_blocks,
                                                                    kv_cache_memory=None))
        except InvalidRequestError as e:
            raise InvalidRequestError(f"draft model: {e}") from None
        proposer = DraftModelProposer(draft_config, draft_model)
    return SpeculativeDecoder(spec, proposer, config.max_model_len)
