"""Hybrid decoders (Gated DeltaNet layers with full attention) on the packed path, against HF float32 with
every prompt alone: no state or convolution window carried from one item to the next."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scoring_testkit import assert_forward_close, forward_atol, hidden_of, scores_of
from tolerances import FUNCTION_ULPS, sum_bound, unit_roundoff
from transformers import AutoModelForSequenceClassification

from models import ModelLoadError, Scorer, ScorerConfig, write_tiny_model
from models.linear_attention import (
    CHUNK,
    RuleInputs,
    Sequences,
    causal_conv_torch,
    conv_history,
    gated_delta_rule_torch,
    hf_torch_functions,
    is_hybrid,
    resolve_kernel,
)
from models.tiny import HYBRIDS
from schemas import ScoreRequest

# Items of one token, a few, just over a chunk, two chunks and more, up to 200 tokens.
LENGTHS = (1, 3, CHUNK + 1, 2 * CHUNK + 2, 200, 2)


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp(f"hybrid-{request.param}"), request.param, seed=8)


@pytest.fixture(scope="module")
def hf_model(hybrid_dir: Path) -> torch.nn.Module:
    return AutoModelForSequenceClassification.from_pretrained(str(hybrid_dir), dtype=torch.float32).eval()


def _ids(lengths: Sequence[int], seed: int) -> list[tuple[int, ...]]:
    generator = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(4, 500, (n,), generator=generator).tolist()) for n in lengths]


@torch.no_grad()
def _alone(model: torch.nn.Module, prompt: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """HF's score and final hidden state at the last token of `prompt` run alone (no padding, no batch)."""
    out = model(input_ids=torch.tensor([list(prompt)]), output_hidden_states=True)
    return out.logits[0].numpy(), out.hidden_states[-1][0, -1].numpy()


def _sequences(lengths: Sequence[int]) -> Sequences:
    return Sequences.of(torch.tensor(np.concatenate([[0], np.cumsum(lengths)])), torch.device("cpu"))


