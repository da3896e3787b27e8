"""TokenBudgetBatcher: batches close on the token budget, the request count and the maximum wait."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from models.plan import token_runs
from worker.batcher import Batch, TokenBudgetBatcher


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(
    max_tokens: int = 10, max_requests: int = 4, max_wait_s: float = 0.5
) -> tuple[TokenBudgetBatcher[str], FakeClock]:
    clock = FakeClock()
    return TokenBudgetBatcher(max_tokens, max_requests, max_wait_s, clock=clock), clock


def test_closes_before_the_item_that_would_exceed_the_budget() -> None:
    batcher, _ = make(max_tokens=10)
    assert batcher.add("a", 4) == []
    assert batcher.add("b", 4) == []
    closed = batcher.add("c", 3)  # 11 > 10: a and b leave, c opens the next batch
    assert closed == [Batch(("a", "b"), 8)]
    assert len(batcher) == 1 and batcher.pending_tokens == 3


def test_closes_when_the_budget_is_met_exactly() -> None:
    batcher, _ = make(max_tokens=10)
    batcher.add("a", 6)
    assert batcher.add("b", 4) == [Batch(("a", "b"), 10)]
    assert len(batcher) == 0


def test_closes_on_request_count() -> None:
    batcher, _ = make(max_tokens=1000, max_requests=3)
    assert batcher.add("a", 1) == [] and batcher.add("b", 1) == []
    assert batcher.add("c", 1) == [Batch(("a", "b", "c"), 3)]


def test_oversized_item_forms_a_batch_alone_after_the_open_one() -> None:
    batcher, _ = make(max_tokens=10)
    batcher.add("a", 3)
    closed = batcher.add("huge", 25)
    assert closed == [Batch(("a",), 3), Batch(("huge",), 25)]
    assert len(batcher) == 0
    assert batcher.add("alone", 11) == [Batch(("alone",), 11)]


def test_max_wait_counts_from_the_first_item() -> None:
    batcher, clock = make(max_wait_s=0.5)
    assert batcher.due_in() is None and batcher.take_due() is None
    batcher.add("a", 1)
    clock.now += 0.3
    batcher.add("b", 1)  # a later item does not extend the wait
    # Float64 clock arithmetic near 100 s rounds by about 1e-14 s per step: pytest.approx's relative 1e-6
    # covers it and stays far below any wrong wait (milliseconds).
    assert batcher.due_in() == pytest.approx(0.2)
    assert batcher.take_due() is None
    clock.now += 0.2
    assert batcher.due_in() == 0.0
    assert batcher.take_due() == Batch(("a", "b"), 2)
    assert batcher.due_in() is None
    # The next batch's clock starts at its own first item.
    clock.now += 10
    batcher.add("c", 1)
    assert batcher.due_in() == pytest.approx(0.5)


def test_zero_wait_is_due_at_once_and_flush_returns_the_rest() -> None:
    batcher, _ = make(max_wait_s=0.0)
    batcher.add("a", 1)
    assert batcher.take_due() == Batch(("a",), 1)
    batcher.add("b", 2)
    assert batcher.flush() == Batch(("b",), 2)
    assert batcher.flush() is None


def test_rejects_invalid_limits_and_negative_tokens() -> None:
    with pytest.raises(ValueError):
        TokenBudgetBatcher(0, 1, 0.1)
    with pytest.raises(ValueError):
        TokenBudgetBatcher(1, 0, 0.1)
    with pytest.raises(ValueError):
        TokenBudgetBatcher(1, 1, -1)
    batcher, _ = make()
    with pytest.raises(ValueError):
        batcher.add("a", -1)


@given(
    tokens=st.lists(st.integers(min_value=0, max_value=40), max_size=60),
    max_tokens=st.integers(min_value=1, max_value=30),
    max_requests=st.integers(min_value=1, max_value=8),
)
def test_batches_keep_order_and_respect_limits(tokens: list[int], max_tokens: int, max_requests: int) -> None:
    batcher, _ = make(max_tokens=max_tokens, max_requests=max_requests)
    batches: list[Batch[int]] = []
    for index, count in enumerate(tokens):
        batches += batcher.add(index, count)  # type: ignore[arg-type]
    rest = batcher.flush()
    if rest is not None:
        batches.append(rest)
    assert [i for b in batches for i in b.items] == list(range(len(tokens)))  # nothing lost, order kept
    for batch in batches:
        assert batch.tokens == sum(tokens[i] for i in batch.items)
        assert 1 <= len(batch.items) <= max_requests
        assert batch.tokens <= max_tokens or len(batch.items) == 1


def test_a_measure_lets_items_that_share_work_fill_the_batch() -> None:
    """With a measure (prompts sharing a prefix computed once), an item that would take the plain sum over
    the budget is measured with the batch, and joins it when what they compute together still fits."""
    measured: list[tuple[str, ...]] = []

    def measure(items: list[str]) -> int:  # 4 per item alone; 1 more per further item of its group
        measured.append(tuple(items))
        groups = {item[0] for item in items}
        return sum(3 + sum(item[0] == group for item in items) for group in groups)

    batcher: TokenBudgetBatcher[str] = TokenBudgetBatcher(10, 8, 0.5, clock=FakeClock(), measure=measure)
    assert batcher.add("a1", 4) == [] and batcher.add("a2", 4) == []
    assert measured == []  # the plain sum fits: nothing to measure
    assert batcher.add("a3", 4) == [] and batcher.pending_tokens == 6  # 12 held, 6 computed
    assert batcher.add("b1", 4) == [Batch(("a1", "a2", "a3", "b1"), 10)]  # exactly the budget
    batcher.add("c1", 4)
    batcher.add("c2", 4)
    assert batcher.add("d1", 4) == [] and batcher.pending_tokens == 9
    assert batcher.add("d2", 4) == [Batch(("c1", "c2", "d1", "d2"), 10)]
    batcher.add("e1", 4)
    batcher.add("f1", 4)
    assert batcher.add("g1", 4) == [Batch(("e1", "f1"), 8)]  # nothing shared: 12 > 10
    assert batcher.pending_tokens == 4 and len(batcher) == 1


# Best-of-N requests as an RL trainer sends them: item (prompt, response length), a prompt's responses one
# after another. Every prompt is PROMPT tokens; the items of one prompt compute it once in a batch.
PROMPT = 30


def _best_of_measure(items: list[tuple[str, int]]) -> int:
    prompts = [prompt for prompt, _ in items]
    held = sum(PROMPT + response for _, response in items)
    return held - sum((prompts.count(p) - 1) * PROMPT for p in set(prompts))


def _same_prompt(earlier: tuple[str, int], later: tuple[str, int]) -> bool:
    return earlier[0] == later[0]


def test_requests_sharing_a_prompt_with_the_item_that_closes_the_batch_move_with_it() -> None:
    """The batch that b's fourth response closes leaves b's first three open with it, so b's prompt is
    computed in one batch, not in two; the items moved keep their wait's start."""
    clock = FakeClock()
    batcher: TokenBudgetBatcher[tuple[str, int]] = TokenBudgetBatcher(
        75, 100, 0.5, clock=clock, measure=_best_of_measure, joins=_same_prompt
    )
    a, b = [("a", 2)] * 4, [("b", 2)] * 4
    for item in a + b[:3]:
        assert batcher.add(item, 32) == []
        clock.now += 0.01
    assert batcher.pending_tokens == 74  # a: 30 + 4 x 2; b so far: 30 + 3 x 2
    assert batcher.add(b[3], 32) == [Batch(tuple(a), 38)]
    assert len(batcher) == 4 and batcher.pending_tokens == 38
    assert batcher.due_in() == pytest.approx(0.5 - 0.07)  # a's first opened the batch at 100.0; now 100.07
    assert batcher.flush() == Batch(tuple(b), 38)
    # Without `joins`, the same items cut b's requests apart.
    plain: TokenBudgetBatcher[tuple[str, int]] = TokenBudgetBatcher(
        75, 100, 0.5, clock=clock, measure=_best_of_measure
    )
    assert [batch for item in a + b for batch in plain.add(item, 32)] == [Batch(tuple(a + b[:3]), 74)]


