"""flash-linear-attention's kernels (the hybrids' CUDA path, models/linear_attention.py) against the float32
torch path on the same bfloat16 inputs, with several sequences and initial states; and the hybrids' shared
prefixes and prefix cache through the Scorer on the GPU."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from tolerances import FUNCTION_ULPS, TENSOR_CORES, forward_sums, gamma, half_forward_bound, unit_roundoff

from models import Scorer, ScorerConfig, write_tiny_model
from models.linear_attention import CHUNK, RuleInputs, Sequences, convolve, fla_available, recur
from models.tiny import HYBRIDS
from schemas import ScoreRequest, ScoreResult

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
LENGTHS = (1, 3, CHUNK + 1, 2 * CHUNK + 2, 200, 2)
BF16 = unit_roundoff(torch.bfloat16)


def _arrays(result: ScoreResult) -> tuple[np.ndarray, np.ndarray]:
    assert result.ok and result.pooled_hidden_states is not None, result.error
    hidden = np.stack([t.to_numpy().astype(np.float32) for t in result.pooled_hidden_states])
    return np.asarray(result.scores, dtype=np.float32), hidden


def _needs_fla() -> None:
    if not fla_available():
        pytest.skip("flash-linear-attention is not installed (the 'linear' extra)")


def _sequences(lengths: tuple[int, ...]) -> Sequences:
    bounds = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]))
    return Sequences.of(bounds, torch.device("cuda"))


def test_the_rule_matches_the_torch_path_from_initial_states() -> None:
    """Every output within the bound below of the float32 torch path, with half the sequences starting
    from a given state (a shared prefix's) of spectral norm up to 4 (a wrong layout moves outputs by up to
    4 / sqrt(Dk), several times the bound)."""
    _needs_fla()
    generator = torch.Generator(device="cuda").manual_seed(0)
    total, k_heads, heads, k_dim, v_dim = sum(LENGTHS), 2, 4, 64, 64
    cuda = {"device": "cuda", "generator": generator}
    inputs = RuleInputs(
        torch.randn(total, k_heads, k_dim, **cuda).bfloat16(),
        torch.randn(total, k_heads, k_dim, **cuda).bfloat16(),
        torch.randn(total, heads, v_dim, **cuda).bfloat16(),
        -0.5 - 1.5 * torch.rand(total, heads, **cuda),  # exp(g) <= exp(-0.5): the state forgets
        torch.rand(total, heads, **cuda).bfloat16(),
    )
    initial = torch.randn(len(LENGTHS), heads, k_dim, v_dim, **cuda)
    initial = 4 * initial / torch.linalg.matrix_norm(initial, ord=2, keepdim=True)
    initial[::2] = 0
    sequences = _sequences(LENGTHS)
    fla_out, fla_final, _ = recur("fla", inputs, sequences, initial)
    torch_out, torch_final, _ = recur("torch", inputs, sequences, initial)
    # The state's spectral norm M: each step maps S to exp(g) (I - beta k k^T) S + beta k v^T with |k| = 1
    # and beta <= 1, a contraction by exp(g) <= exp(-0.5) plus |v|: M <= |S0| + max|v| / (1 - exp(-0.5)).
    # fla stores in bfloat16, in series, the normalised q/k, the chunk's w and u, each chunk's state (one
    # per chunk, carried contractively into the next) and the output: at most (4 + chunks) roundings of
    # values at scale M, plus its tensor cores' float32 sums (a chunk's CHUNK terms, Dk-term products);
    # an output reads the state through q / sqrt(Dk), |q| = 1. The torch path's float32 error is 2^16
    # times smaller than bfloat16's and not counted.
    scale = 4.0 + float(inputs.value.float().norm(dim=-1).max()) / (1 - math.exp(-0.5))
    chunks = -(-max(LENGTHS) // CHUNK)
    relative = (4 + chunks) * BF16 + gamma(TENSOR_CORES * (CHUNK + 2 * k_dim), torch.float32)
    torch.testing.assert_close(fla_out.float(), torch_out, atol=relative * scale / math.sqrt(k_dim), rtol=0)
    torch.testing.assert_close(fla_final.float(), torch_final, atol=relative * scale, rtol=0)


def test_the_convolution_matches_the_torch_path_after_a_history() -> None:
    """causal_conv1d with each sequence's previous inputs (a shared prefix's last W-1): its state layout."""
    _needs_fla()
    generator = torch.Generator(device="cuda").manual_seed(1)
    total, channels, width = sum(LENGTHS), 128, 4
    cuda = {"device": "cuda", "generator": generator}
    x = torch.randn(total, channels, **cuda).bfloat16()
    weight = torch.randn(channels, width, **cuda).bfloat16()
    history = torch.randn(len(LENGTHS), width - 1, channels, **cuda).bfloat16().float()
    sequences = _sequences(LENGTHS)
    fla = convolve("fla", x, weight, sequences, history)
    reference = convolve("torch", x, weight, sequences, history)
    # A float32 sum of W products of bf16 values, its result rounded once to bfloat16 (as is the SiLU's),
    # the SiLU's exp within FUNCTION_ULPS: at the terms' magnitude sum |w| |x|.
    magnitude = float(weight.float().abs().sum(1).max()) * float(x.float().abs().max().clamp(min=1))
    atol = (
        2 * BF16 + gamma(TENSOR_CORES * width) + 2 * FUNCTION_ULPS * unit_roundoff(torch.float32)
    ) * magnitude
    torch.testing.assert_close(fla.float(), reference, atol=atol, rtol=0)


@pytest.mark.parametrize("architecture", HYBRIDS)
def test_shared_prefixes_on_the_gpu_score_as_unshared(architecture: str, tmp_path: Path) -> None:
    """bfloat16 on CUDA (fla where installed): a query longer than a chunk computed once for its items
    against the same requests with nothing shared; two bf16 forwards of the same prompts."""
    model_dir = write_tiny_model(tmp_path / architecture, architecture, seed=12)
    generator = torch.Generator().manual_seed(2)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(4, 500, (n,), generator=generator).tolist())

    query = ids(CHUNK + 30)
    requests = [
        ScoreRequest("q", query=query, items=(ids(1), ids(5), ids(150)), return_pooled_hidden_states=True)
    ]
    plain = Scorer(model_dir, ScorerConfig(device="cuda", dtype="bfloat16"))
    shared = Scorer(model_dir, ScorerConfig(device="cuda", dtype="bfloat16", share_prefix_min_tokens=8))
    assert shared.executor.linear_layers is not None
    (got_scores, got_hidden), (scores, hidden) = (
        _arrays(shared.score(requests)[0]),
        _arrays(plain.score(requests)[0]),
    )
    assert shared.executor.row_tokens == len(query) + 1 + 5 + 150  # the query once
    sums = forward_sums(model_dir, len(query) + 150)
    for got, want in ((got_scores, scores), (got_hidden, hidden)):
        # Two bf16 forwards of the same prompts (tolerances.half_forward_bound), at the values' scale.
        scale = max(1.0, float(np.abs(want).max()))
        bound = half_forward_bound(torch.bfloat16, sums=sums, magnitude=scale, accumulation=TENSOR_CORES)
        np.testing.assert_allclose(got, want, atol=bound, rtol=0)


@pytest.mark.parametrize("architecture", HYBRIDS)
def test_the_prefix_cache_on_the_gpu_scores_as_without_it(architecture: str, tmp_path: Path) -> None:
    """bfloat16 on CUDA: a prompt longer than a chunk kept in the prefix cache (its blocks' states from the
    float32 torch rule on the device) and then read by a longer prompt and by itself beside a prompt the
    cache lacks (flash-linear-attention's kernels from the cached states and convolution inputs, where
    installed), against the same requests without the cache: two bf16 forwards of the same prompts."""
    model_dir = write_tiny_model(tmp_path / architecture, architecture, seed=13)
    generator = torch.Generator().manual_seed(3)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(4, 500, (n,), generator=generator).tolist())

    prompt = ids(CHUNK + 37)
    calls = [[prompt + ids(3)], [prompt + ids(3), prompt + ids(40), ids(30)]]
    common = {"device": "cuda", "dtype": "bfloat16"}
    cached = Scorer(
        model_dir,
        ScorerConfig(**common, prefix_cache_mib=64, prefix_cache_block_tokens=16, prefix_cache_admit="first"),
    )
    plain = Scorer(model_dir, ScorerConfig(**common))
    sums = forward_sums(model_dir, len(prompt) + 40)
    for prompts in calls:
        requests = [
            ScoreRequest(str(k), items=(p,), return_pooled_hidden_states=True) for k, p in enumerate(prompts)
        ]
        for got_result, want_result in zip(cached.score(requests), plain.score(requests), strict=True):
            for got, want in zip(_arrays(got_result), _arrays(want_result), strict=True):
                # Two bf16 forwards of the same prompts (tolerances.half_forward_bound), at the values' scale.
                scale = max(1.0, float(np.abs(want).max()))
                bound = half_forward_bound(
                    torch.bfloat16, sums=sums, magnitude=scale, accumulation=TENSOR_CORES
                )
                np.testing.assert_allclose(got, want, atol=bound, rtol=0)
    stats = cached.executor.prefix_cache.stats  # type: ignore[union-attr]
    assert (stats.hits, stats.tokens_saved) == (2, 2 * 96)


@pytest.mark.parametrize("architecture", HYBRIDS)
def test_adapters_on_the_gpu_score_a_mixed_batch_as_each_request_alone(
    architecture: str, tmp_path: Path
) -> None:
    """bfloat16 on CUDA: a batch mixing three LoRA adapters (their Gated DeltaNet projections adapted too)
    and the base model, through flash-linear-attention's kernels where installed, scores each request as
    that request alone in its own batch (two bf16 forwards of the same prompts); and an adapter moves its
    requests by more than that bound. The adapters' arithmetic against PEFT's float32 merge is the CPU
    suite's (tests/models/test_adapters.py)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "models"))  # tests/models, for its adapters
    from test_adapters import _adapters, _mixed_requests, _setting

    model_dir = write_tiny_model(tmp_path / architecture, architecture, seed=14)
    adapters = _adapters(model_dir, str(tmp_path))
    scorer = Scorer(model_dir, ScorerConfig(device="cuda", dtype="bfloat16", adapters=_setting(adapters)))
    chosen, requests = _mixed_requests()
    together = scorer.score(requests)
    longest = max(len(p) for r in requests for p in scorer.prepare(r).prompts)
    sums = forward_sums(model_dir, longest)
    for name, request, got_result in zip(chosen, requests, together, strict=True):
        (alone,) = scorer.score([request])
        (base,) = scorer.score([ScoreRequest(request.request_id, items=request.items, query=request.query)])
        got, want = _arrays(got_result), _arrays(alone)
        for a, b in zip(got, want, strict=True):
            # Two bf16 forwards of the same prompts (tolerances.half_forward_bound), at the values' scale.
            scale = max(1.0, float(np.abs(b).max()))
            bound = half_forward_bound(torch.bfloat16, sums=sums, magnitude=scale, accumulation=TENSOR_CORES)
            np.testing.assert_allclose(a, b, atol=bound, rtol=0)
        if name is not None:  # the adapter moved the scores by more than the bound
            scale = max(1.0, float(np.abs(want[0]).max()))
            bound = half_forward_bound(torch.bfloat16, sums=sums, magnitude=scale, accumulation=TENSOR_CORES)
            assert float(np.abs(want[0] - np.asarray(base.scores, dtype=np.float32)).max()) > bound
