"""The GPU (varlen) attention wrapper, driven on CPU by kernels with torch 2.11's and 2.13's signatures."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from scoring_testkit import CpuVarlenKernel, CpuVarlenKernelGqa, hidden_of, scores_of, token_requests

from models import ModelLoadError, Scorer, ScorerConfig
from models.attention import attend_causal, kernel_supports_gqa, reference_attention, varlen_attention
from schemas import ScoreRequest

# Both paths run exact float32 attention per item; only the surrounding layout work differs.
ATOL = 1e-5


def _requests() -> list[ScoreRequest]:
    return token_requests([(30,), (3, 41), (17,), (1,)])


@pytest.mark.parametrize("kernel_type", [CpuVarlenKernel, CpuVarlenKernelGqa])
@pytest.mark.parametrize("architecture", ["llama", "qwen3", "mistral", "gemma3_text", "phi3"])
def test_varlen_wrapper_matches_reference_path(
    architecture: str, kernel_type: type[CpuVarlenKernel], model_dirs: dict[str, Path]
) -> None:
    kernel = kernel_type()
    varlen = Scorer(
        model_dirs[architecture], ScorerConfig(device="cpu", attention="varlen", varlen_kernel=kernel)
    )
    reference = Scorer(model_dirs[architecture], ScorerConfig(device="cpu", attention="reference"))
    requests = _requests()
    for got, expected in zip(varlen.score(requests), reference.score(requests), strict=True):
        np.testing.assert_allclose(scores_of(got), scores_of(expected), atol=ATOL, rtol=0)
        np.testing.assert_allclose(hidden_of(got), hidden_of(expected), atol=ATOL, rtol=0)
    assert kernel.calls, "the injected kernel was not used"
    if isinstance(kernel, CpuVarlenKernelGqa):
        assert kernel.gqa_calls == len(kernel.calls)  # K/V kept their 2 heads: no repeat when the kernel can


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
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


def test_attend_causal_against_explicit_formula() -> None:
    """The exact path itself: causal, left window w (sees w + 1 tokens), GQA head mapping, softcap."""
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(h, 6, 4, generator=generator) for h in (4, 2, 2))
    for window, cap in [(None, None), (2, None), (None, 5.0), (1, 2.0)]:
        got = attend_causal(q, k, v, scale=0.5, left_window=window, softcap=cap)
        kk, vv = k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)
        scores = (q @ kk.transpose(1, 2)) * 0.5
        if cap is not None:
            scores = torch.tanh(scores / cap) * cap
        i, j = torch.arange(6).unsqueeze(1), torch.arange(6).unsqueeze(0)
        allowed = (j <= i) & ((i - j <= window) if window is not None else True)
        expected = torch.softmax(scores.masked_fill(~allowed, -math.inf), -1) @ vv
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


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
