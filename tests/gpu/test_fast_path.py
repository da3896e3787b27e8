"""The fast GPU path against HuggingFace: the real varlen kernel, the compiled layers and CUDA graphs.

Marked `gpu` and skipped without a CUDA device; run on the GPU machine with
`python -m pytest -m gpu tests/gpu tests/models/test_gpu_faults.py` (with pytest-xdist, `-n 6` runs the whole
suite on the one GPU in about five minutes). The CPU suite covers the same logic
with a CPU varlen kernel and a stand-in graph recorder (tests/models/test_cuda_graphs.py).
"""

from __future__ import annotations

import dataclasses
import inspect
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from architecture_check import GQA_MODEL
from tolerances import (
    TENSOR_CORES,
    assert_within,
    attention_bound,
    forward_bound,
    forward_length,
    forward_sums,
    gated_silu_bound,
    half_forward_bound,
    lse_bound,
    merged_attention_bound,
    unit_roundoff,
)

from models import Scorer, ScorerConfig
from models.tiny import ARCHITECTURES, HYBRIDS
from schemas import ScoreRequest, ScoreResult

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _requests(
    count: int, length: int, seed: int, vocab: int = 500, labels: tuple[int, ...] | None = None
) -> list[ScoreRequest]:
    """`count` one-item requests of `length` random token ids; a judge's scored on `labels`."""
    generator = torch.Generator().manual_seed(seed)
    return [
        ScoreRequest(
            request_id=f"r{i}",
            items=(tuple(torch.randint(4, vocab, (length,), generator=generator).tolist()),),
            return_pooled_hidden_states=True,
            label_token_ids=labels,
        )
        for i in range(count)
    ]


def _testkit() -> Any:
    """tests/models/scoring_testkit.py, imported where a test needs it (tests/models is not on the path when
    tests/gpu runs alone)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
    import scoring_testkit

    return scoring_testkit


def _bf16_bound(model_dir: Path, longest: int, magnitude: float, implementations: int = 2) -> float:
    """tolerances.half_forward_bound for a tiny model's bf16 forward on the GPU (tensor cores' float32 sums,
    each sum's result rounded to bfloat16, u = 2^-8): its sums in series (scoring_testkit.forward_sums) for
    prompts of up to `longest` tokens, at `magnitude` (a score scale, or 1 for a norm-wise relative error)."""
    sums = forward_sums(model_dir, longest)
    return half_forward_bound(
        torch.bfloat16,
        sums=sums,
        magnitude=magnitude,
        accumulation=TENSOR_CORES,
        implementations=implementations,
    )


def _arrays(results: list[ScoreResult]) -> tuple[np.ndarray, np.ndarray]:
    assert all(r.error is None for r in results), [r.error for r in results if r.error]
    scores = np.array([r.scores[0] for r in results], dtype=np.float32)
    hidden = np.stack([r.pooled_hidden_states[0].to_numpy().astype(np.float32) for r in results])  # type: ignore[index]
    return scores, hidden


@pytest.mark.parametrize("count", [1, 7, 64])
def test_a_replayed_graph_scores_the_batch_it_is_given(count: int, tiny_qwen3_dir: Path) -> None:
    """Recorded on one batch, replayed on another of the same shape: the second batch's own results, as the
    same compiled layers give them without graphs (bf16: padding changes the matmul tiling: not bitwise)."""
    graphed = Scorer(tiny_qwen3_dir, ScorerConfig(device="cuda", dtype="bfloat16"))
    plain = Scorer(tiny_qwen3_dir, ScorerConfig(device="cuda", dtype="bfloat16", cuda_graphs="off"))
    assert graphed.executor.graphs is not None and plain.executor.graphs is None and graphed.info.cuda_graphs
    for seed in (1, 3):  # a shape is recorded at its second batch
        graphed.score(_requests(count, 100, seed=seed))
    second = _requests(count, 100, seed=2)
    got_scores, got_hidden = _arrays(graphed.score(second))
    assert graphed.executor.graphs.recorded == 1 and graphed.executor.graphs.replays == 1
    want_scores, want_hidden = _arrays(plain.score(second))
    scale = max(1.0, float(np.abs(want_scores).max()))
    # Two bf16 forwards (padding changes the matmuls' tiling): the model's sums in series for 100-token
    # prompts, each rounded to bf16 (_bf16_bound), at the scores' scale and, norm-wise, relative to the state.
    np.testing.assert_allclose(got_scores, want_scores, atol=_bf16_bound(tiny_qwen3_dir, 100, scale), rtol=0)
    relative = np.linalg.norm(got_hidden - want_hidden, axis=1) / np.linalg.norm(want_hidden, axis=1)
    assert relative.max() <= _bf16_bound(tiny_qwen3_dir, 100, 1.0)
    # And not the first batch's results: the inputs were read from the buffers at replay (further apart
    # than two computations of one batch can be).
    _, first_hidden = _arrays(plain.score(_requests(count, 100, seed=1)))
    apart = np.linalg.norm(got_hidden - first_hidden, axis=1) / np.linalg.norm(first_hidden, axis=1)
    assert apart.min() > _bf16_bound(tiny_qwen3_dir, 100, 1.0)


def test_graphs_recorded_ahead_score_a_request_the_first_time_its_shape_comes(tiny_qwen3_dir: Path) -> None:
    """Small-batch graphs recorded before any request (on placeholder buffers), then replayed on requests of
    one to four items on each side of the Triton kernel's switch: their own results, as without graphs."""
    from models.graphs import SMALL_BATCH_TOKENS, small_batch_keys

    graphed = Scorer(tiny_qwen3_dir, ScorerConfig(device="cuda", dtype="bfloat16"))
    plain = Scorer(tiny_qwen3_dir, ScorerConfig(device="cuda", dtype="bfloat16", cuda_graphs="off"))
    assert graphed.executor.graphs is not None and graphed.attention_kernel == "triton"
    assert graphed.executor.record_small_batch_graphs(graphed.config.max_batch_tokens) == len(
        small_batch_keys(SMALL_BATCH_TOKENS)
    )
    generator = np.random.default_rng(5)
    for n, lengths in enumerate([(30,), (3, 41, 200), (17, 1, 1, 1), (500, 480, 2), (300, 300, 300, 300)]):
        request = ScoreRequest(
            request_id=f"ahead-{n}",
            items=tuple(tuple(generator.integers(4, 500, length).tolist()) for length in lengths),
            return_pooled_hidden_states=True,
        )
        got, want = graphed.score([request])[0], plain.score([request])[0]
        assert got.ok and want.ok, (got.error, want.error)
        assert graphed.executor.graphs.replays == n + 1, lengths
        want_scores = np.array([s[0] for s in want.scores], dtype=np.float32)
        got_scores = np.array([s[0] for s in got.scores], dtype=np.float32)
        scale = max(1.0, float(np.abs(want_scores).max()))
        # Two bf16 forwards of these prompts (_bf16_bound), at the scores' scale and norm-wise.
        atol = _bf16_bound(tiny_qwen3_dir, max(lengths), scale)
        np.testing.assert_allclose(got_scores, want_scores, atol=atol, rtol=0)
        assert got.pooled_hidden_states is not None and want.pooled_hidden_states is not None
        for got_hidden, want_hidden in zip(got.pooled_hidden_states, want.pooled_hidden_states, strict=True):
            g, w = (t.to_numpy().astype(np.float32) for t in (got_hidden, want_hidden))
            assert np.linalg.norm(g - w) / np.linalg.norm(w) <= _bf16_bound(tiny_qwen3_dir, max(lengths), 1.0)


