"""Large requests cut into batch-sized parts and joined again: the same result as scoring them whole."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from scoring_testkit import forward_atol
from tolerances import rounded_pair_tolerances

from models import BatchPlan, PreparedRequest, Scorer, ScorerConfig
from models.plan import join_results, order_of_places, split_request, token_runs
from schemas import ErrorCode, HiddenDType, ResultStatus, ScoreRequest, ScoreResult, Truncation


def test_token_runs_cut_at_the_budget_and_leave_an_oversized_entry_alone() -> None:
    assert list(token_runs([3, 3, 3, 10, 1, 1], 6)) == [range(0, 2), range(2, 3), range(3, 4), range(4, 6)]
    assert list(token_runs([], 6)) == []
    assert list(token_runs([7], 6)) == [range(0, 1)]


def test_token_runs_with_a_measure_cut_where_the_computed_tokens_reach_the_budget() -> None:
    sizes = [4, 4, 4, 4, 4]
    # The first three share 3 tokens each with the one before (a query computed once): 4 + 1 + 1.
    shared = {0: 0, 1: 3, 2: 3, 3: 0, 4: 0}
    asked: list[tuple[int, int]] = []

    def measure(start: int, stop: int) -> int:
        asked.append((start, stop))
        return sum(sizes[i] - (shared[i] if i > start else 0) for i in range(start, stop))

    # 0..2 compute 6 (12 held); with 3 they would compute 10; 3 and 4 hold 8 and need no measure.
    assert list(token_runs(sizes, 8, measure)) == [range(0, 3), range(3, 5)]
    # The whole first (it does not fit), then only where the plain sum goes over the budget.
    assert asked == [(0, 5), (0, 3), (0, 4)]
    assert list(token_runs([3, 3, 3, 10], 6, lambda a, b: sum([3, 3, 3, 10][a:b]))) == list(
        token_runs([3, 3, 3, 10], 6)
    )


def test_token_runs_measure_a_sequence_that_fits_whole_once() -> None:
    """A batch the worker closed within the budget, as measured, is not measured again entry by entry
    when the engine splits it (each measure finds the shared prefixes of every prompt so far)."""
    sizes = [9, 9, 9, 9]  # 36 held; each after the first shares 8 with the one before: 9 + 1 + 1 + 1
    asked: list[tuple[int, int]] = []

    def measure(start: int, stop: int) -> int:
        asked.append((start, stop))
        return 9 + (stop - start - 1)

    assert list(token_runs(sizes, 16, measure)) == [range(0, 4)]
    assert asked == [(0, 4)]
    assert list(token_runs(sizes, 16)) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]


def _linear_runs(sizes: Sequence[int], budget: int, measure: Any) -> list[range]:
    """The cut entry by entry, measuring every entry past the plain sum: what token_runs must equal."""
    out, start, tokens = [], 0, 0
    for index, size in enumerate(sizes):
        if index > start and tokens + size > budget and measure(start, index + 1) > budget:
            out.append(range(start, index))
            start, tokens = index, 0
        tokens += size
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def test_token_runs_find_how_far_a_run_reaches_in_few_measures() -> None:
    """Past the plain sum, a run's reach is found by doubling steps then halving: the cuts of measuring
    every entry, in a logarithmic number of measures per run."""
    rng = np.random.default_rng(4)
    for _ in range(50):
        sizes = [int(s) for s in rng.integers(1, 40, int(rng.integers(1, 300)))]
        own = [max(1, int(s * f)) for s, f in zip(sizes, rng.random(len(sizes)), strict=True)]
        asked: list[tuple[int, int]] = []

        def measure(start: int, stop: int, own: list[int] = own, asked: list[Any] = asked) -> int:
            asked.append((start, stop))
            return sum(own[start:stop])  # each entry adds what it computes of its own: grows with stop

        budget = int(rng.integers(40, 400))
        runs = list(token_runs(sizes, budget, measure))
        measured = len(asked)
        assert runs == _linear_runs(sizes, budget, measure)
        # Per run: one where the plain sum goes over, then doubling steps and halving to its end.
        longest = max(len(run) for run in runs)
        assert measured <= 1 + len(runs) * (2 * int(np.log2(longest)) + 5)


def test_a_long_run_past_the_plain_sum_is_found_in_few_measures() -> None:
    """Best of N at its best: every entry holds 30 tokens and computes 2 of its own, so a 300-token run
    reaches 150 entries, 140 past the plain sum; measured entry by entry that would be 140 measures a run."""
    asked: list[tuple[int, int]] = []

    def measure(start: int, stop: int) -> int:
        asked.append((start, stop))
        return 2 * (stop - start)

    runs = list(token_runs([30] * 600, 300, measure))
    assert runs == [range(k, k + 150) for k in range(0, 600, 150)]
    assert len(asked) <= 1 + 4 * (2 * 8 + 5)


def test_grouped_runs_cut_as_runs_do_measuring_each_group_once() -> None:
    """Requests in grouped order (best of N, interleaved then grouped) cut by grouped_runs as by runs,
    which measures every prompt of a run again at each try."""
    rng = np.random.default_rng(8)
    plan = BatchPlan(8)
    prompts = [tuple(int(t) for t in rng.integers(4, 9000, int(rng.integers(20, 80)))) for _ in range(12)]

    def request(k: int, prompt: tuple[int, ...]) -> PreparedRequest:
        answer = tuple(int(t) for t in rng.integers(4, 9000, int(rng.integers(3, 30))))
        return PreparedRequest(ScoreRequest(f"r{k}", items=(prompt + answer,)), (prompt + answer,), 0.0)

    interleaved = [request(k, prompts[k % 12]) for k in range(96)]
    places = plan.grouped_places(interleaved)
    order = order_of_places(places)
    ordered = [interleaved[k] for k in order]
    for budget in (200, 500, 1500):
        grouped = list(plan.grouped_runs(ordered, [places[k] for k in order], budget))
        assert grouped == list(plan.runs(ordered, budget))
        assert all(plan.tokens([p for r in ordered[run.start : run.stop] for p in r.prompts]) <= budget
                   for run in grouped if len(run) > 1)  # fmt: skip


def test_a_request_whose_items_share_their_query_is_cut_by_what_it_computes() -> None:
    query = tuple(range(4, 54))  # 50 tokens, computed once per part when parts share it
    request = ScoreRequest("r", query=query, items=tuple((7 + i,) * 5 for i in range(10)))
    prepared = PreparedRequest(request, tuple(query + item for item in request.items), tokenize_s=0.1)
    assert prepared.num_tokens == 550

    def shared_once(prompts: Sequence[tuple[int, ...]]) -> int:
        return 50 + 5 * len(prompts) if len(prompts) > 1 else len(prompts[0])

    assert split_request(prepared, 100, shared_once) == [prepared]  # 100 computed, 550 held
    parts = split_request(prepared, 70, shared_once)  # 50 + 5 x 4
    assert [len(part.prompts) for part in parts] == [4, 4, 2]
    assert [part.tokenize_s for part in parts] == [0.1, 0.0, 0.0]
    assert len(split_request(prepared, 100)) == 10  # by the lengths alone: one item per part


@pytest.mark.parametrize("truncate", [Truncation.NONE, Truncation.ITEM_RIGHT])
def test_parts_joined_equal_the_whole_request(tiny_llama_dir: Path, truncate: Truncation) -> None:
    scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    request = ScoreRequest(
        "big",
        query="the query",
        items=tuple(f"item {i} " + "x " * (i % 5) for i in range(40)),
        return_pooled_hidden_states=True,
        hidden_states_dtype=HiddenDType.FLOAT16,
        truncate=truncate,
        metadata={"k": 1},
    )
    prepared = scorer.prepare(request)
    assert isinstance(prepared, PreparedRequest)
    parts = split_request(prepared, 64)
    assert len(parts) > 3 and all(p.num_tokens <= 64 for p in parts)
    assert sum(len(p.prompts) for p in parts) == 40
    (whole,) = scorer.score_prepared([prepared])
    joined = join_results(scorer.score_prepared(parts))
    assert joined.request_id == "big" and joined.metadata == {"k": 1}
    assert joined.prompt_tokens == whole.prompt_tokens and joined.truncated_tokens == whole.truncated_tokens
    # The parts run in other batches than the whole: two float32 forwards of the same prompts, the
    # model's chain of sums for the longest of them (forward_atol).
    longest = max(len(p) for p in prepared.prompts)
    scores_bound = forward_atol(tiny_llama_dir, np.array(whole.scores), longest=longest)
    np.testing.assert_allclose(np.array(joined.scores), np.array(whole.scores), atol=scores_bound, rtol=0)
    assert joined.pooled_hidden_states is not None and whole.pooled_hidden_states is not None
    for got, want in zip(joined.pooled_hidden_states, whole.pooled_hidden_states, strict=True):
        # The float32 states within forward_atol (at their scale, at least 1, read off the rounded ones
        # widened by float16's step), each then rounded to float16 (u = 2^-11).
        scale = np.abs(want.to_numpy().astype(np.float64)) * (1 + 2.0**-10)
        atol, rtol = rounded_pair_tolerances(
            torch.float16, forward_atol(tiny_llama_dir, scale, longest=longest)
        )
        np.testing.assert_allclose(got.to_numpy(), want.to_numpy(), atol=atol, rtol=rtol)


def test_a_split_request_keeps_its_token_outputs_and_head_scores(tiny_llama_dir: Path) -> None:
    """A request larger than a batch is cut into parts: each part reads its own items' positions, and the
    joined result carries every item's token outputs (and extra heads' scores) in item order."""
    scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    request = ScoreRequest(
        "big", query="the query", items=tuple(f"item {i} " + "x " * (i % 5) for i in range(40)),
        token_outputs="tokens", token_range=(-2, None), return_token_hidden_states=True,
    )  # fmt: skip
    prepared = scorer.prepare(request)
    assert isinstance(prepared, PreparedRequest) and prepared.positions is not None
    parts = split_request(prepared, 64)
    assert len(parts) > 3
    assert all(p.positions is not None and len(p.positions) == len(p.prompts) for p in parts)
    (whole,) = scorer.score_prepared([prepared])
    joined = join_results(scorer.score_prepared(parts))
    assert joined.token_positions == whole.token_positions and len(joined.token_positions or ()) == 40
    assert joined.token_scores is not None and whole.token_scores is not None
    assert joined.token_hidden_states is not None and len(joined.token_hidden_states) == 40
    longest = max(len(p) for p in prepared.prompts)
    for got, want in zip(joined.token_scores, whole.token_scores, strict=True):
        bound = forward_atol(tiny_llama_dir, want.to_numpy(), longest=longest)  # two float32 forwards
        np.testing.assert_allclose(got.to_numpy(), want.to_numpy(), atol=bound, rtol=0)
    heads = [
        ScoreResult("h", ResultStatus.OK, scores=((1.0,),), head_scores={"safety": ((0.5, 0.5),)}),
        ScoreResult(
            "h", ResultStatus.OK, scores=((2.0,), (3.0,)), head_scores={"safety": ((0.1, 0.9), (0.2, 0.8))}
        ),
    ]
    assert join_results(heads).head_scores == {"safety": ((0.5, 0.5), (0.1, 0.9), (0.2, 0.8))}


def test_a_failed_part_fails_the_whole_request() -> None:
    ok = ScoreResult("r", ResultStatus.OK, scores=((1.0,),))
    failed = ScoreResult.failure("r", ErrorCode.EXPIRED, "late")
    assert join_results([ok, failed, ok]) is failed


# Best-of-N requests as an RL trainer sends them: a prompt's responses one after another. Entry: (prompt,
# tokens); the entries of one prompt share its first PREFIX tokens, which a run computes once.
PREFIX = 30
BEST_OF = [("a", 32)] * 4 + [("b", 32)] * 4 + [("c", 32)] * 4


def computed(entries: Sequence[tuple[str, int]]) -> int:
    prompts = [prompt for prompt, _ in entries]
    return sum(size for _, size in entries) - sum((prompts.count(p) - 1) * PREFIX for p in set(prompts))


def best_of_runs(
    entries: Sequence[tuple[str, int]], budget: int, asked: list[tuple[int, int]]
) -> list[range]:
    def measure(start: int, stop: int) -> int:
        return computed(entries[start:stop])

    def joins(earlier: int, later: int) -> bool:
        asked.append((earlier, later))
        return entries[earlier][0] == entries[later][0]

    return list(token_runs([size for _, size in entries], budget, measure, joins))


def test_a_cut_keeps_the_requests_that_share_a_prompt_with_the_next_one_together() -> None:
    """A run that would close after three of prompt b's four requests leaves them to the next run with the
    fourth: b's prompt is computed once (38 tokens), not in both runs (38 + 32 + ...)."""
    asked: list[tuple[int, int]] = []
    # a's 4 compute 38; with b1..b3 74; b4 would take the run to 76 > 75.
    runs = best_of_runs(BEST_OF, 75, asked)
    assert runs == [range(0, 4), range(4, 8), range(8, 12)]
    assert sum(computed(BEST_OF[r.start : r.stop]) for r in runs) == 3 * 38
    assert asked[:4] == [(6, 7), (5, 7), (4, 7), (3, 7)]  # walked back from the cut to the other prompt
    # Without the rule the same budget cuts b in two, computing its prompt twice.
    plain = list(token_runs([size for _, size in BEST_OF], 75, lambda a, b: computed(BEST_OF[a:b])))
    assert plain == [range(0, 7), range(7, 12)]
    assert sum(computed(BEST_OF[r.start : r.stop]) for r in plain) == 74 + 70


