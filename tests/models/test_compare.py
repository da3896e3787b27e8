"""Preferences between a request's items (`compare`) against HF's own float32 rewards: Bradley-Terry for a
pair, the ranking and Plackett-Luce best-item probabilities for many, on a decoder classifier, a
cross-encoder and a judge; the reward column rule and its refusals; the prompt computed once."""

from __future__ import annotations

import dataclasses
import math
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from scoring_testkit import hf_judge_reference, hf_reference
from tolerances import assert_within, forward_atol
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from models import Scorer, ScorerConfig, write_tiny_model
from models.compare import RewardRule, answer, best_probability, preference, ranking
from models.interface import BatchStats
from models.plan import join_results
from models.prepare import PreparedRequest, PromptError
from schemas import Compare, ErrorCode, ScoreRequest, ScoreResult

QUERY = "Question: which of these answers to the question about the library's opening hours is the best one? "
ITEMS = (
    "It opens at nine.",
    "The library is closed on Sundays and public holidays.",
    "Nine o'clock, every day but Sunday.",
    "I do not know.",
)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _prompts(scorer: Scorer, request: ScoreRequest) -> list[tuple[int, ...]]:
    prepared = scorer.prepare(request)
    assert isinstance(prepared, PreparedRequest), prepared
    return list(prepared.prompts)


def _check_answer(result: ScoreResult, expected: np.ndarray, atol: float, compare: Compare) -> None:
    """`result`'s rewards within `atol` of HF's `expected` rewards, and its answer within what that moves:
    sigmoid is 1/4-Lipschitz, so a difference of two rewards off by atol each moves P by at most atol / 2;
    rewards each off by at most atol move a Plackett-Luce probability p to within [p e^-2atol, p e^2atol]."""
    assert result.ok, result.error
    assert result.rewards is not None
    assert_within(result.rewards, expected, atol, "rewards")
    if compare is Compare.PAIRWISE:
        assert result.preference is not None and result.ranking is None
        assert_within(result.preference, _sigmoid(expected[0] - expected[1]), atol / 2, "preference")
        return
    assert result.preference is None and result.best_probability is not None
    order = sorted(range(len(expected)), key=lambda i: (-expected[i], i))
    gaps = np.abs(np.diff(np.sort(expected)))
    # The order is only defined by the reference where no two rewards are within both sides' error.
    assert gaps.min() > 2 * atol, "the test's items score too close together to order; choose others"
    assert result.ranking == tuple(order)
    shifted = np.exp(expected - expected.max())
    want = shifted / shifted.sum()
    assert_within(result.best_probability, want, want * math.expm1(2 * atol), "best_probability")


@pytest.mark.parametrize("compare", [Compare.PAIRWISE, Compare.RANK])
def test_decoder_classifier_matches_hf_rewards(
    llama_scorer: Scorer, tiny_llama_dir: Path, compare: Compare
) -> None:
    items = ITEMS[:2] if compare is Compare.PAIRWISE else ITEMS
    request = ScoreRequest("c", items=items, query=QUERY, compare=compare)
    (result,) = llama_scorer.score([request])
    prompts = _prompts(llama_scorer, request)
    expected = hf_reference(tiny_llama_dir, prompts).logits[:, 0].astype(np.float64)
    atol = forward_atol(tiny_llama_dir, expected, longest=max(map(len, prompts)))
    _check_answer(result, expected, atol, compare)
    assert result.scores == tuple((r,) for r in result.rewards or ())  # one label: the reward is the score