@pytest.mark.parametrize("kernel", ["flash", "triton", "fa4"])
@pytest.mark.parametrize("architecture", ["llama", "qwen3", "mistral", "gemma3_text", "olmo3", "glm4"])
def test_shared_prefixes_through_the_flash_kernel_match_float32_hf(
    architecture: str, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three requests' 40-token queries, each computed once for its items, through the real varlen kernel
    (more keys than queries per sequence), the compiled layers and a replayed CUDA graph (three groups in
    four slots: one left empty, its bounds padded on the device): each item as its whole prompt in HF
    float32, within one bf16 forward's bound (_against_float32_hf). With kernel "triton", both passes take
    the Triton kernel (these prompts are shorter than its minimum); with "fa4", FlashAttention-4 (skipped
    where it is not installed)."""
    from models import triton_attention

    _skip_without(kernel)
    monkeypatch.setattr(triton_attention, "MIN_LENGTH", 0)

    hf_reference = _testkit().hf_reference

    from models.tiny import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(Path(tmp) / architecture, architecture, seed=5, num_labels=1)
        queries = [tuple(range(start, start + 40)) for start in (40, 140, 240)]
        items = ((5, 6, 7), tuple(range(100, 130)), (30,), (31, 32))
        requests = [
            ScoreRequest(f"multi-{i}", query=query, items=items, return_pooled_hidden_states=True)
            for i, query in enumerate(queries)
        ]
        config = ScorerConfig(
            device="cuda",
            dtype="bfloat16",
            share_prefix_min_tokens=8,
            attention_kernel=kernel,  # type: ignore[arg-type]
        )
        scorer = Scorer(model_dir, config)
        for _ in range(3):  # the ordinary forward, then a recording, then a replay: the last is checked
            results = scorer.score(requests)
            assert all(result.error is None for result in results), results
        if config.cuda_graphs != "off":
            assert scorer.executor.graphs is not None and scorer.executor.graphs.replays == 1
        prompts = [query + item for query in queries for item in items]
        reference = hf_reference(model_dir, prompts)
        bf16 = hf_reference(model_dir, prompts, dtype=torch.bfloat16)
        longest = max(len(p) for p in prompts)
        scores_bound, hidden_bound = _against_float32_hf(model_dir, longest, reference, bf16)
    scores = np.array([row for result in results for row in result.scores], dtype=np.float32)
    assert float(np.abs(scores - reference.logits).max()) <= scores_bound
    hidden = np.stack(
        [t.to_numpy().astype(np.float32) for result in results for t in result.pooled_hidden_states or ()]
    )
    relative = np.linalg.norm(hidden - reference.hidden, axis=1) / np.linalg.norm(reference.hidden, axis=1)
    assert relative.max() <= hidden_bound


@pytest.mark.parametrize("kernel", ["triton", "fa4"])
@pytest.mark.parametrize("architecture", ["llama", "qwen3", "mistral", "gemma3_text", "phi3"])
def test_kernel_in_the_engine_matches_float32_hf(
    architecture: str, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Triton attention kernel (or FlashAttention-4) through compiled layers and a replayed CUDA graph, on
    prompts that cross its blocks (1 to 300 tokens), against HF float32 within bf16's error (as the
    shared-prefix test)."""
    from models import triton_attention

    _skip_without(kernel)
    monkeypatch.setattr(triton_attention, "MIN_LENGTH", 0)
    config = ScorerConfig(device="cuda", dtype="bfloat16", attention_kernel=kernel)  # type: ignore[arg-type]
    info = _engine_matches_float32_hf(architecture, config)
    assert info.attention_kernel == kernel


@pytest.mark.parametrize("architecture", ["llama", "qwen3", "qwen2", "mistral", "phi3", "olmo2", "glm4"])
def test_fused_mlp_in_the_engine_matches_float32_hf(architecture: str) -> None:
    """The fused gate/up/SiLU kernel (models/fused_mlp.py) in every MLP of the model, through compiled layers
    and a replayed CUDA graph, against HF float32 within bf16's error."""
    info = _engine_matches_float32_hf(
        architecture, ScorerConfig(device="cuda", dtype="bfloat16", fused_mlp="on")
    )
    assert info.fused_mlp


@pytest.mark.parametrize(
    ("architecture", "fused"),
    [
        ("llama", "on"),
        ("qwen3", "on"),
        ("phi3", "on"),
        ("mistral", "off"),
        ("gemma3_text", "off"),
        ("olmo2", "on"),
        ("olmo3", "off"),
        ("glm4", "on"),
        ("smollm3", "on"),
    ],
)
def test_the_last_layer_at_pooled_rows_matches_float32_hf(architecture: str, fused: str) -> None:
    """The last layer's query and output projections and MLP at the pooled rows only (models/pooled_rows.py;
    Phi-3's fused q/k/v projection whole) in the ordinary forward (graphs off; the other engine tests replay
    graphs, which pool the same way), through compiled layers and, where it applies, the fused MLP kernel:
    against HF float32 within bf16's error. (The CPU tests count the rows each projection is given.)"""
    config = ScorerConfig(
        device="cuda",
        dtype="bfloat16",
        cuda_graphs="off",
        fused_mlp=fused,  # type: ignore[arg-type]
    )
    info = _engine_matches_float32_hf(architecture, config)
    assert info.fused_mlp == (fused == "on")


@pytest.mark.parametrize(("tokens", "hidden", "width"), [(1, 64, 128), (300, 200, 136), (6400, 1024, 3072)])
def test_fused_mlp_kernel_matches_float32_in_bfloat16(tokens: int, hidden: int, width: int) -> None:
    """The kernel compiled, on partial row and column tiles and a hidden size off its step, against
    float32."""
    from models import fused_mlp

    generator = torch.Generator(device="cuda").manual_seed(tokens + width)
    x = torch.randn(tokens, hidden, device="cuda", generator=generator).bfloat16()
    gate, up = (
        (torch.randn(width, hidden, device="cuda", generator=generator) / hidden**0.5).bfloat16()
        for _ in range(2)
    )
    want = torch.nn.functional.silu(x.float() @ gate.float().t()) * (x.float() @ up.float().t())
    got = fused_mlp.gate_up_silu(x, gate, up)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, width)
    # Both from the same bf16 operands with float32 sums (tensor cores truncating: gated_silu_bound each),
    # the kernel's then rounded to bf16 (u = 2^-8 of |out|): per element, and as a norm.
    float32_part = 2 * gated_silu_bound(x, gate, up, accumulation=TENSOR_CORES)
    bound = float32_part + unit_roundoff(torch.bfloat16) * want.double().abs()
    relative = float((got.float() - want).norm() / want.norm())
    assert relative <= float(bound.norm() / want.double().norm()), relative
    assert_within(got, want, bound, "fused gate/up/SiLU")


