"""The deterministic setting: a request's scores and hidden states are bit-identical whatever else shares
its batch and however the batches are cut."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from models import Scorer, ScorerConfig, write_tiny_model
from schemas import ScoreRequest, ScoreResult


def _requests(label_ids: tuple[int, ...] | None) -> list[ScoreRequest]:
    generator = torch.Generator().manual_seed(5)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(4, 500, (n,), generator=generator).tolist())

    shapes = [(3, 40), (1, 7), (2, 90), (4, 15), (1, 120), (2, 33)]
    return [
        ScoreRequest(
            request_id=f"r{i}",
            items=tuple(ids(length + j) for j in range(count)),
            return_pooled_hidden_states=True,
            label_token_ids=label_ids,
        )
        for i, (count, length) in enumerate(shapes)
    ]


def _arrays(result: ScoreResult) -> tuple[np.ndarray, np.ndarray]:
    assert result.ok and result.pooled_hidden_states is not None, result.error
    hidden = np.stack([t.to_numpy() for t in result.pooled_hidden_states])
    return np.asarray(result.scores), hidden


@pytest.mark.parametrize(("architecture", "judge"), [("llama", False), ("bert", False), ("qwen3", True)])
def test_results_do_not_depend_on_the_batch(architecture: str, judge: bool, tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path / architecture, architecture, seed=9, judge=judge)
    labels = (5, 17, 300) if judge else None
    requests = _requests(labels)
    alone: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    small_batches = Scorer(model_dir, ScorerConfig(device="cpu", deterministic=True, max_batch_tokens=64))
    for request in requests:
        alone[request.request_id] = _arrays(small_batches.score([request])[0])
    for budget in (150, 100_000):
        scorer = Scorer(model_dir, ScorerConfig(device="cpu", deterministic=True, max_batch_tokens=budget))
        for order in (requests, requests[::-1]):
            for result in scorer.score(order):
                # The setting's promise: each item's arithmetic is its own, so the bits are too.
                scores, hidden = _arrays(result)
                np.testing.assert_array_equal(scores, alone[result.request_id][0])
                np.testing.assert_array_equal(hidden, alone[result.request_id][1])
