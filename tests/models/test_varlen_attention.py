"""The GPU (varlen) attention wrapper, driven on CPU by kernels with torch 2.11's and 2.13's signatures."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from scoring_testkit import (
    CpuVarlenKernel,
    CpuVarlenKernelGqa,
    assert_forward_close,
    exact_attention,
    hidden_of,
    scores_of,
    token_requests,
)
from tolerances import assert_within, attention_bound, merged_attention_bound

from models import ModelLoadError, Scorer, ScorerConfig, write_tiny_model
from models.attention import (
    attend_causal,
    kernel_supports_gqa,
    merge_passes,
    reference_attention,
    varlen_attention,
)
from models.packing import find_shared_prefixes, pack
from schemas import ScoreRequest


def _requests() -> list[ScoreRequest]:
    return token_requests([(30,), (3, 41), (17,), (1,)])


@pytest.mark.parametrize("kernel_type", [CpuVarlenKernel, CpuVarlenKernelGqa])
@pytest.mark.parametrize(
    "architecture", ["llama", "qwen3", "mistral", "gemma3_text", "phi3", "smollm3", "olmo2", "olmo3", "glm4"]
)
def test_varlen_wrapper_matches_reference_path(
    architecture: str, kernel_type: type[CpuVarlenKernel], model_dirs: dict[str, Path]
) -> None:
    _varlen_matches_reference(model_dirs[architecture], kernel_type())


@pytest.mark.parametrize("kernel_type", [CpuVarlenKernel, CpuVarlenKernelGqa])
def test_varlen_wrapper_matches_reference_path_on_a_gemma4_judge(
    kernel_type: type[CpuVarlenKernel], tmp_path: Path
) -> None:
    """Gemma 4's global layers: wider heads, one key-value head for four queries, keys that are the values."""
    model_dir = write_tiny_model(tmp_path / "gemma4", "gemma4_text", seed=12)
    _varlen_matches_reference(model_dir, kernel_type(), labels=(40, 7, 300))


def _varlen_matches_reference(
    model_dir: Path, kernel: CpuVarlenKernel, labels: tuple[int, ...] | None = None
) -> None:
    varlen = Scorer(model_dir, ScorerConfig(device="cpu", attention="varlen", varlen_kernel=kernel))
    reference = Scorer(model_dir, ScorerConfig(device="cpu", attention="reference"))
    requests = [replace(r, label_token_ids=labels) for r in _requests()]
    for got, expected in zip(varlen.score(requests), reference.score(requests), strict=True):
        # Both paths run float32 attention per item, in other layouts and GEMM shapes: two float32
        # forwards, the model's chain of sums for prompts of up to 41 tokens (forward_atol).
        assert_forward_close(scores_of(got), scores_of(expected), model_dir, longest=41)
        assert_forward_close(hidden_of(got), hidden_of(expected), model_dir, longest=41)
    assert kernel.calls, "the injected kernel was not used"
    if isinstance(kernel, CpuVarlenKernelGqa):
        assert kernel.gqa_calls == len(kernel.calls)  # K/V kept their heads: no repeat when the kernel can


def test_gqa_support_detection() -> None:
    assert not kernel_supports_gqa(CpuVarlenKernel())
    assert kernel_supports_gqa(CpuVarlenKernelGqa())


def _packed(lengths: list[int], heads: int = 4, kv_heads: int = 2, dim: int = 8) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    total = sum(lengths)
    query = torch.randn(1, heads, total, dim, generator=generator)
    key = torch.randn(1, kv_heads, total, dim, generator=generator)
    value = torch.randn(1, kv_heads, total, dim, generator=generator)
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int64)
    return query, key, value, cu


