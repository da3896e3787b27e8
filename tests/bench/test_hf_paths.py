"""The per-request float32 reference of the benchmarks (bench/hf_paths.py): HF's own forward, with grouped
key/value heads repeated before torch's attention so that long float32 items do not take the math kernel."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from scripts import ROOT

sys.path.insert(0, str(ROOT))


def _tiny_gqa_llama() -> Any:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, num_labels=3, pad_token_id=0,
    )  # fmt: skip
    model = LlamaForSequenceClassification._from_config(
        config, dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.eval()


def test_reference_matches_hf_sdpa_and_restores_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import hf_paths

    model = _tiny_gqa_llama()
    rows = [torch.randint(1, 97, (n,)) for n in (1, 7, 33)]
    calls: list[tuple[int, int]] = []
    original = hf_paths._repeated_heads_sdpa

    def counted(module: Any, query: torch.Tensor, key: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append((query.shape[1], key.shape[1]))
        return original(module, query, key, *args, **kwargs)

    from transformers import AttentionInterface

    monkeypatch.setitem(AttentionInterface._global_mapping, hf_paths.EXACT_ATTENTION, counted)
    got = hf_paths.run_reference(model, rows)
    assert calls and all(c == (8, 2) for c in calls)  # it ran, on grouped heads (8 query heads, 2 key/value)
    assert model.config._attn_implementation == "sdpa"  # the caller's model is as it was
    with torch.inference_mode():
        for i, row in enumerate(rows):
            want = model(input_ids=row[None], output_hidden_states=True)
            # Two float32 attention kernels differ only in summation order over <= 33 keys of a 64-wide model:
            # a few float32 epsilons (1.2e-7) of values of order 1, through 2 layers; 1e-5 leaves ~10x room.
            torch.testing.assert_close(torch.from_numpy(got.scores[i]), want.logits[0], rtol=0, atol=1e-5)
            pooled = want.hidden_states[-1][0, -1]
            torch.testing.assert_close(torch.from_numpy(got.hidden[i]), pooled, rtol=0, atol=1e-5)