def _engine_matches_float32_hf(architecture: str, config: ScorerConfig) -> Any:
    """Score prompts of 1 to 300 tokens with a tiny model of `architecture` under `config` three times (the
    ordinary forward, a recording, a replay; without graphs, the ordinary forward three times), check the
    last against HF float32 within one bf16 forward's bound (_against_float32_hf), and return the scorer's
    info."""
    hf_reference = _testkit().hf_reference

    from models.tiny import write_tiny_model

    generator = torch.Generator().manual_seed(11)
    prompts = [
        tuple(torch.randint(4, 500, (n,), generator=generator).tolist()) for n in (300, 17, 130, 1, 64, 65)
    ]
    requests = [
        ScoreRequest(f"r{i}", items=(prompt,), return_pooled_hidden_states=True)
        for i, prompt in enumerate(prompts)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(Path(tmp) / architecture, architecture, seed=5, num_labels=1)
        scorer = Scorer(model_dir, config)
        for _ in range(3):  # the ordinary forward, then a recording, then a replay: the last is checked
            results = scorer.score(requests)
        if config.cuda_graphs != "off":
            assert scorer.executor.graphs is not None and scorer.executor.graphs.replays == 1
        reference = hf_reference(model_dir, list(prompts))
        bf16 = hf_reference(model_dir, list(prompts), dtype=torch.bfloat16)
        scores_bound, hidden_bound = _against_float32_hf(model_dir, 300, reference, bf16)
    scores, hidden = _arrays(results)
    assert float(np.abs(scores.reshape(-1) - reference.logits.reshape(-1)).max()) <= scores_bound
    relative = np.linalg.norm(hidden - reference.hidden, axis=1) / np.linalg.norm(reference.hidden, axis=1)
    assert relative.max() <= hidden_bound
    return scorer.info


def _against_float32_hf(model_dir: Path, longest: int, reference: Any, bf16: Any) -> tuple[float, float]:
    """How far the engine's bf16 results may be from HF's float32 ones: one bf16 forward's bound
    (_bf16_bound, implementations=1) plus float32's own (forward_bound), at the scores' scale and norm-wise
    for the hidden states; or twice HF's own bf16 error on the same prompts where that is larger (the
    model's conditioning as it shows there, beyond the bound's at-scale model of each sum)."""
    scale = max(1.0, float(np.abs(reference.logits).max()))
    length = forward_length(model_dir, longest)
    float32 = forward_bound(torch.float32, length=length, magnitude=1.0, implementations=1)
    scores = (_bf16_bound(model_dir, longest, 1.0, implementations=1) + float32) * scale
    hidden = _bf16_bound(model_dir, longest, 1.0, implementations=1) + float32
    hf_scores = float(np.abs(bf16.logits - reference.logits).max())
    norms = np.linalg.norm(reference.hidden, axis=1)
    hf_hidden = float((np.linalg.norm(bf16.hidden - reference.hidden, axis=1) / norms).max())
    return max(scores, 2 * hf_scores), max(hidden, 2 * hf_hidden)


@pytest.mark.parametrize("kernel", ["triton", "fa4"])
@pytest.mark.parametrize("head_dim", [64, 128, 96])
@pytest.mark.parametrize("window", [(-1, 0), (-1, -1)])
def test_kernel_matches_flash_in_bfloat16(window: tuple[int, int], head_dim: int, kernel: str) -> None:
    """The compiled Triton kernel (or FlashAttention-4) against torch's flash kernel on the same bf16 packed
    batch: grouped heads, sequences of 1 to 700 tokens, an empty one; outputs within bf16 rounding,
    log-sum-exps within 1e-3."""
    from models.attention import flash_varlen_gqa
    from models.fa4_attention import fa4_varlen_attn
    from models.triton_attention import triton_varlen_attn
    from models.varlen import WANT_LSE

    _skip_without(kernel)
    run = triton_varlen_attn if kernel == "triton" else fa4_varlen_attn

    lengths = [700, 1, 0, 65, 64, 129, 300]
    generator = torch.Generator(device="cuda").manual_seed(0)
    total = sum(lengths)
    q = torch.randn(total, 8, head_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
    k = torch.randn(total, 2, head_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
    v = torch.randn(total, 2, head_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32, device="cuda")
    args = (q, k, v, cu, cu, max(lengths), max(lengths))
    want, want_lse = flash_varlen_gqa(*args, window_size=window, enable_gqa=True, return_aux=WANT_LSE)
    got, got_lse = run(*args, window_size=window, enable_gqa=True, return_aux=WANT_LSE)
    # Two online softmaxes of the same bf16 operands with float32 sums on tensor cores, each rounding its
    # weights and its output to bf16 (u = 2^-8): per element, at each sequence's exact magnitudes
    # (tolerances.attention_bound, lse_bound; implementations=2).
    exact_attention = _testkit().exact_attention
    bound = torch.zeros(got.shape, dtype=torch.float64, device="cuda")
    lse_limit = torch.zeros(got_lse.shape, dtype=torch.float64, device="cuda")
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        if start == end:
            continue
        q_seq, k_seq, v_seq = (x[start:end].transpose(0, 1) for x in (q, k, v))
        exact = exact_attention(q_seq, k_seq, v_seq, scale=None, causal=window == (-1, 0))
        common = {
            "head_dim": head_dim,
            "keys": exact.keys,
            "accumulation": TENSOR_CORES,
            "implementations": 2,
        }
        bound[start:end] = attention_bound(
            torch.float32, score_magnitude=exact.score, value_magnitude=exact.value, stored=torch.bfloat16,
            **common,
        ).transpose(0, 1)  # fmt: skip
        lse_limit[:, start:end] = lse_bound(
            torch.float32, score_magnitude=exact.score[..., 0], lse_magnitude=exact.lse.abs(), **common
        )
    assert_within(got, want, bound, "attention")
    assert_within(got_lse, want_lse, lse_limit, "log-sum-exp")


@pytest.mark.parametrize("window", [(-1, 0), (7, 0), (-1, -1)])
def test_flash_kernel_takes_grouped_kv_heads_unrepeated(window: tuple[int, int]) -> None:
    """The direct flash call (torch versions whose varlen_attn has no enable_gqa) against varlen_attn on
    K/V repeated to the query's heads: causal, a sliding window and both ways (encoders)."""
    from torch.nn.attention.varlen import varlen_attn

    from models.attention import flash_varlen_gqa

    generator = torch.Generator(device="cuda").manual_seed(0)
    lengths = [5, 130, 1, 64]
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32, device="cuda")
    total, heads, kv_heads, dim = sum(lengths), 8, 2, 128
    q, k, v = (
        torch.randn(total, h, dim, device="cuda", dtype=torch.bfloat16, generator=generator)
        for h in (heads, kv_heads, kv_heads)
    )
    got = flash_varlen_gqa(q, k, v, cu, cu, max(lengths), max(lengths), window_size=window, enable_gqa=True)
    # The same kernel, tiles and sums: grouped heads read their K/V head where repeated ones read a copy.
    groups = heads // kv_heads
    want = varlen_attn(
        q,
        k.repeat_interleave(groups, dim=1),
        v.repeat_interleave(groups, dim=1),
        cu,
        cu,
        max(lengths),
        max(lengths),
        window_size=window,
    )
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("kernel_name", ["flash_varlen_gqa", "varlen_attn"])
def test_two_flash_passes_merge_into_one_pass_over_gathered_keys(kernel_name: str) -> None:
    """Shared prefixes on the real kernel, at W3's head shapes: the packer's layout (two groups of a
    512-token prefix with 16 suffixes of 64 tokens each, then a prompt of its own) through the two passes
    (cross sequences starting past row 0, log-sum-exps as [H, T]) against one flash pass over each
    sequence's gathered keys, and against float32 on a few suffixes."""
    from models.attention import attend_causal, flash_varlen_gqa, merge_passes
    from models.packing import find_shared_prefixes, pack
    from models.varlen import WANT_LSE

    kernel = flash_varlen_gqa
    if kernel_name == "varlen_attn":
        from torch.nn.attention import varlen

        if "enable_gqa" not in str(inspect.signature(varlen.varlen_attn)):
            pytest.skip("this torch's varlen_attn has no enable_gqa (the engine calls flash directly)")
        kernel = varlen.varlen_attn
    rng = np.random.default_rng(0)
    prompts = []
    for _ in range(2):
        query = tuple(rng.integers(4, 1000, 512).tolist())
        prompts += [query + tuple(rng.integers(4, 1000, 64).tolist()) for _ in range(16)]
    prompts.append(tuple(rng.integers(4, 1000, 300).tolist()))
    groups = find_shared_prefixes(prompts, 32)
    packed = pack(prompts, torch.device("cuda"), "mean", shared=groups, gather_keys=True)
    assert packed.cross is not None and packed.shared is not None and packed.row_of_token is not None
    total, heads, kv_heads, dim = int(packed.host_cu_seqlens[-1]), 16, 8, 128
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(total, h, dim, device="cuda", dtype=torch.bfloat16, generator=generator)
        for h in (heads, kv_heads, kv_heads)
    )
    cu, cross = packed.cu_seqlens, packed.cross
    passes = {"return_aux": WANT_LSE, "enable_gqa": True}
    own, own_lse = kernel(
        q, k, v, cu, cu, packed.max_length, packed.max_length, window_size=(-1, 0), **passes
    )
    assert own_lse.shape == (heads, total) and own_lse.dtype == torch.float32
    other, other_lse = kernel(
        q, k, v, cross.cu_q, cross.cu_k, cross.max_q, cross.max_k, window_size=(-1, -1), **passes
    )
    merged = merge_passes(own, own_lse, other, other_lse, cross.rows)
    keys = packed.shared
    gathered = kernel(
        q, k.index_select(0, keys.key_index), v.index_select(0, keys.key_index), cu, keys.cu_seqlens_k,
        packed.max_length, keys.max_length_k, window_size=(-1, 0), enable_gqa=True,
    )  # fmt: skip
    # Both are bf16 outputs of float32 sums on tensor cores in other orders: the merged passes and the one
    # pass over gathered keys each within their bound of the exact (up to 576 keys, 128-term scores),
    # at the largest score magnitude sum |q k| / sqrt(128) and the largest |v| of the batch.
    q64, k64 = q.double().abs(), k.double().abs().repeat_interleave(heads // kv_heads, dim=1)
    score = float(torch.einsum("thd,shd->hts", q64, k64).amax()) / dim**0.5
    value_max = float(v.double().abs().max())
    common = {"head_dim": dim, "keys": 576, "score_magnitude": score, "accumulation": TENSOR_CORES}
    merged_bound = merged_attention_bound(torch.float32, value_max=value_max, stored=torch.bfloat16, **common)
    one_pass = attention_bound(
        torch.float32, value_magnitude=value_max, stored=torch.bfloat16, value_max=value_max, **common
    )
    torch.testing.assert_close(merged, gathered, atol=merged_bound + one_pass, rtol=0)
    rows_of = packed.row_of_token.split([len(p) for p in prompts])
    for index in (0, 17, 31, 32):  # suffixes of both groups, and the prompt of its own
        rows = rows_of[index]
        q_rows, k_rows, v_rows = (x[rows].transpose(0, 1) for x in (q, k, v))
        whole = attend_causal(q_rows, k_rows, v_rows, scale=None)
        # The merged passes' bound and float32 attention's own, from the same bf16 operands.
        float32 = attention_bound(torch.float32, value_magnitude=value_max, **common)
        torch.testing.assert_close(
            merged[rows].float(), whole.transpose(0, 1), atol=merged_bound + float32, rtol=0
        )


# Hybrids (Gated DeltaNet layers) refuse FP8 at start-up (tests/models/test_linear_attention.py).
@pytest.mark.parametrize("name", [*(a for a in ARCHITECTURES if a not in HYBRIDS), GQA_MODEL])
def test_fp8_projections_agree_with_hf_on_the_same_projections(
    name: str, architecture_models: dict[str, Path]
) -> None:
    """FP8 on the H200's tensor cores (torch._scaled_mm, row-wise scales) with the defaults (varlen kernel,
    compiled layers, graphs): the start-up self-check against HF's own forward with the same FP8 modules
    must pass, three times so that a batch is recorded and replayed (its bound widened by how far a last-bit
    change of FP8's inputs moves HF's own result); the results stay near bf16's. FP8's deviation is every
    projection's input and weight rounded to e4m3 (at most 2^-4 of the element): a priori it exceeds the
    values, so the model's response is measured on the same requests, as the self-check measures FP8's
    sensitivity: every projection input moved by the whole 2^-4 before rounding, up and down alternately,
    then the other way round; the larger move bounds a rounding pattern of mixed signs and mostly smaller
    steps, and bf16's own rounding (_bf16_bound) is added. A broken product moves results by nearly all of
    their scale."""
    from models.selfcheck import run_self_check

    fp8 = Scorer(architecture_models[name], ScorerConfig(device="cuda", dtype="bfloat16", quantization="fp8"))
    bf16 = Scorer(architecture_models[name], ScorerConfig(device="cuda", dtype="bfloat16"))
    assert fp8.info.quantization == "fp8"
    for _ in range(3):
        report = run_self_check(fp8)
        assert report.max_score_diff <= report.score_bound, report
    from models.fp8 import jittered

    requests = _requests(16, 40, seed=11, labels=(40, 7, 300) if fp8.model.judge else None)
    fp8_scores, fp8_hidden = _arrays(fp8.score(requests))
    bf16_scores, bf16_hidden = _arrays(bf16.score(requests))

    def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))

    scale = max(1.0, float(np.abs(bf16_scores).max()))
    moved_scores, moved_angle = 0.0, 0.0
    for amount in (2.0**-4, -(2.0**-4)):
        with jittered(fp8.hf_model, amount):
            scores, hidden = _arrays(fp8.score(requests))
        moved_scores = max(moved_scores, float(np.abs(scores - fp8_scores).max()))
        moved_angle = max(moved_angle, float(np.arccos(np.clip(cosines(hidden, fp8_hidden), -1, 1)).max()))
    bf16_part = _bf16_bound(architecture_models[name], 40, 1.0)
    angle = moved_angle + float(np.arcsin(min(1.0, bf16_part)))
    cosine = cosines(fp8_hidden, bf16_hidden)
    assert np.isfinite(fp8_scores).all() and float(cosine.min()) >= np.cos(min(angle, np.pi)), cosine
    assert float(np.abs(fp8_scores - bf16_scores).max()) <= moved_scores + bf16_part * scale