def test_a_cut_moves_nothing_where_it_would_not_save_or_fit() -> None:
    asked: list[tuple[int, int]] = []
    one_prompt = [("a", 32)] * 8  # 30 + 2 x 8 = 46: a run keeps one entry at least, whatever it shares
    assert best_of_runs(one_prompt, 40, asked) == [range(0, 5), range(5, 8)]
    # The entries sharing with the next do not fit with it: the run closes whole.
    long_tail = [("x", 5), ("a", 70), ("a", 70)]  # a's two compute 110
    assert best_of_runs(long_tail, 100, []) == [range(0, 2), range(2, 3)]
    # Moving them would save nothing: 60 + 90 is what 90 + 60 computes.
    no_gain = [("x", 60), ("a", 60), ("a", 60), ("a", 60)]
    assert best_of_runs(no_gain, 100, []) == [range(0, 1), range(1, 3), range(3, 4)]
    # A run computing exactly the budget has closed before the next entry came (as the worker's batcher
    # closes it): nothing moves out of it.
    full = [("x", 36), ("a", 32), ("a", 32)]  # 36 + 32 + 2 = 70
    assert best_of_runs([*full, ("a", 32)], 70, []) == [range(0, 3), range(3, 4)]
    # Nothing shared: each cut asks once whether the last entry shares with the next.
    asked.clear()
    distinct = [(str(i), 32) for i in range(6)]
    assert best_of_runs(distinct, 70, asked) == [range(0, 2), range(2, 4), range(4, 6)]
    assert asked == [(1, 2), (3, 4)]


def test_large_turns_take_turns_with_ordinary_batches_an_ordinary_one_first() -> None:
    """The order a backlog runs in: one of each in turn, the longer list's rest at the end."""
    from models.plan import take_turns

    assert take_turns(["s1", "s2", "s3"], ["L1"]) == ["s1", "L1", "s2", "s3"]
    assert take_turns(["s1"], ["L1", "L2", "L3"]) == ["s1", "L1", "L2", "L3"]
    assert take_turns([], ["L1", "L2"]) == ["L1", "L2"]
    assert take_turns(["s1", "s2"], ["L1", "L2"]) == ["s1", "L1", "s2", "L2"]