@pytest.mark.parametrize("sliding_window", [None, 4])
def test_wrapper_layout_window_and_scale(sliding_window: int | None) -> None:
    lengths = [5, 9, 1]
    query, key, value, cu = _packed(lengths)
    kernel = CpuVarlenKernel()
    out, weights = varlen_attention(
        torch.nn.Module(),
        query,
        key,
        value,
        None,
        scaling=0.3,
        sliding_window=sliding_window,
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=9,
        max_length_k=9,
        kernel=kernel,
    )
    assert weights is None and out.shape == (1, sum(lengths), 4, 8)  # [1, T, H, D] as HF expects
    expected, _ = reference_attention(
        torch.nn.Module(),
        query,
        key,
        value,
        None,
        scaling=0.3,
        sliding_window=sliding_window,
        cu_seq_lens_q=cu,
    )
    # Both are float32 attention per sequence, in other layouts: 8-term scores, up to 9 keys, per element
    # at each sequence's exact magnitudes (tolerances.attention_bound, implementations=2).
    bound = torch.zeros_like(out, dtype=torch.float64)
    left = None if sliding_window is None else sliding_window - 1
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        exact = exact_attention(
            query[0, :, start:end], key[0, :, start:end], value[0, :, start:end], scale=0.3, left_window=left
        )
        bound[0, start:end] = attention_bound(
            torch.float32, head_dim=8, keys=exact.keys, score_magnitude=exact.score,
            value_magnitude=exact.value, implementations=2,
        ).transpose(0, 1)  # fmt: skip
    assert_within(out, expected, bound)


def test_attend_causal_against_explicit_formula() -> None:
    """The exact path itself: causal, left window w (sees w + 1 tokens), GQA head mapping, softcap."""
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(h, 6, 4, generator=generator) for h in (4, 2, 2))
    for window, cap in [(None, None), (2, None), (None, 5.0), (1, 2.0)]:
        got = attend_causal(q, k, v, scale=0.5, left_window=window, softcap=cap)
        # The explicit formula in float64: what attend_causal's float32 is measured against.
        kk, vv = k.double().repeat_interleave(2, 0), v.double().repeat_interleave(2, 0)
        scores = (q.double() @ kk.transpose(1, 2)) * 0.5
        if cap is not None:
            scores = torch.tanh(scores / cap) * cap
        i, j = torch.arange(6).unsqueeze(1), torch.arange(6).unsqueeze(0)
        allowed = (j <= i) & ((i - j <= window) if window is not None else True)
        expected = torch.softmax(scores.masked_fill(~allowed, -math.inf), -1) @ vv
        # One float32 computation: 4-term scores, 6 keys, the softcap's roundings, at the exact magnitudes.
        exact = exact_attention(q, k, v, scale=0.5, left_window=window, softcap=cap)
        bound = attention_bound(
            torch.float32, head_dim=4, keys=6, score_magnitude=exact.score, value_magnitude=exact.value,
            softcap=cap,
        )  # fmt: skip
        assert_within(got, expected, bound)


def test_varlen_rejects_softcap() -> None:
    query, key, value, cu = _packed([3])
    with pytest.raises(NotImplementedError, match="softcap"):
        varlen_attention(
            torch.nn.Module(),
            query,
            key,
            value,
            None,
            softcap=30.0,
            cu_seq_lens_q=cu,
            max_length_q=3,
            kernel=CpuVarlenKernel(),
        )


def test_varlen_without_cuda_or_kernel_is_a_load_error(tiny_llama_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="CUDA"):
        Scorer(tiny_llama_dir, ScorerConfig(device="cpu", attention="varlen"))


def test_two_passes_over_disjoint_keys_merge_into_attention_over_both() -> None:
    """merge_passes: attention over keys A and B from attention over A and over B alone, each with its
    log-sum-exp; rows that took one pass keep it, whatever the other pass left in them."""
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(4, 6, 8, generator=generator)  # [H, Lq, D]
    k, v = (torch.randn(2, 10, 8, generator=generator) for _ in range(2))  # [Hkv, Lk, D]: GQA
    whole = exact_attention(q, k, v, scale=0.4, causal=False)  # float64
    parts = [(slice(0, 7)), (slice(7, 10))]
    outs, lses = [], []
    for part in parts:
        outs.append(attend_causal(q, k[:, part], v[:, part], scale=0.4, causal=False).transpose(0, 1))
        scores = q @ k[:, part].repeat_interleave(2, 0).transpose(1, 2) * 0.4
        lses.append(torch.logsumexp(scores, dim=-1))  # [H, Lq]
    rows = torch.tensor([True, True, False, True, True, False])
    second = outs[1].clone()
    second[~rows] = float("nan")  # what the second pass leaves in rows it did not take
    second_lse = lses[1].clone()
    second_lse[:, ~rows] = float("nan")
    merged = merge_passes(outs[0], lses[0], second, second_lse, rows)
    # Two float32 passes (8-term scores, up to 10 keys) merged by their float32 log-sum-exps, against
    # float64 over all keys: tolerances.merged_attention_bound at the rows' score magnitudes and max |v|.
    bound = merged_attention_bound(
        torch.float32, head_dim=8, keys=10, score_magnitude=whole.score, value_max=whole.value_max
    )
    assert_within(merged[rows], whole.out.transpose(0, 1)[rows], bound.transpose(0, 1)[rows])
    # The rows that took one pass are that pass's output itself: torch.where copies it.
    torch.testing.assert_close(merged[~rows], outs[0][~rows], atol=0, rtol=0)