@pytest.mark.parametrize("graphs", ["on", "off"])
def test_batches_launched_ahead_of_their_finish_score_as_alone(graphs: str, tiny_qwen3_dir: Path) -> None:
    """Three batches launched before the first is finished (the worker's model thread overlaps that way):
    each batch's results are bit-identical to scoring it alone, though the later launches reuse the graph
    buffers, the pooled output and the caching allocator's blocks while the earlier copies are pending."""
    scorer = Scorer(tiny_qwen3_dir, ScorerConfig(device="cuda", dtype="bfloat16", cuda_graphs=graphs))
    batches = [_requests(7, 100, seed=seed) for seed in (1, 2, 3)] + [_requests(3, 60, seed=4)]
    for batch in batches * 2:  # graphs are recorded at a shape's second batch
        scorer.score(batch)
    alone = [_arrays(scorer.score(batch)) for batch in batches]
    prepared = [[scorer.prepare(r) for r in batch] for batch in batches]
    launched = [scorer.launch(batch) for batch in prepared]  # type: ignore[arg-type]
    together = [_arrays(scorer.finish(pending)) for pending in launched]
    # The same batches through the same graphs and kernels: the same arithmetic, bit for bit.
    for (want_scores, want_hidden), (got_scores, got_hidden) in zip(alone, together, strict=True):
        np.testing.assert_array_equal(got_scores, want_scores)
        np.testing.assert_array_equal(got_hidden, want_hidden)