def test_the_batcher_and_the_engines_split_cut_best_of_n_requests_alike() -> None:
    """The worker's batcher and models.plan.token_runs (the engine's split, the benchmarks' cut) follow
    one rule: the same arrivals give the same batches."""
    counts, responses = (4, 3, 5, 2, 6, 1, 4, 8), (7, 2, 19, 11, 4, 15, 9)
    items = [
        (prompt, responses[(n + i) % len(responses)])
        for i, (prompt, count) in enumerate(zip("abcdefgh", counts, strict=True))
        for n in range(count)
    ]
    sizes = [PROMPT + response for _, response in items]
    moved = 0
    for budget in range(60, 200, 10):
        batcher: TokenBudgetBatcher[tuple[str, int]] = TokenBudgetBatcher(
            budget, 1000, 0.5, clock=FakeClock(), measure=_best_of_measure, joins=_same_prompt
        )
        batches = [
            batch.items for item, size in zip(items, sizes, strict=True) for batch in batcher.add(item, size)
        ]
        rest = batcher.flush()
        batches += [rest.items] if rest is not None else []

        def measure(start: int, stop: int) -> int:
            return _best_of_measure(items[start:stop])

        runs = token_runs(sizes, budget, measure, lambda k, index: _same_prompt(items[k], items[index]))
        assert batches == [tuple(items[run.start : run.stop]) for run in runs], budget
        moved += batches != [tuple(items[run.start : run.stop]) for run in token_runs(sizes, budget, measure)]
    assert moved >= 7  # at half the budgets or more, some cut kept a prompt's requests together