@pytest.mark.parametrize("sliding_window", [None, 64, 6])
def test_shared_prefixes_through_two_passes_or_gathered_keys_match_whole_prompts(
    sliding_window: int | None,
) -> None:
    """The wrapper on a packed row with shared prefixes: every sequence equals its whole prompt's attention.
    Two passes where no window cuts (no window, or one longer than every prompt); gathered keys where one
    does (a window of 6 ends inside the 5-token prefixes): both with the packer's own layout."""
    prompts = [(1, 2, 3, 4, 5, 9), (1, 2, 3, 4, 5, 6, 7, 8), (20, 21), (11, 12, 13, 14, 15, 16, 30)]
    prompts += [(11, 12, 13, 14, 15, 16, 31, 32)]
    groups = find_shared_prefixes(prompts, 3)
    assert len(groups) == 2
    # "mean" packing maps every token of every prompt to its row.
    packed = pack(prompts, torch.device("cpu"), "mean", shared=groups, gather_keys=True)
    assert packed.cross is not None and packed.shared is not None and packed.row_of_token is not None
    generator = torch.Generator().manual_seed(4)
    heads, kv_heads, dim = 4, 2, 8
    # States depend only on a token's id and position here, so the packed row and each whole prompt agree.
    table = {
        name: torch.randn(64, 16, h, dim, generator=generator)
        for name, h in (("q", heads), ("k", kv_heads), ("v", kv_heads))
    }

    def states(name: str, tokens: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        return table[name][tokens, at].transpose(0, 1).unsqueeze(0)  # [1, H, T, D]

    ids, positions = packed.input_ids[0], packed.position_ids[0]
    q, k, v = (states(name, ids, positions) for name in ("q", "k", "v"))
    kernel = CpuVarlenKernelGqa()
    gathered = sliding_window == 6
    out, _ = varlen_attention(
        torch.nn.Module(), q, k, v, None, scaling=0.3, sliding_window=sliding_window,
        cu_seq_lens_q=packed.cu_seqlens, cu_seq_lens_k=packed.shared.cu_seqlens_k,
        max_length_q=packed.max_length, max_length_k=packed.shared.max_length_k,
        packed_key_index=packed.shared.key_index if gathered else None,
        prefix_cross=packed.cross, kernel=kernel,
    )  # fmt: skip
    assert len(kernel.calls) == (1 if gathered else 2)
    left = None if sliding_window is None else sliding_window - 1
    rows_of = packed.row_of_token.split([len(p) for p in prompts])
    for prompt, rows in zip(prompts, rows_of, strict=True):
        tokens, at = torch.tensor(prompt), torch.arange(len(prompt))
        qq, kk, vv = (states(name, tokens, at)[0] for name in ("q", "k", "v"))
        expected = attend_causal(qq, kk, vv, scale=0.3, left_window=left).transpose(0, 1)  # [L, H, D]
        # The packed passes merged (or the gathered keys in one pass), and the whole prompt's float32
        # attention: each within its bound of float64 (8-term scores, up to 8 keys, the prompt's score
        # magnitudes and max |v|), so within their sum of each other.
        exact = exact_attention(qq, kk, vv, scale=0.3, left_window=left)
        merged = merged_attention_bound(
            torch.float32,
            head_dim=dim,
            keys=len(prompt),
            score_magnitude=exact.score,
            value_max=exact.value_max,
        )
        whole = attention_bound(
            torch.float32, head_dim=dim, keys=len(prompt), score_magnitude=exact.score,
            value_magnitude=exact.value,
        )  # fmt: skip
        assert_within(out[0, rows], expected, (merged + whole).transpose(0, 1))