def _skip_without(kernel: str) -> None:
    """Skip a test of FlashAttention-4 where that optional package is not installed."""
    from models import fa4_attention

    if kernel == "fa4" and not fa4_attention.available():
        pytest.skip("flash-attn-4 is not installed")


# Batches as traffic brings them, around the Triton kernel's switch at 256 tokens: each a list of requests,
# each (query length, item lengths); tests/models/test_warmup.py has the CPU's, around a lowered switch.
_TRAFFIC = [
    [(0, (1,))],
    [(0, (1, 1, 1))],
    [(0, (5,)), (0, (5, 2))],
    [(0, (1, 20, 300, 40))],
    [(9, (1, 1))],
    [(9, (1, 4)), (0, (3,))],
    [(300, (2, 25))],
    [(9, (3, 300))],
    [(300, (1, 2))],
    [(0, (2, 3)), (34, (1, 1, 7)), (0, (260,))],
]


@pytest.mark.parametrize("cache", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize("architecture", ["qwen3", "gemma3_text"])
def test_after_the_warm_up_no_batch_compiles(architecture: str, cache: bool) -> None:
    """The worker's start-up warm-up on the real kernels (Triton past 256 tokens, flash below and for
    sliding windows), compiled layers and CUDA graphs: no batch of the traffic above compiles after it.
    With a prefix cache (every block kept at first sight), each batch's second pass reads its prompts'
    prefixes from the cache, on the compiled layers broken around the cache's traffic, and scores as its
    first pass: two bfloat16 forwards of other batch shapes (half_forward_bound, tensor cores)."""
    import torch._dynamo.utils

    from models.tiny import write_tiny_model
    from models.warmup import describe, warm_up

    def traced() -> int:
        return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])

    torch._dynamo.reset()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(Path(tmp) / architecture, architecture)
        settings: dict[str, Any] = {"share_prefix_min_tokens": 8}
        if cache:
            settings |= {"prefix_cache_mib": 64, "prefix_cache_block_tokens": 16}
            settings["prefix_cache_admit"] = "first"
        scorer = Scorer(model_dir, ScorerConfig(device="cuda", dtype="bfloat16", **settings))
        assert (
            scorer.executor.compiled
            and scorer.executor.graphs is not None
            and scorer.attention_kernel == "triton"
        )
        report = warm_up(scorer)
        assert report.compiled_graphs > 0 and report.cuda_graphs > 0, describe(report)
        after = traced()
        for salt, batch in enumerate(_TRAFFIC):
            requests = [
                ScoreRequest(
                    request_id=f"t{salt}-{r}",
                    query=tuple(range(4, 4 + query)) if query else None,
                    items=tuple(
                        tuple((7 * j + salt + i) % 400 + 100 for i in range(n)) for j, n in enumerate(items)
                    ),
                    return_pooled_hidden_states=True,
                )
                for r, (query, items) in enumerate(batch)
            ]
            passes = []
            for _ in range(2):  # the second time through a CUDA graph of the shape, or the cache
                results = scorer.score(requests)
                assert all(r.ok for r in results), [r.error for r in results if not r.ok]
                passes.append(results)
            assert traced() == after, f"compiled for {batch} after the warm-up ({describe(report)})"
            if cache:
                longest = max(len(p) for request in requests for p in scorer.prepare(request).prompts)
                sums = forward_sums(model_dir, longest)
                for got, want in zip(*passes, strict=True):
                    for a, b in zip(got.scores, want.scores, strict=True):
                        scale = max(1.0, max(abs(v) for v in b))
                        bound = half_forward_bound(
                            torch.bfloat16, sums=sums, magnitude=scale, accumulation=TENSOR_CORES
                        )
                        assert a == pytest.approx(b, abs=bound, rel=0), (batch, got.request_id)
        if cache:
            assert scorer.executor.prefix_cache is not None and scorer.executor.prefix_cache.stats.hits > 0