def test_several_labels_need_a_column_and_give_its_log_odds(three_label_dir: Path) -> None:
    scorer = Scorer(three_label_dir, ScorerConfig(device="cpu"))
    fields = {"items": ITEMS, "query": QUERY, "compare": "rank"}
    (missing, past, asked) = scorer.score(
        [
            ScoreRequest("a", **fields),  # type: ignore[arg-type]
            ScoreRequest("b", reward_column=3, **fields),  # type: ignore[arg-type]
            ScoreRequest("c", reward_column=1, apply_softmax=True, **fields),  # type: ignore[arg-type]
        ]
    )
    assert missing.error is not None and missing.error.code is ErrorCode.REWARD_COLUMN_REQUIRED
    # The copies intake processes prepare with refuse it the same way.
    copy = pickle.loads(pickle.dumps(scorer.prompt_builder))
    with pytest.raises(PromptError) as refused:
        copy.prepare(ScoreRequest("a", **fields))  # type: ignore[arg-type]
    assert refused.value.code is ErrorCode.REWARD_COLUMN_REQUIRED
    assert past.error is not None and past.error.code is ErrorCode.REWARD_COLUMN_OUT_OF_RANGE
    prompts = _prompts(scorer, ScoreRequest("p", items=ITEMS, query=QUERY))
    logits = hf_reference(three_label_dir, prompts).logits.astype(np.float64)
    expected = logits[:, 1] - np.log(np.exp(logits[:, 0]) + np.exp(logits[:, 2]))
    # Each logit off by at most atol; logsumexp is 1-Lipschitz in the largest change: 2 atol in all.
    atol = forward_atol(three_label_dir, logits, longest=max(map(len, prompts)))
    _check_answer(asked, expected, 2 * atol, Compare.RANK)
    assert all(math.isclose(sum(row), 1.0, rel_tol=1e-6) for row in asked.scores)  # softmax scores as asked


def test_independent_labels_give_their_own_logit(tmp_path: Path) -> None:
    overrides = {"problem_type": "multi_label_classification"}
    model_dir = write_tiny_model(tmp_path / "multi", "llama", seed=4, num_labels=3, overrides=overrides)
    scorer = Scorer(model_dir, ScorerConfig(device="cpu"))
    assert scorer.reward_rule == RewardRule(width=3, independent=True)
    request = ScoreRequest("m", items=ITEMS[:2], query=QUERY, compare="pairwise", reward_column=2)
    (result,) = scorer.score([request])
    prompts = _prompts(scorer, request)
    logits = hf_reference(model_dir, prompts).logits.astype(np.float64)
    atol = forward_atol(model_dir, logits, longest=max(map(len, prompts)))
    _check_answer(result, logits[:, 2], atol, Compare.PAIRWISE)


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("bert-reward"), "bert", seed=8, num_labels=1)


