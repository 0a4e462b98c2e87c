"""Speculative decoding: proposers draft tokens, the target verifies them in one step of k + 1 rows.

This package is the engine's ``Speculator`` (``sparrow.engine.speculator``): ``decoder.SpeculativeDecoder``, made
by ``decoder.make_speculative_decoder``, which ``LLM`` hands to the engine; the engine never imports it.

Flow of one step (``SpeculativeDecoder``, called by the scheduler as it plans the step): for every running
  sequence in its decode phase, outside its back-off, the proposer drafts up to min(k, tokens left before
  max_tokens or max_model_len, minus the one the step samples anyway) tokens; the scheduler gives such a
  sequence k' + 1 rows (its last token and the k' drafts), all sampled; after the step ``accept`` takes the
  leading drafts equal to the tokens sampled at the row before each, the engine appends them plus the token
  sampled after the last accepted one, and the scheduler gives back the KV slots of the rejected drafts.

Verification is rejection sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", Alg. 1; Chen et al. 2023). Both proposers propose deterministically, so the draft distribution q at a
row is a point mass on the draft token x: the rule accepts x with probability min(1, p(x) / q(x)) = p(x) and
after a rejection draws from norm(max(p - q, 0)), which is p without x, renormalized. Drawing one token y from p
at the row and accepting iff y == x has exactly that law (P[y = x] = p(x); given y != x, y is distributed as p
restricted to the other tokens). So the sampler draws every verify row from the target's distribution, with
every sampling parameter applied (penalties and min_tokens count the drafts before the row as output), and the
first draw that differs from its draft is the correction token; a draw at the row after the last draft is the
bonus token. For greedy rows the draw is the argmax: the output is the one of plain decoding.
"""
