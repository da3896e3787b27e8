"""Preferences between a request's items: which score column is an item's reward, the Bradley-Terry
probability of a pair and the Plackett-Luce ranking of many (the request's `compare`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from schemas import Compare, ErrorCode, ScoreRequest

if TYPE_CHECKING:  # the intake processes import this module: they never load torch
    import torch


@dataclass(frozen=True)
class Comparison:
    """One request's answer: each item's reward, and what its `compare` asked of them (None elsewhere)."""

    rewards: tuple[float, ...]
    preference: float | None = None
    ranking: tuple[int, ...] | None = None
    best_probability: tuple[float, ...] | None = None


@dataclass(frozen=True)
class RewardRule:
    """How a model's scores give a reward.

    `width`: the columns of the model's own head; None for a judge, whose columns are the label ids each
    request sends. `independent`: the head's columns are separate sigmoids (HF's `problem_type`
    "multi_label_classification"), so each column's logit is its own log-odds.
    """

    width: int | None
    independent: bool = False

    def refusal(self, request: ScoreRequest) -> tuple[ErrorCode, str] | None:
        """Why the request's compare cannot be answered on this model (None: it can); before model work."""
        if request.compare is None:
            return None
        columns = self.width if self.width is not None else len(request.label_token_ids or ())
        column = request.reward_column
        if self.width is None and columns == 1:
            return (
                ErrorCode.COMPARE_NOT_SUPPORTED,
                "A judge's logit for one label token is not comparable between prompts (a language model's "
                "logits at a position are set only up to a constant, which the softmax over its vocabulary "
                "removes); send two or more label_token_ids (e.g. of ' Yes' and ' No') and the index of the "
                "one that is the reward in reward_column.",
            )
        if column is None and columns > 1:
            return (
                ErrorCode.REWARD_COLUMN_REQUIRED,
                f"Each item has {columns} scores here; send reward_column, the index (0 to {columns - 1}) "
                "of the score that is the reward (for a judge, of its label in label_token_ids).",
            )
        if column is not None and column >= columns:
            return (
                ErrorCode.REWARD_COLUMN_OUT_OF_RANGE,
                f"reward_column is {column} but each item has {columns} score(s); send an index from 0 to "
                f"{columns - 1}.",
            )
        return None

    def rewards(self, logits: np.ndarray, column: int | None) -> np.ndarray:
        """Float64 rewards [n] from a request's logits [n, C] (its own columns, before any softmax).

        One column: the logit itself (a reward model's reward). Several: the log-odds of the column under
        the softmax over them, l_c - logsumexp(l_j, j != c), which is l_c - l_other for two (a yes/no
        judge): unchanged by a constant added to every column, so comparable between prompts, and
        sigmoid(reward) is the probability the model gives the column. Independent columns: l_c, already
        the column's log-odds.
        """
        values = logits.astype(np.float64, copy=False)
        c = column or 0
        if values.shape[1] == 1 or self.independent:
            return values[:, c].copy()
        others = np.delete(values, c, axis=1)
        return np.asarray(values[:, c] - _logsumexp(others), dtype=np.float64)


def _logsumexp(values: np.ndarray) -> np.ndarray:
    """log(sum(exp(x))) per row [n, k] -> [n], computed after subtracting each row's max (no overflow)."""
    top = values.max(axis=1)
    safe = np.where(np.isfinite(top), top, 0.0)
    return np.asarray(safe + np.log(np.exp(values - safe[:, None]).sum(axis=1)), dtype=np.float64)


def preference(first: float, second: float) -> float:
    """P(first beats second) = sigmoid(first - second) (Bradley-Terry), as exp(-log(1 + exp(-d))): no
    overflow, and no cancellation for a probability near 0."""
    return float(np.exp(-np.logaddexp(0.0, -(first - second))))


def ranking(rewards: Sequence[float]) -> tuple[int, ...]:
    """Item indices by reward, best first; equal rewards by item index; a NaN reward after every other."""
    unknown = [r != r for r in rewards]  # NaN is the one float unequal to itself
    return tuple(
        sorted(range(len(rewards)), key=lambda i: (unknown[i], 0.0 if unknown[i] else -rewards[i], i))
    )


def best_probability(rewards: Sequence[float]) -> tuple[float, ...]:
    """Each item's Plackett-Luce probability of being the best, exp(r_i) / sum_j exp(r_j), after subtracting
    the largest reward (no overflow; for two items it is the Bradley-Terry probability)."""
    values = np.asarray(rewards, dtype=np.float64)
    shifted = np.exp(values - values.max())
    return tuple(float(p) for p in shifted / shifted.sum())


def answer(rewards: Sequence[float], compare: Compare) -> Comparison:
    """What `compare` asks of the items' rewards."""
    kept = tuple(float(r) for r in rewards)
    if compare is Compare.PAIRWISE:
        return Comparison(kept, preference=preference(kept[0], kept[1]))
    return Comparison(kept, ranking=ranking(kept), best_probability=best_probability(kept))


def comparisons(
    logits: torch.Tensor,
    columns: dict[int, int],
    requests: Sequence[tuple[ScoreRequest, range]],
    rule: RewardRule,
) -> list[Comparison | None]:
    """Each request's comparison from a batch's host logits [N, L] (a judge's label ids at `columns`), its
    rows in the batch and whether they are all its items; None for a request without compare. A part of a
    request cut across batches gets its rewards alone: the answer waits for every item (join_results)."""
    out: list[Comparison | None] = []
    for request, rows in requests:
        if request.compare is None:
            out.append(None)
            continue
        block = logits[rows.start : rows.stop]
        if columns:
            block = block[:, [columns[label] for label in request.label_token_ids or ()]]
        rewards = rule.rewards(block.numpy(), request.reward_column)
        if len(rows) == len(request.items):
            out.append(answer(rewards.tolist(), request.compare))
        else:
            out.append(Comparison(tuple(rewards.tolist())))
    return out