@torch.no_grad()
def _hf_pairs(model_dir: Path, query: str, items: tuple[str, ...]) -> np.ndarray:
    """HF's float32 logits [n, L] for (query, item) text pairs, padded as one batch."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForSequenceClassification.from_pretrained(
        str(model_dir), attn_implementation="eager", dtype=torch.float32
    ).eval()
    encoded = tokenizer([query] * len(items), list(items), padding=True, return_tensors="pt")
    return np.asarray(model(**encoded).logits.numpy(), dtype=np.float64)


@pytest.mark.parametrize("compare", [Compare.PAIRWISE, Compare.RANK])
def test_cross_encoder_matches_hf_rewards(cross_encoder_dir: Path, compare: Compare) -> None:
    scorer = Scorer(cross_encoder_dir, ScorerConfig(device="cpu"))
    items = ITEMS[:2] if compare is Compare.PAIRWISE else ITEMS
    request = ScoreRequest("x", items=items, query=QUERY, compare=compare)
    (result,) = scorer.score([request])
    expected = _hf_pairs(cross_encoder_dir, QUERY, items)[:, 0]
    atol = forward_atol(cross_encoder_dir, expected, longest=max(map(len, _prompts(scorer, request))))
    _check_answer(result, expected, atol, compare)


def test_yes_no_judge_rewards_are_the_logit_difference(tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path / "judge", "llama", seed=5, judge=True)
    scorer = Scorer(model_dir, ScorerConfig(device="cpu"))
    labels = (11, 23)
    request = ScoreRequest(
        "j", items=ITEMS[:2], query=QUERY, label_token_ids=labels, apply_softmax=True, compare="pairwise",
        reward_column=0,
    )  # fmt: skip
    single = ScoreRequest("s", items=ITEMS[:2], query=QUERY, label_token_ids=labels[:1], compare="pairwise")
    (result, refused) = scorer.score([request, single])
    assert refused.error is not None and refused.error.code is ErrorCode.COMPARE_NOT_SUPPORTED
    prompts = _prompts(scorer, request)
    logits = hf_judge_reference(model_dir, prompts, labels).logits.astype(np.float64)
    # Two logits off by atol each: their difference by 2 atol.
    atol = forward_atol(model_dir, logits, longest=max(map(len, prompts)))
    _check_answer(result, logits[:, 0] - logits[:, 1], 2 * atol, Compare.PAIRWISE)
    # With two labels the preference is the product rule of the judge's own yes-probabilities.
    yes = np.asarray(result.scores)[:, 0]
    odds = (yes[0] / (1 - yes[0])) / (yes[1] / (1 - yes[1]))
    assert result.preference is not None
    assert math.isclose(result.preference, odds / (1 + odds), rel_tol=1e-5)


def test_a_compare_request_computes_its_prompt_once(tiny_llama_dir: Path) -> None:
    scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cpu", share_prefix_min_tokens=8))
    request = ScoreRequest("s", items=ITEMS, query=QUERY, compare="rank")
    prepared = scorer.prepare(request)
    assert isinstance(prepared, PreparedRequest)
    first, *rest = prepared.prompts
    common = min(next(i for i, (a, b) in enumerate(zip(first, p, strict=False)) if a != b) for p in rest)
    assert common >= 8  # the query's tokens, at least the setting
    stats: list[BatchStats] = []
    (result,) = scorer.score_prepared([prepared], on_batch=stats.append)
    assert result.ok and result.ranking is not None
    # One batch, its four prompts, and the prompt held once instead of four times.
    (batch,) = stats
    assert (batch.requests, batch.items, batch.tokens) == (1, 4, prepared.num_tokens)
    assert batch.packed_tokens == prepared.num_tokens - 3 * common
    (group,) = scorer.plan.shared_prefixes(list(prepared.prompts))
    assert (group.length, len(group.members)) == (common, 4)


def test_a_request_cut_across_batches_is_compared_over_all_its_items(
    llama_scorer: Scorer, tiny_llama_dir: Path
) -> None:
    request = ScoreRequest("cut", items=ITEMS, query=QUERY, compare="rank")
    (whole,) = llama_scorer.score([request])
    prepared = llama_scorer.prepare(request)
    assert isinstance(prepared, PreparedRequest)
    parts = llama_scorer.plan.parts(prepared, max(map(len, prepared.prompts)) + 1)  # one item a part
    assert len(parts) == len(ITEMS)
    results = llama_scorer.score_prepared(parts)
    assert all(r.rewards is not None and r.ranking is None for r in results)  # the answer waits
    joined = join_results(results, request.compare)
    assert joined.rewards is not None and whole.rewards is not None
    # Two float32 forwards of the same prompts, packed four together or one at a time.
    atol = forward_atol(tiny_llama_dir, whole.rewards, longest=max(map(len, prepared.prompts)))
    _check_answer(joined, np.asarray(whole.rewards), atol, Compare.RANK)
    assert joined == dataclasses.replace(joined, **vars_of(answer(joined.rewards, Compare.RANK)))


def vars_of(comparison: object) -> dict[str, object]:
    return {field.name: getattr(comparison, field.name) for field in dataclasses.fields(comparison)}  # type: ignore[arg-type]


def test_the_formulas_on_known_values() -> None:
    assert preference(2.0, 1.0) == pytest.approx(1 / (1 + math.exp(-1.0)), rel=1e-15)
    # Far tails: no overflow, and the small probability keeps its digits.
    assert preference(-800.0, 0.0) == pytest.approx(math.exp(-800.0), rel=1e-12)
    assert preference(800.0, 0.0) == 1.0
    assert ranking([1.0, 3.0, 3.0, float("nan"), -2.0]) == (1, 2, 0, 4, 3)
    probabilities = best_probability([1000.0, 1000.0, 999.0])  # exp(1000) alone would overflow
    e = math.exp(-1.0)
    assert probabilities == pytest.approx((1 / (2 + e), 1 / (2 + e), e / (2 + e)), rel=1e-14)
    pair = answer([0.3, -1.2], Compare.RANK)
    assert pair.best_probability is not None
    assert pair.best_probability[0] == pytest.approx(preference(0.3, -1.2), rel=1e-14)  # N = 2: Bradley-Terry
    rule = RewardRule(width=2)
    log_odds = rule.rewards(np.array([[2.0, 0.5]], dtype=np.float32), 1)
    assert log_odds.tolist() == [-1.5]