def _delta_rule_float64(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: list[torch.Tensor] | None = None,
    initial: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence token by token in float64 (the rule's definition): outputs [L, H, Dv] and the
    corrections u [L, H, Dv]; q/k [L, Hk, Dk] l2-normalised here, each key head serving consecutive heads.
    `states`, where given, gets the state after every token [H, Dk, Dv]; `initial`: the state before the
    first (zeros where not given)."""
    heads, k_dim = v.shape[1], k.shape[2]
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    q = F.normalize(q, dim=-1).repeat_interleave(heads // q.shape[1], dim=1) * k_dim**-0.5
    k = F.normalize(k, dim=-1).repeat_interleave(heads // k.shape[1], dim=1)
    state = (
        torch.zeros(heads, k_dim, v.shape[2], dtype=torch.float64) if initial is None else initial.double()
    )
    outs, corrections = [], []
    for t in range(v.shape[0]):
        state = state * g[t].exp()[:, None, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", state, k[t]))
        state = state + k[t][:, :, None] * u[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", state, q[t]))
        corrections.append(u)
        if states is not None:
            states.append(state)
    return torch.stack(outs), torch.stack(corrections)


def test_the_chunked_rule_restarts_at_every_sequence() -> None:
    """Several sequences in one row (one token, just over a chunk, two chunks and more) against each one
    alone, token by token in float64."""
    generator = torch.Generator().manual_seed(0)
    total, k_heads, heads, k_dim, v_dim = sum(LENGTHS), 2, 4, 16, 8
    q = torch.randn(total, k_heads, k_dim, generator=generator)
    k = torch.randn(total, k_heads, k_dim, generator=generator)
    v = torch.randn(total, heads, v_dim, generator=generator)
    g = -torch.rand(total, heads, generator=generator) * 0.5  # log decays: exp(g) in (0.6, 1]
    beta = torch.rand(total, heads, generator=generator)
    out, final, _ = gated_delta_rule_torch(RuleInputs(q, k, v, g, beta), _sequences(LENGTHS))
    assert final.shape == (len(LENGTHS), heads, k_dim, v_dim)
    start = 0
    for length in LENGTHS:
        rows = slice(start, start + length)
        expected, corrections = _delta_rule_float64(q[rows], k[rows], v[rows], g[rows], beta[rows])
        # Every state entry is a decayed sum over the sequence's tokens of k_j u_j (|k_j| <= 1), and every
        # output reads the state through q / sqrt(Dk) (|q| <= 1): the terms' magnitude is at most the sum of
        # the corrections' |u_j|. The float32 chain: the sum over the tokens, the chunk's triangular solve
        # (CHUNK earlier corrections), the reads of the state by each key and by the query (Dk terms each),
        # plus the exp of the decays (FUNCTION_ULPS) over the same magnitude; against float64 (1).
        magnitude = float(corrections.abs().sum(0).max())
        chain = length + CHUNK + 2 * k_dim
        atol = (
            sum_bound(torch.float32, chain, magnitude)
            + 2 * FUNCTION_ULPS * unit_roundoff(torch.float32) * magnitude * length
        )
        np.testing.assert_allclose(out[rows].double().numpy(), expected.numpy(), atol=atol, rtol=0)
        start += length


def test_the_chunked_rule_gives_the_state_after_any_row() -> None:
    """The states the prefix cache keeps at block ends: after rows anywhere in a chunk (its first, its last,
    inside), in several sequences of one row, some from an initial state, against the float64 definition
    from that state."""
    generator = torch.Generator().manual_seed(4)
    lengths = (CHUNK + 5, 17, 2 * CHUNK + 3)
    total, k_heads, heads, k_dim, v_dim = sum(lengths), 2, 4, 16, 8
    q = torch.randn(total, k_heads, k_dim, generator=generator)
    k = torch.randn(total, k_heads, k_dim, generator=generator)
    v = torch.randn(total, heads, v_dim, generator=generator)
    g = -torch.rand(total, heads, generator=generator) * 0.5
    beta = torch.rand(total, heads, generator=generator)
    initial = torch.randn(len(lengths), heads, k_dim, v_dim, generator=generator)
    initial[1] = 0
    starts = np.concatenate([[0], np.cumsum(lengths)])
    # Row 0 (a sequence's first), CHUNK - 1 and CHUNK (a chunk's last and the next's first), 15 (inside
    # the second sequence, its 16th), the third's last.
    at = [0, CHUNK - 1, CHUNK, int(starts[1]) + 15, total - 1]
    _, _, kept = gated_delta_rule_torch(RuleInputs(q, k, v, g, beta), _sequences(lengths), initial, at)
    assert kept is not None and kept.shape == (len(at), heads, k_dim, v_dim)
    for index, row in enumerate(at):
        sequence = int(np.searchsorted(starts, row, side="right")) - 1
        rows = slice(int(starts[sequence]), row + 1)
        states: list[torch.Tensor] = []
        parts = (q[rows], k[rows], v[rows], g[rows], beta[rows])
        _, corrections = _delta_rule_float64(*parts, states, initial[sequence])
        # As the outputs' bound: the state is the decayed sum of k_j u_j (|k_j| = 1) plus the initial state
        # through steps exp(g) (I - beta k k^T), none of which grows a spectral norm (beta <= 1, |k| = 1), so
        # each entry is at most the two magnitudes; float32 over the same chain (the tokens, the chunk's
        # solve, the key reads) and the decays' exp.
        magnitude = float(corrections.abs().sum(0).max()) + float(
            torch.linalg.matrix_norm(initial[sequence], ord=2).max()
        )
        chain = (row + 1 - int(starts[sequence])) + CHUNK + 2 * k_dim
        atol = (
            sum_bound(torch.float32, chain, magnitude)
            + 2 * FUNCTION_ULPS * unit_roundoff(torch.float32) * magnitude * chain
        )
        np.testing.assert_allclose(kept[index].double().numpy(), states[-1].numpy(), atol=atol, rtol=0)


def test_the_convolution_window_restarts_at_every_sequence() -> None:
    generator = torch.Generator().manual_seed(1)
    total, channels, width = sum(LENGTHS), 6, 4
    x = torch.randn(total, channels, generator=generator)
    weight = torch.randn(channels, width, generator=generator)
    out = causal_conv_torch(x, weight, _sequences(LENGTHS))
    start = 0
    for length in LENGTHS:
        alone = x[start : start + length].double().T.unsqueeze(0)  # [1, C, L]
        # HF's convolution of a prompt alone: zeros before its first token.
        conv = F.conv1d(alone, weight.double().unsqueeze(1), padding=width - 1, groups=channels)
        expected = F.silu(conv[0, :, :length]).T
        # A sum of `width` products in float32 against float64, then SiLU (its exp within FUNCTION_ULPS).
        magnitude = float((x.abs().max() * weight.abs().sum(1)).max())
        atol = (
            sum_bound(torch.float32, width, magnitude)
            + 2 * FUNCTION_ULPS * unit_roundoff(torch.float32) * magnitude
        )
        np.testing.assert_allclose(
            out[start : start + length].double().numpy(), expected.numpy(), atol=atol, rtol=0
        )
        start += length


def test_an_item_scores_after_another_as_alone(hybrid_dir: Path, hf_model: torch.nn.Module) -> None:
    """The state and convolution window of the first item must not reach the second: the second scores as
    it does alone. HF's own layer on the same packed row (positions restarting) does carry them, by more
    than the tolerance: the check can tell."""
    first, second = _ids((150, 9), seed=3)
    scorer = Scorer(hybrid_dir, ScorerConfig(device="cpu"))
    result = scorer.score([ScoreRequest("pair", items=(first, second), return_pooled_hidden_states=True)])[0]
    logits, hidden = _alone(hf_model, second)
    longest = len(first)
    assert_forward_close(scores_of(result)[1], logits, hybrid_dir, longest=longest)
    assert_forward_close(hidden_of(result)[1], hidden, hybrid_dir, longest=longest)
    with torch.no_grad():  # HF's forward on the packed row: the leak the packed path must not have
        ids = torch.tensor([list(first) + list(second)])
        positions = torch.tensor([list(range(len(first))) + list(range(len(second)))])
        leaked = hf_model(input_ids=ids, position_ids=positions, output_hidden_states=True)
    leaked_hidden = leaked.hidden_states[-1][0, -1].numpy()
    assert np.abs(leaked_hidden - hidden).max() > 10 * forward_atol(hybrid_dir, hidden, longest=longest)


def test_items_of_every_length_and_multi_item_requests(hybrid_dir: Path, hf_model: torch.nn.Module) -> None:
    """One-token items, items longer than a chunk, a query with several items, all in one batch."""
    items = _ids(LENGTHS, seed=4)
    (query,) = _ids((20,), seed=5)
    requests = [
        ScoreRequest(f"single-{i}", items=(item,), return_pooled_hidden_states=True)
        for i, item in enumerate(items)
    ]
    requests.append(
        ScoreRequest("multi", query=query, items=tuple(items[:4]), return_pooled_hidden_states=True)
    )
    scorer = Scorer(hybrid_dir, ScorerConfig(device="cpu"))
    results = scorer.score(requests)
    prompts = [*items, *(query + item for item in items[:4])]
    expected = [_alone(hf_model, p) for p in prompts]
    scores = np.concatenate([scores_of(r) for r in results])
    hidden = np.concatenate([hidden_of(r) for r in results])
    longest = max(len(p) for p in prompts)
    assert_forward_close(scores, np.stack([e[0] for e in expected]), hybrid_dir, longest=longest)
    assert_forward_close(hidden, np.stack([e[1] for e in expected]), hybrid_dir, longest=longest)


def test_the_family_declares_its_layers(hybrid_dir: Path, hf_model: torch.nn.Module) -> None:
    assert is_hybrid(hf_model.config)
    scorer = Scorer(hybrid_dir, ScorerConfig(device="cpu"))
    assert scorer.attention == "reference"  # packed, not the padded plain path
    linear = scorer.executor.linear_layers
    assert linear is not None and len(linear) == 3 and linear.kernel == "torch"
    # float32 on CUDA stays on torch's products (Triton's may round float32 inputs to TF32).
    assert resolve_kernel(torch.device("cuda"), torch.float32) == "torch"
    assert resolve_kernel(torch.device("cpu"), torch.bfloat16) == "torch"


def test_fp8_is_refused(hybrid_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"quantization='fp8'.*Gated DeltaNet layers are not served"):
        Scorer(hybrid_dir, ScorerConfig(device="cpu", quantization="fp8"))


def test_shared_prefixes_longer_than_a_chunk_carry_their_state(
    hybrid_dir: Path, hf_model: torch.nn.Module
) -> None:
    """A query of CHUNK + 6 tokens computed once for items of 1, 3 and 100 tokens: each suffix starts from
    its prefix's final recurrent state and last convolution inputs, and scores as its whole prompt alone."""
    (query, *items) = _ids((CHUNK + 6, 1, 3, 100), seed=6)
    (other,) = _ids((7,), seed=7)
    scorer = Scorer(hybrid_dir, ScorerConfig(device="cpu", share_prefix_min_tokens=8))
    requests = [
        ScoreRequest("shared", query=query, items=tuple(items), return_pooled_hidden_states=True),
        ScoreRequest("other", items=(other,), return_pooled_hidden_states=True),
    ]
    results = scorer.score(requests)
    prompts = [query + item for item in items] + [other]
    assert scorer.executor.row_tokens == sum(len(p) for p in prompts) - 2 * len(query)  # the query once
    expected = [_alone(hf_model, p) for p in prompts]
    longest = max(len(p) for p in prompts)
    scores = np.concatenate([scores_of(r) for r in results])
    hidden = np.concatenate([hidden_of(r) for r in results])
    assert_forward_close(scores, np.stack([e[0] for e in expected]), hybrid_dir, longest=longest)
    assert_forward_close(hidden, np.stack([e[1] for e in expected]), hybrid_dir, longest=longest)


def test_a_prefix_history_holds_its_last_inputs() -> None:
    """conv_history: the last W-1 inputs of each sequence, zeros before a sequence shorter than that."""
    x = torch.arange(1.0, 8.0).unsqueeze(1)  # rows 1..7, one channel
    history = conv_history(x, _sequences((5, 1, 1)), width=4)
    assert history[..., 0].tolist() == [[3.0, 4.0, 5.0], [0.0, 0.0, 6.0], [0.0, 0.0, 7.0]]


def test_hf_runs_its_own_torch_functions_inside_and_its_kernels_after() -> None:
    """hf_torch_functions: inside, HF's module names hold its own torch functions; after, what was there."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    with hf_torch_functions():  # the suite's session fixture holds them already: nest and leave
        inside = hf.torch_chunk_gated_delta_rule
        assert inspect.unwrap(inside) is inside
    before = hf.torch_chunk_gated_delta_rule
    with hf_torch_functions():
        pass
    assert hf.torch_chunk_gated_delta_rule is before


def test_tensor_parallelism_is_refused(hybrid_dir: Path) -> None:
    from models.loading import read_config
    from models.tensor_parallel import check_splittable

    with pytest.raises(ModelLoadError, match="Gated DeltaNet layers have no sharded form"):
        check_splittable(hybrid_dir, read_config(hybrid_dir), trust_remote_code=False, world=2)


def test_compiled_layers_stay_off_with_a_reason(hybrid_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="models.mechanisms"):
        scorer = Scorer(hybrid_dir, ScorerConfig(device="cpu", compile="on"))
    assert not scorer.executor.compiled and scorer.executor.graphs is None
    assert "compiled layers" in caplog.text and "stay off" in caplog.text


def test_deterministic_runs_every_item_alone_bit_for_bit(hybrid_dir: Path) -> None:
    """The deterministic setting: every item alone (the kernels' shapes follow the batch), so an item's
    bits are the same in any company."""
    scorer = Scorer(hybrid_dir, ScorerConfig(device="cpu", deterministic=True))
    assert scorer.executor.row_tiles is None
    items = _ids((70, 5, 130), seed=9)
    together = scorer.score([ScoreRequest("all", items=tuple(items), return_pooled_hidden_states=True)])[0]
    alone = scorer.score([ScoreRequest("one", items=(items[1],), return_pooled_hidden_states=True)])[0]
    np.testing.assert_array_equal(scores_of(together)[1], scores_of(alone)[0])
    np.testing.assert_array_equal(hidden_of(together)[1], hidden_of(alone)[0])
