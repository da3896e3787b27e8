"""The last decoder layer's row-wise modules (its query and output projections, its MLP) at the pooled rows
only (models/pooled_rows.py), on the CPU with the varlen path's CPU kernel, in float32: which batches take
it, that those modules really multiply only those rows while the keys and values still cover every row, and
the same scores and hidden states as the whole last layer, eager and compiled, with shared prefixes and
without.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from scoring_testkit import CpuVarlenKernelGqa, assert_scored_alike
from tolerances import assert_within, sum_bound
from torch.overrides import TorchFunctionMode

from models import Scorer, ScorerConfig, write_tiny_model
from models.graphs import Recorder, next_power_of_two, pooled_row_slots
from models.layers import decoder_layers
from models.moe import sparse_blocks
from models.pooled_rows import LastLayerAtPooledRows, last_layer_row_wise, padded_rows
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


class _LinearRows(TorchFunctionMode):
    """Records the rows of every linear product, by the weight multiplied: what each projection computes,
    whichever forward (the class's or one swapped in) calls it."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: defaultdict[int, list[int]] = defaultdict(list)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            self.rows[id(weight)].append(int(x.reshape(-1, x.shape[-1]).shape[0]))
        return func(*args, **kwargs)


DOWN = "mlp.down_proj"


@contextmanager
def _rows(scorer: Scorer, *paths: str) -> Iterator[dict[str, list[list[int]]]]:
    """The rows the projection at each of `paths` (default: the MLP's down projection) of each layer
    computes, per forward: {path: [[layer 0's, ...], ...]} (filled when the block ends)."""
    layers = decoder_layers(scorer.model.base)
    assert layers is not None
    seen: dict[str, list[list[int]]] = {}
    with _LinearRows() as mode:
        yield seen
    for path in paths or (DOWN,):
        per_layer = [mode.rows[id(layer.get_submodule(path).weight)] for layer in layers]
        seen[path] = [list(forward) for forward in zip(*per_layer, strict=True)]


def _assert_same_results(
    got: list[Any], want: list[Any], scorer: Scorer, requests: list[ScoreRequest]
) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.ok and b.ok, (a.error, b.error)
        if b.pooled_hidden_states is not None:
            assert a.pooled_hidden_states is not None
        # The last layer at the pooled rows alone (other GEMM shapes) or another batch shape: two float32
        # forwards, the model's chain of sums for the longest prompt (forward_atol).
        assert_scored_alike(a, b, scorer, requests)


@pytest.mark.parametrize(
    "name",
    ["llama", "qwen3", "qwen2", "mistral", "gemma3_text", "phi3", "smollm3", "olmo2", "olmo3", "glm4"],
)
def test_the_last_layer_computes_only_the_pooled_rows(name: str, model_dirs: dict[str, Path]) -> None:
    """OLMo's norms after each sublayer and GLM-4's four norms take the zero rows as the sublayers give them;
    the pooled rows' results are the whole layer's."""
    whole = _scorer(model_dirs[name], last_layer_pooled_rows=False)
    pooled = _scorer(model_dirs[name])
    fused_qkv = name == "phi3"  # its query projection is one product with the keys and values
    fused_gate_up = name in ("phi3", "glm4")
    restricted = ["self_attn.o_proj", "mlp.gate_up_proj" if fused_gate_up else "mlp.up_proj", DOWN]
    restricted += [] if fused_qkv else ["self_attn.q_proj"]
    kept = ["self_attn.qkv_proj"] if fused_qkv else ["self_attn.k_proj", "self_attn.v_proj"]
    requests = _requests()
    with _rows(pooled, *restricted, *kept) as seen:
        results = pooled.score(requests)
    assert all(r.ok for r in results), [r.error for r in results]
    items = sum(len(r.items) for r in requests)
    tokens = seen[DOWN][0][0]
    for path in restricted + kept:
        (forward,) = seen[path]
        assert forward[:-1] == [tokens] * (len(forward) - 1), path  # every layer before the last: every row
        # The last layer: the keys and values of every row; the rest one row per item, padded as a CUDA
        # graph of the batch's shape pads them (to a power of two).
        assert forward[-1] == (tokens if path in kept else pooled_row_slots(items)), path
    assert pooled_row_slots(items) < tokens
    with _rows(whole, *restricted) as seen_whole:
        expected = whole.score(requests)
    assert all(seen_whole[path] == [[tokens] * len(seen_whole[path][0])] for path in restricted)
    _assert_same_results(results, expected, whole, requests)


def test_the_last_sparse_block_routes_only_the_pooled_rows(tiny_qwen3_moe_dir: Path) -> None:
    """A mixture of experts' last block is row-wise as a dense MLP is: its router (and its experts) see one
    row per item, every earlier sparse block every row; the results are the whole layer's."""
    whole = _scorer(tiny_qwen3_moe_dir, last_layer_pooled_rows=False)
    pooled = _scorer(tiny_qwen3_moe_dir)
    assert pooled.executor.pooled_layer is not None and "mlp" in pooled.executor.pooled_layer.names
    layers = decoder_layers(pooled.model.base)
    routers = [layer.mlp.gate.weight for layer in layers or () if sparse_blocks([layer])]
    assert len(routers) == 2 and routers[-1] is layers[-1].mlp.gate.weight  # type: ignore[index]
    requests = _requests()
    with _LinearRows() as mode:
        results = pooled.score(requests)
    items = sum(len(r.items) for r in requests)
    (first,), (last,) = mode.rows[id(routers[0])], mode.rows[id(routers[-1])]
    assert last == pooled_row_slots(items) < first
    _assert_same_results(results, whole.score(requests), whole, requests)


def test_a_gemma4_judge_computes_only_the_pooled_rows(tmp_path: Path) -> None:
    """Gemma 4's last layer reads the keys and values of an earlier one (it has no key or value projection)
    and adds a per-layer input after its MLP; its query and output projections and MLP still run at the
    pooled rows only, and the label logits and hidden states are the whole layer's."""
    model_dir = write_tiny_model(tmp_path / "gemma4", "gemma4_text", seed=8)
    requests = [
        ScoreRequest(r.request_id, query=r.query, items=r.items, label_token_ids=(40, 7, 300),
                     return_pooled_hidden_states=True)
        for r in _requests()
    ]  # fmt: skip
    whole = _scorer(model_dir, last_layer_pooled_rows=False)
    pooled = _scorer(model_dir)
    restricted = ["self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", DOWN]
    with _rows(pooled, *restricted) as seen:
        results = pooled.score(requests)
    assert all(r.ok for r in results), [r.error for r in results]
    items = sum(len(r.items) for r in requests)
    tokens = seen[DOWN][0][0]
    for path in restricted:
        (forward,) = seen[path]
        assert forward == [tokens] * (len(forward) - 1) + [pooled_row_slots(items)], path
    _assert_same_results(results, whole.score(requests), whole, requests)


def test_shared_prefixes_pool_their_suffixes_rows(tiny_llama_dir: Path) -> None:
    requests = _requests(3)
    whole = _scorer(tiny_llama_dir, share_prefix_min_tokens=2, last_layer_pooled_rows=False)
    pooled = _scorer(tiny_llama_dir, share_prefix_min_tokens=2)
    with _rows(pooled) as seen:
        results = pooled.score(requests)
    items = sum(len(r.items) for r in requests)
    rows = seen[DOWN][0][-1]  # the items' rows, padded to the sequence slots (prefixes are sequences too)
    assert items <= rows < seen[DOWN][0][0] and rows == next_power_of_two(rows)
    _assert_same_results(results, whole.score(requests), whole, requests)


def test_mean_pooling_keeps_the_whole_mlp(tiny_llama_dir: Path) -> None:
    scorer = _scorer(tiny_llama_dir, pooling="mean")
    with _rows(scorer, DOWN, "self_attn.q_proj", "self_attn.o_proj") as seen:
        assert all(r.ok for r in scorer.score(_requests(2)))
    assert len({rows for forwards in seen.values() for rows in forwards[0]}) == 1


def test_neither_the_exact_path_nor_an_encoder_takes_it(
    tiny_llama_dir: Path, model_dirs: dict[str, Path]
) -> None:
    assert Scorer(tiny_llama_dir, ScorerConfig(device="cpu")).executor.pooled_layer is None  # the exact path
    assert _scorer(tiny_llama_dir, last_layer_pooled_rows=False).executor.pooled_layer is None
    assert last_layer_row_wise(None) == {} and last_layer_row_wise(torch.nn.ModuleList()) == {}
    phi3 = _scorer(model_dirs["phi3"]).executor.pooled_layer  # a fused q/k/v projection computes every row
    assert phi3 is not None and phi3.names == ("self_attn.o_proj", "mlp")
    llama = _scorer(tiny_llama_dir).executor.pooled_layer
    assert llama is not None and llama.names == ("self_attn.q_proj", "self_attn.o_proj", "mlp")


def test_graphed_batches_pool_the_same_rows_with_the_same_bits(tiny_llama_dir: Path) -> None:
    """A shape's first batch takes the ordinary forward, its second is recorded, later ones replay: all three
    give the MLP the same padded rows, the recording and the replay (the same buffers) the same bits, and the
    ordinary forward (the batch's own token count, not the bucket's) the same results within float32's."""
    rerun: Recorder = lambda run: run  # noqa: E731 - a recorder whose replay runs the function again
    scorer = _scorer(tiny_llama_dir, cuda_graphs="on", graph_recorder=rerun, graph_max_tokens=64)
    small, large = _requests(1), _requests(4)  # 3 prompts of ~6-8 tokens; 12 prompts, over 64 tokens
    with _rows(scorer) as seen_down:
        runs = [scorer.score(small) for _ in range(3)]  # the ordinary forward, the recording, the replay
        scorer.score(large)
    seen = seen_down[DOWN]
    assert scorer.executor.graphs is not None and scorer.executor.graphs.replays == 1
    # 3 items in 4 sequence slots on every path; the large batch (no graph) 12 in 16.
    assert [forward[-1] for forward in seen] == [4, 4, 4, 16]
    for a, b in zip(runs[2], runs[1], strict=True):
        # The replay reruns the recording on the same buffers: the same arithmetic, bit for bit.
        assert a.scores == b.scores
        assert a.pooled_hidden_states is not None and b.pooled_hidden_states is not None
        for x, y in zip(a.pooled_hidden_states, b.pooled_hidden_states, strict=True):
            assert np.array_equal(x.to_numpy(), y.to_numpy())
    _assert_same_results(runs[1], runs[0], scorer, small)


def test_padding_repeats_the_last_row() -> None:
    rows = torch.tensor([5, 9, 2])
    assert padded_rows(rows, 4).tolist() == [5, 9, 2, 2]
    assert padded_rows(rows, 3) is rows and padded_rows(rows, 2) is rows
    # A graph's sequence slots, never one row: torch.compile would give a count of 1 graphs of its own.
    assert [pooled_row_slots(n) for n in (1, 2, 3, 4, 5, 64, 65)] == [4, 4, 4, 4, 8, 64, 128]
    assert padded_rows(torch.tensor([7]), pooled_row_slots(1)).tolist() == [7, 7, 7, 7]


def test_the_forward_in_place_is_what_runs_and_comes_back() -> None:
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4))
    swapped = lambda x: 2 * x  # noqa: E731 - another forward already in place (the fused MLP's)
    mlp.forward = swapped  # type: ignore[method-assign]
    projection = torch.nn.Linear(4, 6)  # a query projection: another width out
    restricted = LastLayerAtPooledRows({"mlp": mlp, "q_proj": projection})
    hidden = torch.arange(12.0).reshape(1, 3, 4)
    with restricted.at(torch.tensor([2, 0])):
        out = mlp(hidden)
        queries = projection(hidden)
    # Doubling is exact in float32.
    torch.testing.assert_close(out[0, [0, 2]], 2 * hidden[0, [0, 2]], atol=0, rtol=0)
    assert not out[0, 1].any()
    assert queries.shape == (1, 3, 6) and not queries[0, 1].any()
    # The projection of the gathered rows (in the order 2, 0) and of rows 0, 2: two float32 GEMMs of 4 terms
    # and the bias, each within gamma(5) of sum |w x| + |b|.
    weight, bias = projection.weight.detach().abs(), projection.bias.detach().abs()
    magnitude = hidden[0].abs() @ weight.T + bias
    bound = sum_bound(torch.float32, 4 + 1, magnitude, implementations=2)
    assert_within(queries[0, [0, 2]], torch.nn.Linear.forward(projection, hidden[0, [0, 2]]), bound[[0, 2]])
    assert mlp.forward is swapped and restricted.rows is None
    assert "forward" not in projection.__dict__  # the class's forward again
    with restricted.at(torch.tensor([1])):  # entered again: the same swaps
        want = torch.nn.Linear.forward(projection, hidden[0, 1])
        assert_within(projection(hidden)[0, 1], want, bound[1])  # a GEMM row and a vector product
        assert not mlp(hidden)[0, 0].any()
    assert mlp.forward is swapped and "forward" not in projection.__dict__


