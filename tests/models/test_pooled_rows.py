"""The last decoder layer's MLP at the pooled rows only (models/pooled_rows.py), on the CPU with the varlen
path's CPU kernel, in float32: which batches take it, that the MLP really sees only those rows, and the
same scores and hidden states as the whole last layer, eager and compiled, with shared prefixes and without.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from scoring_testkit import CpuVarlenKernelGqa

from models import Scorer, ScorerConfig
from models.engine import decoder_layers
from models.graphs import Recorder, next_power_of_two
from models.pooled_rows import LastMlpAtPooledRows, last_mlp, padded_rows
from schemas import ScoreRequest


def _requests(count: int = 4, hidden: bool = True) -> list[ScoreRequest]:
    return [
        ScoreRequest(f"r{i}", query="the question", items=tuple(f"answer {i} " + "x " * j for j in range(3)),
                     return_pooled_hidden_states=hidden)
        for i in range(count)
    ]  # fmt: skip


def _scorer(model_dir: Path, **settings: Any) -> Scorer:
    """The varlen path with the CPU kernel; its layers eager unless `compile="on"` (the hooks that count the
    MLP's rows run only where the layers are not compiled)."""
    settings.setdefault("compile", "off")
    kernel = CpuVarlenKernelGqa()
    if settings["compile"] == "on":
        kernel = torch._dynamo.disable(kernel)  # its host-side checks are not what runs compiled on a GPU
    return Scorer(model_dir, ScorerConfig(device="cpu", attention="varlen", varlen_kernel=kernel, **settings))


@contextmanager
def _mlp_rows(scorer: Scorer) -> Iterator[list[list[int]]]:
    """The rows each layer's MLP down projection computes, per forward: [[rows of layer 0, ...], ...]."""
    layers = decoder_layers(scorer._loaded.base)
    assert layers is not None
    seen: list[list[int]] = []

    def hook(index: int) -> Any:
        def record(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            if index == 0:
                seen.append([])
            seen[-1].append(int(args[0].reshape(-1, args[0].shape[-1]).shape[0]))

        return record

    handles = [layer.mlp.down_proj.register_forward_pre_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _assert_same_results(got: list[Any], want: list[Any]) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.ok and b.ok, (a.error, b.error)
        np.testing.assert_allclose(np.array(a.scores), np.array(b.scores), atol=1e-5)
        if b.pooled_hidden_states is not None:
            assert a.pooled_hidden_states is not None
            for x, y in zip(a.pooled_hidden_states, b.pooled_hidden_states, strict=True):
                np.testing.assert_allclose(x.to_numpy(), y.to_numpy(), atol=1e-5)


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen2", "mistral", "gemma3_text", "phi3"])
def test_the_last_mlp_computes_only_the_pooled_rows(name: str, model_dirs: dict[str, Path]) -> None:
    whole = _scorer(model_dirs[name], last_mlp_pooled_rows=False)
    pooled = _scorer(model_dirs[name])
    requests = _requests()
    with _mlp_rows(pooled) as seen:
        results = pooled.score(requests)
    assert all(r.ok for r in results), [r.error for r in results]
    items = sum(len(r.items) for r in requests)
    (forward,) = seen
    # Every layer before the last computes every token; the last one row per item, padded as a CUDA graph
    # of the batch's shape pads them (to a power of two).
    assert forward[-1] == next_power_of_two(items) < forward[0]
    assert len(set(forward[:-1])) == 1
    with _mlp_rows(whole) as seen_whole:
        expected = whole.score(requests)
    assert seen_whole[0] == [forward[0]] * len(forward)
    _assert_same_results(results, expected)


def test_shared_prefixes_pool_their_suffixes_rows(tiny_llama_dir: Path) -> None:
    requests = _requests(3)
    whole = _scorer(tiny_llama_dir, share_prefix_min_tokens=2, last_mlp_pooled_rows=False)
    pooled = _scorer(tiny_llama_dir, share_prefix_min_tokens=2)
    with _mlp_rows(pooled) as seen:
        results = pooled.score(requests)
    items = sum(len(r.items) for r in requests)
    rows = seen[0][-1]  # the items' rows, padded to the sequence slots (prefixes are sequences too)
    assert items <= rows < seen[0][0] and rows == next_power_of_two(rows)
    _assert_same_results(results, whole.score(requests))


def test_mean_pooling_keeps_the_whole_mlp(tiny_llama_dir: Path) -> None:
    scorer = _scorer(tiny_llama_dir, pooling="mean")
    with _mlp_rows(scorer) as seen:
        assert all(r.ok for r in scorer.score(_requests(2)))
    assert len(set(seen[0])) == 1


def test_neither_the_exact_path_nor_an_encoder_takes_it(
    tiny_llama_dir: Path, model_dirs: dict[str, Path]
) -> None:
    assert Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))._pooled_mlp is None  # the exact path
    assert _scorer(tiny_llama_dir, last_mlp_pooled_rows=False)._pooled_mlp is None
    assert _scorer(tiny_llama_dir)._pooled_mlp is not None
    assert last_mlp(None) is None and last_mlp(torch.nn.ModuleList()) is None


def test_graphed_batches_pool_the_same_rows_with_the_same_bits(tiny_llama_dir: Path) -> None:
    """A shape's first batch takes the ordinary forward, its second is recorded, later ones replay: all three
    give the MLP the same padded rows, the recording and the replay (the same buffers) the same bits, and the
    ordinary forward (the batch's own token count, not the bucket's) the same results within float32's."""
    rerun: Recorder = lambda run: run  # noqa: E731 - a recorder whose replay runs the function again
    scorer = _scorer(tiny_llama_dir, cuda_graphs="on", graph_recorder=rerun, graph_max_tokens=64)
    small, large = _requests(1), _requests(4)  # 3 prompts of ~6-8 tokens; 12 prompts, over 64 tokens
    with _mlp_rows(scorer) as seen:
        runs = [scorer.score(small) for _ in range(3)]  # the ordinary forward, the recording, the replay
        scorer.score(large)
    assert scorer.graphs is not None and scorer.graphs.replays == 1
    # 3 items in 4 sequence slots on every path; the large batch (no graph) 12 in 16.
    assert [forward[-1] for forward in seen] == [4, 4, 4, 16]
    for a, b in zip(runs[2], runs[1], strict=True):
        assert a.scores == b.scores
        assert a.pooled_hidden_states is not None and b.pooled_hidden_states is not None
        for x, y in zip(a.pooled_hidden_states, b.pooled_hidden_states, strict=True):
            assert np.array_equal(x.to_numpy(), y.to_numpy())
    _assert_same_results(runs[1], runs[0])


def test_padding_repeats_the_last_row() -> None:
    rows = torch.tensor([5, 9, 2])
    assert padded_rows(rows, 4).tolist() == [5, 9, 2, 2]
    assert padded_rows(rows, 3) is rows and padded_rows(rows, 2) is rows


def test_the_forward_in_place_is_what_runs_and_comes_back() -> None:
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4))
    swapped = lambda x: 2 * x  # noqa: E731 - another forward already in place (the fused MLP's)
    mlp.forward = swapped  # type: ignore[method-assign]
    restricted = LastMlpAtPooledRows(mlp)
    hidden = torch.arange(12.0).reshape(1, 3, 4)
    with restricted.at(torch.tensor([2, 0])):
        out = mlp(hidden)
    torch.testing.assert_close(out[0, [0, 2]], 2 * hidden[0, [0, 2]])
    assert not out[0, 1].any()
    assert mlp.forward is swapped and restricted.rows is None
    plain = torch.nn.Linear(4, 4)
    with LastMlpAtPooledRows(plain).at(torch.tensor([1])):
        torch.testing.assert_close(plain(hidden)[0, 1], torch.nn.Linear.forward(plain, hidden[0, 1]))
    assert "forward" not in plain.__dict__


@pytest.mark.slow
def test_compiled_layers_take_it_without_recompiling_per_batch(tiny_llama_dir: Path) -> None:
    whole = _scorer(tiny_llama_dir, compile="on", last_mlp_pooled_rows=False)
    pooled = _scorer(tiny_llama_dir, compile="on")
    for count in (4, 2, 1):
        requests = _requests(count)
        _assert_same_results(pooled.score(requests), whole.score(requests))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # Other batch sizes, other pooled-row counts: the graphs traced so far serve them all.
    for count in (3, 5, 2):
        requests = _requests(count)
        _assert_same_results(pooled.score(requests), whole.score(requests))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
