"""bench/w5.py's stream without a model: the long requests spread among W1's, each once and in order; the
wait of W1's requests counted as the long batches before theirs; the long model's config widened, its
weights the same files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.common import Workload
from bench.w5 import interleave, long_model_dir, long_workload, waits_behind_long


def _rows(*lengths: int) -> Workload:
    return Workload([torch.full((n,), n) for n in lengths])


def test_the_long_requests_are_spread_among_the_short_ones_each_once_in_order() -> None:
    rows, is_long = interleave(_rows(100, 200, 300), _rows(1, 2, 3, 4, 5, 6))
    assert [len(r) for r in rows] == [100, 1, 2, 200, 3, 4, 300, 5, 6]
    assert is_long == [len(r) >= 100 for r in rows]
    more_long, flags = interleave(_rows(100, 200, 300), _rows(1))
    assert [len(r) for r in more_long] == [100, 200, 300, 1] and flags == [True, True, True, False]


def test_long_lengths_are_log_uniform_within_their_range() -> None:
    lengths = long_workload(256, 50, (8192, 32768)).lengths
    assert min(lengths) >= 8192 and max(lengths) <= 32768
    # Log-uniform: as many below the geometric middle (16,384) as above it, within sampling noise (256
    # draws: a standard deviation of 8 around 128).
    assert 128 - 40 < sum(n < 16384 for n in lengths) < 128 + 40


def test_a_short_requests_wait_is_the_long_batches_scored_before_its_own() -> None:
    seconds = [0.1, 2.0, 0.1, 3.0, 0.1]
    long = [False, True, False, True, False]
    waits = waits_behind_long(seconds, long, of_short=[0, 2, 2, 4])
    assert waits["max_s"] == pytest.approx(5.0) and waits["p50_s"] == pytest.approx(2.0)
    assert waits["long_batch_max_s"] == pytest.approx(3.0)


def test_the_long_model_links_the_weights_and_widens_its_positions(tmp_path: Path) -> None:
    source = tmp_path / "w1"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"max_position_embeddings": 8192, "hidden_size": 8}))
    (source / "model.safetensors").write_bytes(b"weights")
    target = long_model_dir(source, tmp_path / "long", positions=32768)
    assert json.loads((target / "config.json").read_text()) == {
        "max_position_embeddings": 32768,
        "hidden_size": 8,
    }
    assert (target / "model.safetensors").resolve() == (source / "model.safetensors").resolve()
