"""Scheduler unit tests: token budget, decode before prefill, max_num_seqs, preemption order.
The model is simulated: each step the scheduled rows are marked computed and a sampling row appends a
token (``advance``), as Engine.step does. Oracle: the rules in scheduler.py's docstring."""
from __future__ import annotations

from sparrow.config import SchedulerConfig
from sparrow.engine.block_manager import BlockManager
from sparrow.engine.scheduler import Scheduler
from sparrow.engine.sequence import Sequence, SequenceStatus
from sparrow.lora.request import LoRARequest
from sparrow.sampling_params import SamplingParams


def make(num_blocks=64, block_size=4, budget=16, max_seqs=8, prefix=False, max_loras=None):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget), bm,
                     max_loras=max_loras), bm


_n = iter(range(10**6))


def seq(n_prompt: int, max_tokens: int = 100, lora_id: int = 0) -> Sequence:
    """``lora_id``: the adapter's lora_int_id (0: the base model; the folder is never read here)."""
    i = next(_n)
    lora = LoRARequest(f"a{lora_id}", lora_id, f"/adapters/{lora_id}") if lora_id else None
    return Sequence(str(i), 0, [(i * 7 + j) % 200 for j in range(n_prompt)], SamplingParams(max_tokens=max_tokens),
                    {2}, lora_request=lora)


def advance(sched: Scheduler, out) -> None:
    """What the engine does after the model ran: rows computed, one token sampled per finished prefill."""
    for item in out:
        samples = item.samples
        item.seq.num_computed_tokens += item.num_new_tokens
        sched.bm.commit_computed(item.seq)
        if samples:
            item.seq.output_token_ids.append(5)


def rows(out):
    return [(item.seq, item.num_new_tokens) for item in out]


def test_token_budget_is_respected_and_filled():
    sched, _ = make(budget=8)
    seqs = [seq(10), seq(10), seq(3)]
    for s in seqs:
        sched.add(s)
    history = []
    while any(len(s.output_token_ids) < 3 for s in seqs):
        out = sched.schedule()
        total = sum(n for _, n in rows(out))
        pending = sum(s.num_tokens - s.num_computed_tokens for s in seqs if s.status is not SequenceStatus.FINISHED)
        assert total == min(8, pending), history  # never above the budget, never idle while work is left
        history.append([(s.request_id, n) for s, n in rows(out)])
        advance(sched, out)
        for s in seqs:
            if len(s.output_token_ids) >= 3 and not s.is_finished:
                sched.finish(s)
    a, b, c = (s.request_id for s in seqs)
    assert history[0] == [(a, 8)]
    assert history[1] == [(a, 2), (b, 6)]  # a's last chunk first, then the next one admitted
    assert history[2] == [(a, 1), (b, 4), (c, 3)]


def test_decode_rows_go_before_new_prefills():
    sched, _ = make(budget=8)
    a, b = seq(4), seq(4)
    sched.add(a)
    sched.add(b)
    advance(sched, sched.schedule())  # both prefilled in one step of 8 rows
    assert a.output_token_ids and b.output_token_ids
    c = seq(30)
    sched.add(c)
    out = rows(sched.schedule())
    assert out == [(a, 1), (b, 1), (c, 6)]


def test_unfinished_prefill_continues_before_admission():
    sched, _ = make(budget=8)
    a, b = seq(20), seq(4)
    sched.add(a)
    sched.add(b)
    advance(sched, sched.schedule())
    assert rows(sched.schedule()) == [(a, 8)]  # b waits: the running chunk takes the whole budget


def test_max_num_seqs():
    sched, _ = make(budget=100, max_seqs=2)
    seqs = [seq(3) for _ in range(4)]
    for s in seqs:
        sched.add(s)
    out = rows(sched.schedule())
    assert [s for s, _ in out] == seqs[:2]
    assert len(sched.running) == 2 and list(sched.waiting) == seqs[2:]
    advance(sched, [x for x in sched.schedule()])
    sched.finish(seqs[0])
    out = rows(sched.schedule())
    assert [s for s, _ in out] == [seqs[1], seqs[2]]



