"""The block manager and the scheduler alone: no model, no processes."""

from __future__ import annotations

import pytest
from specmesh.shared.core.sequence import Sequence, SequenceStatus
from specmesh.shared.engine.scheduler import Scheduler
from specmesh.shared.kvcache.block_manager import BlockManager
from specmesh.shared.sampling.params import SamplingParams

pytestmark = pytest.mark.unit

BLOCK = 4


def seq(name: str, tokens: list[int]) -> Sequence:
    return Sequence(name, list(tokens), SamplingParams())


def compute(manager: BlockManager, s: Sequence, num: int) -> None:
    """What a step does to `s`: `num` more tokens computed, full blocks published."""
    before = s.num_computed_tokens
    s.num_computed_tokens += num
    manager.seal(s, before)


def test_allocation_covers_every_token_and_free_returns_the_blocks() -> None:
    manager = BlockManager(num_blocks=8, block_size=BLOCK)
    s = seq("a", range(10))
    manager.allocate(s)
    assert len(s.block_table) == 3 and len(set(s.block_table)) == 3
    assert manager.num_free == 5
    manager.free(s)
    assert manager.num_free == 8 and s.block_table == [] and s.num_computed_tokens == 0


def test_sealed_full_blocks_are_reused_as_a_prefix_but_never_the_last_token() -> None:
    manager = BlockManager(num_blocks=8, block_size=BLOCK)
    first = seq("a", range(10))
    manager.allocate(first)
    compute(manager, first, 10)  # blocks 0 and 1 are full and sealed; block 2 is partial
    again = seq("b", [*range(8), 50, 51])
    manager.allocate(again)
    assert again.block_table[:2] == first.block_table[:2]
    assert again.num_computed_tokens == again.num_reused_tokens == 8
    assert manager.blocks[first.block_table[0]].ref_count == 2
    # A prompt that is exactly the cached blocks still computes its last token.
    exact = seq("c", range(8))
    manager.allocate(exact)
    assert exact.num_computed_tokens == 4 and exact.block_table[0] == first.block_table[0]


def test_unsealed_blocks_are_not_shared() -> None:
    manager = BlockManager(num_blocks=8, block_size=BLOCK)
    writing = seq("a", range(10))
    manager.allocate(writing)  # K/V not computed yet: nothing may reuse it
    reader = seq("b", range(10))
    manager.allocate(reader)
    assert set(reader.block_table).isdisjoint(writing.block_table)
    assert reader.num_computed_tokens == 0


def test_freed_blocks_keep_their_prefix_until_reused() -> None:
    manager = BlockManager(num_blocks=4, block_size=BLOCK)
    s = seq("a", range(9))
    manager.allocate(s)
    compute(manager, s, 9)
    manager.free(s)
    later = seq("b", range(9))
    assert manager.can_allocate(later)
    manager.allocate(later)
    assert later.num_computed_tokens == 8
    # Every block taken by another prompt: the cached prefix is gone.
    manager.free(later)
    other = seq("c", range(100, 116))
    manager.allocate(other)
    manager.free(other)
    last = seq("d", range(9))
    manager.allocate(last)
    assert last.num_computed_tokens == 0


def test_flush_forgets_free_prefixes_and_keeps_those_in_use() -> None:
    manager = BlockManager(num_blocks=8, block_size=BLOCK)
    done, running = seq("a", range(9)), seq("b", range(100, 109))
    for s in (done, running):
        manager.allocate(s)
        compute(manager, s, 9)
    manager.free(done)
    assert manager.flush() == 2  # done's two sealed blocks
    again = seq("c", range(9))
    manager.allocate(again)
    assert again.num_computed_tokens == 0
    shared = seq("d", range(100, 109))
    manager.allocate(shared)  # running's blocks still serve as a prefix
    assert shared.num_computed_tokens == 8


def test_can_allocate_counts_free_cached_blocks_and_the_reserve() -> None:
    manager = BlockManager(num_blocks=3, block_size=BLOCK)
    s = seq("a", range(9))
    assert manager.can_allocate(s) and not manager.can_allocate(s, reserve=1)
    manager.allocate(s)
    assert not manager.can_allocate(seq("b", [7]))
    assert manager.can_grow(s, 3) and not manager.can_grow(s, 4)


def scheduler(
    num_blocks: int,
    max_seqs: int = 8,
    budget: int = 64,
    policy: str = "fair",
    attention_tokens: int = 10**9,  # tokens only, unless a test weighs attention
) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BLOCK), max_seqs, budget, policy, attention_tokens)


def run(sched: Scheduler) -> list[tuple[str, int]]:
    """One step: schedule, then compute what was scheduled (and one new token where a
    sequence reached its end, as sampling would append)."""
    batch = sched.schedule()
    for s, num in batch:
        compute(sched.block_manager, s, num)
        if s.num_computed_tokens == len(s):
            s.token_ids.append(0)
    return [(s.request_id, num) for s, num in batch]


def test_long_prompts_are_prefilled_in_chunks_beside_decodes() -> None:
    sched = scheduler(num_blocks=32, budget=8)
    sched.add(seq("short", range(3)))
    assert run(sched) == [("short", 3)]
    sched.add(seq("long", range(20)))
    assert run(sched) == [("short", 1), ("long", 7)]
    assert run(sched) == [("short", 1), ("long", 7)]
    assert run(sched) == [("short", 1), ("long", 6)]
    assert run(sched) == [("short", 1), ("long", 1)]