def test_rows_of_up_to_4096_reduce_in_one_pass() -> None:
    """What models/reductions.py changes, where it changes anything (inductor's CUDA code): a 3,072-wide
    SiLU-and-multiply with its scale per row, as the FP8 MLP computes it, compiles to one persistent kernel
    inside `one_pass_rows` and to a looped one outside it, with the same results."""
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    from models.reductions import one_pass_rows

    def scaled_activation(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        product = (torch.nn.functional.silu(gate) * up).float()
        scale = (product.abs().amax(-1, keepdim=True) / 448.0).clamp(min=1e-12)
        return product / scale, scale

    generator = torch.Generator(device="cuda").manual_seed(0)
    gate, up = (torch.randn(100, 3072, device="cuda", generator=generator).bfloat16() for _ in "gu")
    for tensor in (gate, up):
        # As the engine compiles its layers: the token count varies, the width is the model's.
        torch._dynamo.mark_dynamic(tensor, 0)
    with inductor_config.patch(fx_graph_cache=False):
        torch._dynamo.reset()
        with one_pass_rows():
            ours, ours_code = run_and_get_code(torch.compile(scaled_activation), gate, up)
        torch._dynamo.reset()
        theirs, their_code = run_and_get_code(torch.compile(scaled_activation), gate, up)
    torch._dynamo.reset()
    assert "triton_per_" in "\n".join(ours_code) and "triton_red_" not in "\n".join(ours_code)
    assert "triton_red_" in "\n".join(their_code)
    # The same elementwise arithmetic in both kernels, and a maximum, which is exact in any order: the same
    # bits.
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("architecture", ["llama", "phi3"])
def test_adapter_batches_on_the_fast_path_score_as_the_eager_path(
    architecture: str, architecture_models: dict[str, Path], tmp_path: Path
) -> None:
    """A batch mixing three LoRA adapters (all projections, attention only, MLP only; two with their own
    head) and the base model, through the GPU's default path (compiled layers with the adapted projections,
    the fused MLP kernel taking the gate and up deltas, the last layer at the pooled rows, Triton attention;
    CUDA graphs on, not replayed for adapter batches), against the same adapters on eager layers with HF's
    MLP computing the whole last layer, both judged by PEFT's merge of each adapter in float32 (the CPU
    suite checks the eager adapted model against that merge in float32).

    The bound (two bf16 forwards, _bf16_bound) assumes every sum's terms stay at the scale of the scores. An
    item can break that: with factors of spread 0.2 (deltas six times the base weights' spread) on Phi-3 the
    rank-8 rsLoRA attention adapter (scale 16 / sqrt(8)) put one item's pooled row where any bfloat16
    forward lands far from float32 (0.84 off on a score of 1.81 on the CPU's bf16 eager path, 1.06 on the
    GPU's, 0.18 on the compiled one); the tests' factors now give deltas the weights' spread, and an item's
    sums may still leave the scores' scale. So each item's allowance is the bound plus how far the eager
    bf16 path itself is from float32: the fast path may be no further from the truth than the eager path,
    plus the bound."""
    testkit = _testkit()  # puts tests/models on the path
    from test_adapters import _adapters, _merged, _mixed_requests, _setting

    model_dir = architecture_models[architecture]
    adapters = _adapters(model_dir, str(tmp_path))
    setting = _setting(adapters)
    # The tiny models' hidden size is below the kernel's "auto" threshold: "on" takes it.
    fast = Scorer(model_dir, ScorerConfig(device="cuda", dtype="bfloat16", adapters=setting, fused_mlp="on"))
    assert fast.executor.compiled and fast.executor.pooled_layer is not None and fast.info.fused_mlp
    eager = Scorer(
        model_dir,
        ScorerConfig(
            device="cuda", dtype="bfloat16", adapters=setting, compile="off", cuda_graphs="off",
            last_layer_pooled_rows=False, fused_mlp="off",
        ),
    )  # fmt: skip
    chosen, requests = _mixed_requests()
    for _ in range(2):  # the second time through the layers' compiled adapter variant, warm
        got = fast.score(requests)
    want = eager.score(requests)
    base = eager.score([dataclasses.replace(r, adapter=None) for r in requests])
    longest = max(len(p) for r in requests for p in fast.prepare(r).prompts)
    for name, request, g, w, b in zip(chosen, requests, got, want, base, strict=True):
        assert g.ok and w.ok, (g.error, w.error)
        merged = None if name is None else _merged(model_dir, adapters[name])
        truth = testkit.hf_reference(model_dir, fast.prepare(request).prompts, model=merged).logits
        got_scores, want_scores = np.array(g.scores), np.array(w.scores)
        scale = max(1.0, float(np.abs(truth).max()))
        atol = _bf16_bound(model_dir, longest, scale)
        allowed = np.abs(want_scores - truth) + atol
        assert np.all(np.abs(got_scores - truth) <= allowed), (name, got_scores, want_scores, truth, atol)
        if name is not None:  # the adapter moved the scores by more than the bound
            assert float(np.abs(want_scores - np.array(b.scores)).max()) > atol


# W1's 8B projections (hidden 4096, 8 KV heads of 128, MLP 14336) and a one-column head.
W1_WIDTHS = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096), (4096, 1)]


