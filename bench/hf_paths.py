"""The HuggingFace baselines the benchmarks compare against: padded batches, and a per-request reference."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

PAD_ID = 0  # W1's ids are drawn from [1, vocab), so 0 never occurs in a real row and marks padding.


@dataclass
class PathOutput:
    """Scores [n, labels] and pooled hidden states [n, hidden] (float32, host) in request order."""

    scores: np.ndarray
    hidden: np.ndarray

    def rows(self, picks: Sequence[int]) -> PathOutput:
        """The requests at `picks`, in that order."""
        return PathOutput(self.scores[list(picks)], self.hidden[list(picks)])


def padded_batches(lengths: Sequence[int], batch_size: int, sort_by_length: bool) -> list[list[int]]:
    """Request indices per batch: arrival order, or longest-first so each batch pads to similar lengths."""
    order = list(range(len(lengths)))
    if sort_by_length:
        order.sort(key=lambda i: lengths[i], reverse=True)
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def _pad(rows: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(int(r.numel()) for r in rows)
    ids = torch.full((len(rows), width), PAD_ID, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for i, row in enumerate(rows):
        ids[i, : row.numel()] = row
        mask[i, : row.numel()] = 1
    # Right padding: the pooled (last real) token sits at length - 1, which the HF head also finds.
    return ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)


@torch.inference_mode()
def forward_padded(model: torch.nn.Module, rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One padded forward with output_hidden_states=True; returns (scores, pooled hidden) on the device."""
    device = next(model.parameters()).device
    ids, mask = _pad(rows, device)
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    last = mask.sum(dim=1) - 1
    # hidden_states[-1] is the final norm's output: the pooled hidden state is its row at the last token.
    pooled = out.hidden_states[-1][torch.arange(len(rows), device=device), last]
    return out.logits, pooled


def run_padded(
    model: torch.nn.Module, token_ids: Sequence[torch.Tensor], batches: Sequence[Sequence[int]]
) -> PathOutput:
    """Score every request in the given batches; pooled rows and scores are copied to the host per batch."""
    config: Any = model.config
    hidden_size = int(config.hidden_size)
    scores = np.zeros((len(token_ids), int(config.num_labels)), dtype=np.float32)
    hidden = np.zeros((len(token_ids), hidden_size), dtype=np.float32)
    for batch in batches:
        logits, pooled = forward_padded(model, [token_ids[i] for i in batch])
        # The host copy is part of the work a scoring service does, so it stays inside the timed region.
        scores[batch] = logits.float().cpu().numpy()
        hidden[batch] = pooled.float().cpu().numpy()
    return PathOutput(scores=scores, hidden=hidden)


@torch.inference_mode()
def forward_one(model: torch.nn.Module, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One unpadded sequence through HF's forward with no mask (the same function as an all-ones mask, and
    HF's SDPA then takes its causal memory-efficient kernel rather than an [L, L] mask); the pooled hidden
    state is kept by a hook on the base model's output (the final norm's), where output_hidden_states would
    hold every layer's (33 x 512 MiB for one 32k-token item of an 8B model in float32)."""
    device = next(model.parameters()).device
    final: list[torch.Tensor] = []
    base: Any = model.base_model
    hook = base.register_forward_hook(lambda _m, _a, out: final.append(out.last_hidden_state))
    try:
        out = model(input_ids=row.to(device)[None])
    finally:
        hook.remove()
    return out.logits, final[-1][:, -1]


def run_reference(model: torch.nn.Module, token_ids: Sequence[torch.Tensor]) -> PathOutput:
    """One request per forward, no padding and no mask: the exact reference (run it in float32)."""
    config: Any = model.config
    scores = np.zeros((len(token_ids), int(config.num_labels)), dtype=np.float32)
    hidden = np.zeros((len(token_ids), int(config.hidden_size)), dtype=np.float32)
    for i, row in enumerate(token_ids):
        logits, pooled = forward_one(model, row)
        scores[i], hidden[i] = logits.float().cpu().numpy()[0], pooled.float().cpu().numpy()[0]
    return PathOutput(scores=scores, hidden=hidden)