def _recompile_limit_hits() -> int:
    reasons = torch._dynamo.utils.counters["unimplemented"]
    return sum(n for reason, n in reasons.items() if "recompile limit" in reason)


@pytest.mark.slow
def test_compiled_layers_take_it_without_recompiling_per_batch(tiny_llama_dir: Path) -> None:
    """Batches of new pooled-row counts reuse the graphs traced so far: the count is a dynamic size, not a
    guard (a graph per count would reach torch.compile's recompile limit, after which the layers run eager
    for the rest of the process)."""
    torch._dynamo.reset()  # no graphs of other tests' scorers: they count against the same limit
    hits = _recompile_limit_hits()
    whole = _scorer(tiny_llama_dir, compile="on", last_layer_pooled_rows=False)
    pooled = _scorer(tiny_llama_dir, compile="on")
    counters = torch._dynamo.utils.counters
    for count in (4, 2):  # 12 and 6 items: 16 and 8 pooled rows
        requests = _requests(count)
        _assert_same_results(pooled.score(requests), whole.score(requests), whole, requests)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    # 1 item (2 rows, the fewest), 3, 24 and 33 items (4, 32 and 64 rows): counts not seen before.
    one = ScoreRequest("one", query="the question", items=("an answer",), return_pooled_hidden_states=True)
    for requests in ([one], _requests(1), _requests(8), _requests(11)):
        _assert_same_results(pooled.score(requests), whole.score(requests), whole, requests)
    assert counters["stats"]["unique_graphs"] == graphs
    assert _recompile_limit_hits() == hits  # none: past the limit the layers would have run eager