def test_the_gpu_products_are_row_invariant_in_tiles_at_w1_widths() -> None:
    """The deterministic setting's tiled form holds on this GPU for W1's shapes in bf16: a row's product
    is the same bits wherever it sits in its tile and whatever rows are beside it (else the setting falls
    back to every item alone, which this test is there to show)."""
    from models.tiles import rows_invariant

    assert rows_invariant(1024, W1_WIDTHS, torch.device("cuda"), torch.bfloat16) is None


def test_deterministic_tiles_on_the_gpu_give_the_same_bits_in_any_batch(tiny_qwen3_dir: Path) -> None:
    """The tiled form on the varlen path in bf16: the same requests in one batch, in reverse order, and
    each alone give the same scores and hidden states bit for bit."""
    config = ScorerConfig(device="cuda", dtype="bfloat16", deterministic=True, deterministic_tile_rows=64)
    scorer = Scorer(tiny_qwen3_dir, config)
    assert scorer.executor.row_tiles == 64 and scorer.info.attention_kernel == "flash"
    requests = [*_requests(5, 37, 3), *_requests(4, 150, 4), *_requests(3, 2, 5)]
    requests = [dataclasses.replace(r, request_id=f"q{i}") for i, r in enumerate(requests)]
    together = _arrays(scorer.score(requests))
    backwards = _arrays(scorer.score(requests[::-1]))
    alone = [_arrays(scorer.score([r])) for r in requests]
    for i in range(len(requests)):
        j = len(requests) - 1 - i
        for part in (0, 1):  # scores, hidden states
            assert np.array_equal(together[part][i], backwards[part][j])
            assert np.array_equal(together[part][i], alone[i][part][0])


