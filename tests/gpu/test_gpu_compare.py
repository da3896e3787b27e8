"""Comparisons on the fast GPU path: a pairwise and a rank request in bf16 through the varlen kernel with
their prompt computed once (the batch's own counters), their rewards, preference, ranking and best-item
probabilities against HF float32 rewards. Run with `python -m pytest -m gpu tests/gpu/test_gpu_compare.py`."""

from __future__ import annotations

import itertools
import math
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from test_fast_path import _against_float32_hf, _testkit
from tolerances import assert_within

from models import Scorer, ScorerConfig
from models.interface import BatchStats
from models.prepare import PreparedRequest
from models.tiny import write_tiny_model
from schemas import ScoreRequest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

QUERY = tuple(range(40, 80))  # 40 tokens every item's prompt begins with
ITEMS = ((5, 6, 7), tuple(range(100, 130)), (30,), (31, 32, 33, 34))
PAIR = ((8, 9), (10, 11, 12))  # no item's first token is another's: the prompts share the query alone


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_compare_on_the_fast_path_matches_float32_hf(architecture: str) -> None:
    hf_reference = _testkit().hf_reference
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(Path(tmp) / architecture, architecture, seed=5, num_labels=1)
        scorer = Scorer(model_dir, ScorerConfig(device="cuda", dtype="bfloat16", share_prefix_min_tokens=8))
        pair = ScoreRequest("pair", query=QUERY, items=PAIR, compare="pairwise")
        rank = ScoreRequest("rank", query=QUERY, items=ITEMS, compare="rank")
        prepared = [scorer.prepare(pair), scorer.prepare(rank)]
        assert all(isinstance(p, PreparedRequest) for p in prepared)
        stats: list[BatchStats] = []
        got_pair, got_rank = scorer.score_prepared(prepared, on_batch=stats.append)
        # One batch; the query held once for all six prompts of the two requests (both begin with it).
        (batch,) = stats
        assert (batch.requests, batch.items) == (2, 6)
        assert batch.packed_tokens == batch.tokens - 5 * len(QUERY)
        prompts = [QUERY + item for item in (*PAIR, *ITEMS)]
        reference = hf_reference(model_dir, prompts)
        bf16 = hf_reference(model_dir, prompts, dtype=torch.bfloat16)
        bound, _ = _against_float32_hf(model_dir, max(map(len, prompts)), reference, bf16)
    pair_rewards, expected = np.split(reference.logits[:, 0].astype(np.float64), [2])
    assert got_pair.rewards is not None and got_pair.preference is not None
    assert_within(got_pair.rewards, pair_rewards, bound, "pairwise rewards")
    # sigmoid is 1/4-Lipschitz: a difference of two rewards off by `bound` each moves P by bound / 2.
    want = 1 / (1 + math.exp(pair_rewards[1] - pair_rewards[0]))
    assert_within(got_pair.preference, want, bound / 2, "preference")
    assert got_rank.rewards is not None and got_rank.best_probability is not None
    assert_within(got_rank.rewards, expected, bound, "rank rewards")
    # The ranking is the order of the rewards returned, and HF's wherever two rewards lie further apart
    # than both sides' error (bf16's bound is wide next to a tiny model's spread of rewards).
    got = got_rank.rewards
    assert got_rank.ranking == tuple(sorted(range(len(ITEMS)), key=lambda i: (-got[i], i)))
    place = {item: at for at, item in enumerate(got_rank.ranking)}
    for i, j in itertools.permutations(range(len(ITEMS)), 2):
        if expected[i] - expected[j] > 2 * bound:
            assert place[i] < place[j], (i, j, expected, bound)
    shifted = np.exp(expected - expected.max())
    best = shifted / shifted.sum()
    # Each reward off by at most `bound` moves p to within [p e^-2bound, p e^2bound].
    assert_within(got_rank.best_probability, best, best * math.expm1(2 * bound), "best_probability")