def test_adapter_slots_hold_back_adapters_in_order_not_the_base_model():
    """max_loras=1: a sequence whose adapter finds no free slot waits, and so do the adapter sequences behind it
    (first come, first served: later requests of the running adapter do not keep it running past the waiting
    one), while base-model sequences, which take no slot, are admitted past it."""
    sched, _ = make(budget=100, max_loras=1)
    a1, b1, base, a2 = seq(3, lora_id=1), seq(3, lora_id=2), seq(3), seq(3, lora_id=1)
    for s in (a1, b1, base, a2):
        sched.add(s)

    def step():
        out = sched.schedule()
        advance(sched, out)
        return [s for s, _ in rows(out)]

    assert step() == [a1, base]
    assert list(sched.waiting) == [b1, a2]
    assert step() == [a1, base]
    sched.finish(a1)
    assert step() == [base, b1]  # adapter 2 takes the slot before a2
    assert list(sched.waiting) == [a2]
    sched.finish(b1)
    assert step() == [base, a2]


def test_preemption_takes_the_latest_running_and_requeues_it_first():
    # 6 blocks of 4 tokens; three sequences of 8 prompt tokens hold 2 blocks each
    sched, bm = make(num_blocks=6, block_size=4, budget=64)
    a, b, c, d = seq(8), seq(8), seq(8), seq(3)
    for s in (a, b, c):
        sched.add(s)
    advance(sched, sched.schedule())  # 3 x 8 rows, 1 token sampled each -> 9 tokens, all blocks used
    assert bm.num_free_blocks == 0
    sched.add(d)
    out = rows(sched.schedule())  # a's decode needs a 3rd block: c (the last admitted) is preempted
    assert sched.num_preemptions == 1
    assert c.status is SequenceStatus.WAITING and c.block_table == [] and c.num_computed_tokens == 0
    assert list(sched.waiting) == [c, d]  # the preempted sequence goes back in front
    assert out == [(a, 1), (b, 1)]  # c's two blocks went to a and b; d does not fit
    assert c.output_token_ids == [5]  # its output so far is kept and will be prefilled again


def test_preemption_frees_only_what_is_needed():
    sched, bm = make(num_blocks=4, block_size=4, budget=64)
    a, b = seq(8), seq(7)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    assert rows(first) == [(a, 8), (b, 7)] and bm.num_free_blocks == 0
    advance(sched, first)
    # a (9 tokens) needs a 3rd block: b is preempted; b (8 tokens) does not fit in the one block left
    out = rows(sched.schedule())
    assert out == [(a, 1)] and list(sched.waiting) == [b] and sched.num_preemptions == 1
    assert bm.num_free_blocks == 1


def test_a_sequence_that_cannot_grow_preempts_itself():
    sched, bm = make(num_blocks=3, block_size=4, budget=64)
    a, b = seq(7), seq(4)
    sched.add(a)
    sched.add(b)
    advance(sched, sched.schedule())  # a: 8 tokens in 2 blocks, b: 5 tokens, 1 block held
    out = rows(sched.schedule())  # a's row fits; b needs a 2nd block and is the latest: it steps back itself
    assert out == [(a, 1)]
    assert list(sched.waiting) == [b] and b.block_table == [] and sched.num_preemptions == 1
    assert a.status is SequenceStatus.RUNNING


def test_readmitted_sequence_recomputes_prompt_and_output():
    sched, bm = make(num_blocks=4, block_size=4, budget=64)
    a, b = seq(8), seq(7)
    sched.add(a)
    sched.add(b)
    advance(sched, sched.schedule())
    advance(sched, sched.schedule())  # preempts b
    assert b.status is SequenceStatus.WAITING and b.output_token_ids == [5]
    sched.finish(a)
    out = rows(sched.schedule())
    assert out == [(b, 8)]  # 7 prompt tokens + the 1 generated before preemption
    assert b.status is SequenceStatus.RUNNING and len(b.block_table) == 2


def test_finish_frees_blocks_from_either_queue():
    sched, bm = make(num_blocks=8, block_size=4, budget=4)
    a, b = seq(4), seq(9)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    assert a in sched.running and b in sched.waiting
    sched.finish(b)
    sched.finish(a)
    assert not sched.has_work() and bm.num_free_blocks == 8
    assert a.is_finished and b.is_finished


def test_prefix_hit_starts_after_the_cached_tokens():
    sched, bm = make(num_blocks=16, block_size=4, budget=64, prefix=True)
    a = seq(13)
    sched.add(a)
    advance(sched, sched.schedule())
    b = Sequence("b", 0, list(a.prompt_token_ids), SamplingParams(), {2})
    sched.add(b)
    out = rows(sched.schedule())
    assert out == [(a, 1), (b, 1)]  # 12 of b's 13 tokens were cached
    assert b.num_cached_prefix_tokens == 12 and b.block_table[:3] == a.block_table[:3]