def test_an_item_longer_than_the_token_budget_scores_alone_on_the_fast_path(tiny_qwen3_dir: Path) -> None:
    """W5's case on the fast path: an item of 400 tokens among items of 50, a budget of 128 tokens (the
    graphs' largest batch too): the long item runs as a batch of its own, never cut, through the compiled
    layers past every recorded graph, and every result is the one a budget holding them all gives without
    graphs."""
    small = Scorer(
        tiny_qwen3_dir,
        ScorerConfig(device="cuda", dtype="bfloat16", max_batch_tokens=128, graph_max_tokens=128),
    )
    roomy = Scorer(
        tiny_qwen3_dir,
        ScorerConfig(device="cuda", dtype="bfloat16", max_batch_tokens=4096, cuda_graphs="off"),
    )
    short, long = _requests(4, 50, seed=7), _requests(1, 400, seed=8)
    stream = [*short[:2], dataclasses.replace(long[0], request_id="long"), *short[2:]]
    prepared = [small.prepare(r) for r in stream]
    assert [list(run) for run in small.plan.runs(prepared, 128)] == [[0, 1], [2], [3, 4]]  # type: ignore[arg-type]
    got_scores, got_hidden = _arrays(small.score(stream))
    want_scores, want_hidden = _arrays(roomy.score(stream))
    scale = max(1.0, float(np.abs(want_scores).max()))
    # Two bf16 forwards of prompts of up to 400 tokens in other batches (_bf16_bound), at the scores' scale
    # and, norm-wise, relative to the state.
    np.testing.assert_allclose(got_scores, want_scores, atol=_bf16_bound(tiny_qwen3_dir, 400, scale), rtol=0)
    relative = np.linalg.norm(got_hidden - want_hidden, axis=1) / np.linalg.norm(want_hidden, axis=1)
    assert relative.max() <= _bf16_bound(tiny_qwen3_dir, 400, 1.0)
