"""The deterministic setting: a request's scores and hidden states are bit-identical whatever else shares
its batch and however the batches are cut."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from models import Scorer, ScorerConfig, write_tiny_model
from models.tiles import RowTiles, rows_invariant, tiled_product
from schemas import ScoreRequest, ScoreResult
from tests.models.scoring_testkit import hf_reference
from tests.tolerances import forward_bound, forward_length


def _requests(label_ids: tuple[int, ...] | None) -> list[ScoreRequest]:
    generator = torch.Generator().manual_seed(5)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(4, 500, (n,), generator=generator).tolist())

    # Items of 1-3 tokens too: the CPU's products of a few rows round differently from those of many.
    shapes = [(3, 40), (1, 7), (2, 90), (4, 15), (1, 120), (2, 33), (3, 1), (1, 1), (1, 2)]
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


def _mode(scorer: Scorer) -> int | None:
    """The tile the scorer runs its deterministic batches in, or None: every item alone."""
    return scorer.executor.row_tiles


def _expected_tiles(scorer: Scorer, rows: int) -> int | None:
    """The mode the setting must pick: tiles where the model can take them and this CPU's products are
    row-invariant at that tile (checked apart, on the model's own widths), else every item alone."""
    loaded = scorer.executor._loaded
    if rows == 0 or loaded.judge or not loaded.packable:
        return None
    linears = [m for m in loaded.model.modules() if isinstance(m, torch.nn.Linear)]
    widths = {(m.in_features, m.out_features) for m in linears}
    return rows if rows_invariant(rows, sorted(widths), torch.device("cpu"), torch.float32) is None else None


# Tiles of 64 rows: the batches below (up to ~560 tokens) span several, the last one padded.
@pytest.mark.parametrize("tile_rows", [0, 64])
@pytest.mark.parametrize(
    ("architecture", "judge", "pooling"),
    [
        ("llama", False, "auto"),
        ("llama", False, "mean"),
        ("bert", False, "auto"),
        ("qwen3", True, "auto"),
        ("olmo2", False, "auto"),
        ("glm4", False, "auto"),
        ("gemma4_text", True, "auto"),
    ],
)
def test_results_do_not_depend_on_the_batch(
    architecture: str, judge: bool, pooling: str, tile_rows: int, tmp_path: Path
) -> None:
    model_dir = write_tiny_model(tmp_path / architecture, architecture, seed=9, judge=judge)
    labels = (5, 17, 300) if judge else None
    requests = _requests(labels)
    settings = {"device": "cpu", "deterministic": True, "pooling": pooling}
    settings["deterministic_tile_rows"] = tile_rows
    alone: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    small_batches = Scorer(model_dir, ScorerConfig(**settings, max_batch_tokens=64))
    assert _mode(small_batches) == _expected_tiles(small_batches, tile_rows)
    for request in requests:
        alone[request.request_id] = _arrays(small_batches.score([request])[0])
    for budget in (150, 100_000):
        scorer = Scorer(model_dir, ScorerConfig(**settings, max_batch_tokens=budget))
        for order in (requests, requests[::-1]):
            for result in scorer.score(order):
                # The setting's promise: each item's arithmetic is its own, so the bits are too.
                scores, hidden = _arrays(result)
                np.testing.assert_array_equal(scores, alone[result.request_id][0])
                np.testing.assert_array_equal(hidden, alone[result.request_id][1])


def test_tiled_batches_match_the_float32_reference(tmp_path: Path) -> None:
    """Packed in tiles, the deterministic batch still computes what HF's float32 forward does, prompt by
    prompt: the tiles change where a product's rows sit, not what is summed."""
    model_dir = write_tiny_model(tmp_path / "llama", "llama", seed=9)
    scorer = Scorer(model_dir, ScorerConfig(device="cpu", deterministic=True, deterministic_tile_rows=64))
    requests = [ScoreRequest(f"p{i}", (item,), return_pooled_hidden_states=True) for i, item in enumerate(
        item for request in _requests(None) for item in request.items
    )]  # fmt: skip
    prompts = [list(r.items[0]) for r in requests]
    reference = hf_reference(model_dir, prompts)
    longest = max(len(p) for p in prompts)
    head = scorer.executor._loaded.head
    assert isinstance(head, torch.nn.Linear)
    weights = head.weight.detach().abs().numpy()
    length = forward_length(model_dir, longest)
    for result, logits, state in zip(scorer.score(requests), reference.logits, reference.hidden, strict=True):
        scores, hidden = _arrays(result)
        # Two float32 computations of the same network (forward_bound: its sums in series, each within
        # float32's gamma of its terms' magnitude, the output's scale; twice, for two summation orders).
        magnitude = max(float(np.abs(state).max()), 1.0)
        np.testing.assert_allclose(
            hidden[0], state, rtol=0, atol=forward_bound(torch.float32, length=length, magnitude=magnitude)
        )
        # The head adds one more sum of `hidden` terms, whose magnitude is |W| |state| (at least the states').
        head_magnitude = max(float((weights @ np.abs(state)).max()), magnitude)
        head_bound = forward_bound(torch.float32, length=length + weights.shape[1], magnitude=head_magnitude)
        np.testing.assert_allclose(scores[0], logits, rtol=0, atol=head_bound)


def test_every_product_in_the_tiles_has_one_shape() -> None:
    """Inside RowTiles, F.linear and 2-D products are called on [rows, K] tiles only (the last padded), and
    give what the whole product gives: exactly, in integers a float64 product holds without rounding."""
    shapes: list[tuple[int, ...]] = []

    def recorded(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(x.shape))
        return x @ w.T

    generator = torch.Generator().manual_seed(1)
    x = torch.randint(-8, 8, (2, 37, 12), generator=generator).double()
    w = torch.randint(-8, 8, (5, 12), generator=generator).double()
    out = tiled_product(16, recorded, x, w)
    assert shapes == [(16, 12)] * 5 and out.shape == (2, 37, 5)
    assert torch.equal(out, x @ w.T)
    with RowTiles(16):
        linear = torch.nn.functional.linear(x, w)
        product = x.reshape(-1, 12) @ w.T
        heads = torch.matmul(x, w.T)  # 3-D: one sequence's rows, passed through whole
    assert torch.equal(linear, x @ w.T) and torch.equal(product, x.reshape(-1, 12) @ w.T)
    assert torch.equal(heads, x @ w.T)


@pytest.mark.parametrize(("rows", "width"), [(16, 5), (7, 1), (8, 2)])
def test_linear_and_mm_tiles_written_into_the_result_are_the_whole_product(rows: int, width: int) -> None:
    """F.linear (with and without bias) and torch.mm write their whole tiles straight into the result, where
    a tile's rows start on a 16-byte boundary, and copy the others in: the same values as the whole
    product either way, exactly (integers a float64 product holds without rounding). 7 rows of one float64
    column start off that boundary in every other tile; 16 x 5 and 8 x 2 on it."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randint(-8, 8, (3, 29, 12), generator=generator).double()
    w = torch.randint(-8, 8, (width, 12), generator=generator).double()
    b = torch.randint(-8, 8, (width,), generator=generator).double()
    assert torch.equal(tiled_product(rows, F.linear, x, w), x @ w.T)
    assert torch.equal(tiled_product(rows, F.linear, x, w, b), x @ w.T + b)
    assert torch.equal(tiled_product(rows, F.linear, x, w, bias=b), x @ w.T + b)
    flat = x.reshape(-1, 12)
    assert torch.equal(tiled_product(rows, torch.mm, flat, w.T), flat @ w.T)


def test_the_device_check_finds_a_product_that_follows_the_row_position() -> None:
    """rows_invariant refuses a product whose rows round by where they sit, or by the rows beside them."""
    by_position = lambda x, w: x @ w.T + torch.arange(x.shape[0], dtype=x.dtype)[:, None] * 1e-7  # noqa: E731
    # Rounds by how many real (not padding) rows share its tile: a shift keeps that count, a short batch not.
    by_company = lambda x, w: x @ w.T + (x.abs().sum(1) > 0).sum() * 1e-6  # noqa: E731
    cpu = torch.device("cpu")
    widths, f32 = [(8, 4)], torch.float32
    assert "moved within the tile" in str(rows_invariant(16, widths, cpu, f32, product=by_position))
    assert "rows beside it" in str(rows_invariant(16, widths, cpu, f32, product=by_company))
    # Row by row, one call of one shape each: the same bits wherever the row sits, by construction.
    row_by_row = lambda x, w: torch.stack([w @ row for row in x])  # noqa: E731
    assert rows_invariant(16, widths, cpu, f32, product=row_by_row) is None


class _Shapes(TorchFunctionMode):
    """Records the left operand's shape of every product that reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, ...]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.mm, torch.addmm, torch.Tensor.addmm_):
            self.seen.append(tuple(args[1 if "addmm" in func.__name__ else 0].shape))
        return func(*args, **(kwargs or {}))


def test_an_added_product_runs_in_the_tiles_too() -> None:
    """A LoRA delta's `out.addmm_(m1, m2)` inside RowTiles: its product on [rows, K] tiles only, then added,
    equal to the whole product (exactly, in integers a float64 product holds)."""
    generator = torch.Generator().manual_seed(2)
    base = torch.randint(-8, 8, (37, 5), generator=generator).double()
    m1 = torch.randint(-8, 8, (37, 12), generator=generator).double()
    m2 = torch.randint(-8, 8, (12, 5), generator=generator).double()
    spy = _Shapes()
    with spy, RowTiles(16):  # the spy outside: it sees the calls the tiles make
        added = base.clone().addmm_(m1, m2)
        plain = torch.addmm(base, m1, m2)
    assert spy.seen == [(16, 12)] * 6  # three tiles for each of the two calls
    assert torch.equal(added, base + m1 @ m2) and torch.equal(plain, base + m1 @ m2)
