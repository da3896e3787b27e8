"""FlashAttention-4 as the packed path's attention kernel (models/fa4_attention.py): which calls reach it, how
the setting resolves with and without the optional package, and what it refuses. The kernel itself needs
a Hopper or Blackwell GPU: tests/gpu runs it against flash and HF float32 there; here an exact stand-in
takes its place behind the same routing."""

from __future__ import annotations

import pytest
import torch
from scoring_testkit import CpuVarlenKernelGqa

from models import ScorerConfig, fa4_attention
from models.attention import fa4_or_flash
from models.varlen import WANT_LSE


def _offsets(lengths: list[int]) -> torch.Tensor:
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    return torch.tensor(bounds, dtype=torch.int32)


def test_causal_and_full_attention_take_fa4_and_windows_take_flash(monkeypatch: pytest.MonkeyPatch) -> None:
    fa4, flash = CpuVarlenKernelGqa(), CpuVarlenKernelGqa()
    monkeypatch.setattr(fa4_attention, "fa4_varlen_attn", fa4)
    kernel = fa4_or_flash(flash)
    q = torch.randn(12, 4, 16)
    kv = torch.randn(12, 2, 16)
    cu = _offsets([5, 7])
    for calls, window in enumerate(((-1, 0), (-1, -1)), start=1):
        out = kernel(q, kv, kv, cu, cu, 7, 7, window_size=window, enable_gqa=True)
        expected = CpuVarlenKernelGqa()(q, kv, kv, cu, cu, 7, 7, window_size=window, enable_gqa=True)
        # The routing hands the stand-in the same tensors: the same arithmetic, bit for bit.
        torch.testing.assert_close(out, expected, atol=0, rtol=0)
        # FA4 took it, with the grouped K/V heads as they are.
        assert (len(fa4.calls), fa4.gqa_calls, len(flash.calls)) == (calls, calls, 0)
    kernel(q, kv, kv, cu, cu, 7, 7, window_size=(3, 0), enable_gqa=True)
    # The sliding window went to flash (this stand-in has enable_gqa, as torch's may: heads unrepeated).
    assert (len(fa4.calls), len(flash.calls), flash.gqa_calls) == (2, 1, 1)


def test_the_setting_needs_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    config = ScorerConfig(attention_kernel="fa4")
    monkeypatch.setattr(fa4_attention, "available", lambda: False)
    with pytest.raises(ValueError, match="needs the flash-attn-4 package"):
        config.resolve_attention_kernel(torch.device("cpu"))
    monkeypatch.setattr(fa4_attention, "available", lambda: True)
    assert config.resolve_attention_kernel(torch.device("cpu")) == "fa4"
    # "auto" never picks it: an optional package, chosen by the operator.
    assert ScorerConfig().resolve_attention_kernel(torch.device("cpu")) == "flash"


def test_the_wrapper_refuses_what_it_cannot_run() -> None:
    q = torch.randn(4, 4, 16)
    kv = torch.randn(4, 2, 16)
    cu = _offsets([4])
    with pytest.raises(ValueError, match="sliding window"):
        fa4_attention.fa4_varlen_attn(q, q, q, cu, cu, 4, 4, window_size=(3, 0))
    with pytest.raises(ValueError, match="enable_gqa"):
        fa4_attention.fa4_varlen_attn(q, kv, kv, cu, cu, 4, 4, window_size=(-1, 0))
    with pytest.raises(ValueError, match="cannot share"):
        fa4_attention.fa4_varlen_attn(q, torch.randn(4, 3, 16), kv, cu, cu, 4, 4, enable_gqa=True)


@pytest.mark.skipif(fa4_attention.available(), reason="the package is installed here")
def test_without_the_package_a_call_says_so() -> None:
    q = torch.randn(4, 2, 16)
    cu = _offsets([4])
    with pytest.raises(RuntimeError, match="flash-attn-4"):
        fa4_attention.fa4_varlen_attn(q, q, q, cu, cu, 4, 4, window_size=(-1, 0), return_aux=WANT_LSE)