def test_fair_lets_a_short_prompt_pass_a_long_one_and_fcfs_does_not() -> None:
    for policy, steps_to_first_token in (("fair", 1), ("fcfs", 4)):
        sched = scheduler(num_blocks=32, budget=8, policy=policy)
        sched.add(seq("long", range(30)))
        assert run(sched) == [("long", 8)]
        short = seq("short", range(40, 43))
        sched.add(short)
        steps = 0
        while short.num_computed_tokens < 3:
            batch = dict(run(sched))
            assert sum(batch.values()) <= 8
            steps += 1
        assert steps == steps_to_first_token, policy
    # Fair: the short one takes what it needs, the long one no more than that in the
    # step that gives the short one its first token (a short step); then the short one
    # decodes beside the long one's chunks.
    sched = scheduler(num_blocks=32, budget=8)
    sched.add(seq("long", range(30)))
    run(sched)
    sched.add(seq("short", range(40, 43)))
    assert run(sched) == [("long", 3), ("short", 3)]
    assert run(sched) == [("short", 1), ("long", 7)]


def test_a_long_prompts_chunks_shrink_as_its_attention_grows() -> None:
    """With attention weighed (A = 32 tokens of context cost one token's matmuls), no step
    costs more than the budget: a long prompt's chunks shrink as its context grows, and a
    short prompt arriving meanwhile is prefilled whole in the next step, beside no more
    of the long one than its own work."""
    sched = scheduler(num_blocks=64, budget=32, attention_tokens=32)
    long = seq("long", range(200))
    sched.add(long)
    sizes = []
    while long.num_uncomputed > 1:
        cached = long.num_computed_tokens
        step = dict(run(sched))
        decodes = len(step) - 1  # the short one, once prefilled
        assert step["long"] * (1 + cached / 32) <= 32 - decodes + 1e-6
        sizes.append(step["long"])
        if len(sizes) == 3:
            sched.add(seq("short", range(500, 505)))
            step = dict(run(sched))
            assert step == {"long": max(1, int(5 / (1 + sum(sizes) / 32))), "short": 5}
            beside_short = step["long"]
    assert sizes[0] == 32 and sizes == sorted(sizes, reverse=True) and sizes[-1] < 8
    assert sum(sizes) + beside_short == 200


def test_fair_shares_evenly_between_long_prompts() -> None:
    sched = scheduler(num_blocks=64, budget=9)
    for name in "abc":
        sched.add(seq(name, range(100, 120)))
    assert run(sched) == [("a", 3), ("b", 3), ("c", 3)]
    assert run(sched) == [("a", 3), ("b", 3), ("c", 3)]


def test_an_unknown_schedule_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="schedule policy"):
        scheduler(num_blocks=4, policy="random")


def test_lpm_admits_the_longest_cached_prefix_first() -> None:
    sched = scheduler(num_blocks=32, max_seqs=2, policy="lpm")
    sched.add(seq("first", range(9)))
    run(sched)  # its first two blocks are sealed in the prefix cache
    sched.remove(sched.running[0])
    sched.add(seq("other", range(50, 59)))
    sched.add(seq("again", range(9)))
    assert [name for name, _ in run(sched)] == ["again", "other"]


def test_admission_stops_at_max_num_seqs_and_keeps_arrival_order() -> None:
    sched = scheduler(num_blocks=32, max_seqs=2)
    for name in "abc":
        sched.add(seq(name, range(2)))
    assert [name for name, _ in run(sched)] == ["a", "b"]
    sched.remove(sched.running[0])
    assert [name for name, _ in run(sched)] == ["b", "c"]


def test_admission_keeps_a_block_of_headroom_per_running_sequence() -> None:
    sched = scheduler(num_blocks=4)
    sched.add(seq("a", range(4)))  # one block, full once computed
    run(sched)
    sched.add(seq("b", range(10, 18)))  # two blocks, a needs a second: 2 + 1 > 4 - 2
    assert [name for name, _ in run(sched)] == ["a"]
    assert [s.request_id for s in sched.waiting] == ["b"]


def test_out_of_blocks_preempts_the_newest_which_is_recomputed_later() -> None:
    sched = scheduler(num_blocks=4)
    a, b = seq("a", range(3)), seq("b", range(10, 13))
    sched.add(a)
    sched.add(b)
    steps = 0
    while not sched.num_preemptions and steps < 10:  # both grow until the cache is full
        run(sched)
        steps += 1
    assert steps == 7 and sched.num_preemptions == 1  # when a needed a third block
    assert len(a.block_table) == 3
    assert b.status is SequenceStatus.WAITING and b.block_table == []
    assert list(sched.waiting) == [b] and b.num_computed_tokens == 0
    sched.remove(a)
    # Recomputed, except its sealed first block, still in the prefix cache (its second
    # went to a, freed blocks being reused last-block-first).
    assert sched.schedule() == [(b, len(b) - 4)] and b.num_reused_tokens == 4


def test_remove_frees_running_and_drops_waiting() -> None:
    sched = scheduler(num_blocks=8, max_seqs=1)
    a, b = seq("a", range(5)), seq("b", range(5))
    sched.add(a)
    sched.add(b)
    run(sched)
    sched.remove(b)
    sched.remove(a)
    assert not sched.has_work() and sched.block_manager.num_free == 8
    assert a.status is b.status is SequenceStatus.FINISHED
