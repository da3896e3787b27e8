"""The HuggingFace baselines the benchmarks compare against: padded batches, and a per-request reference."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

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


# HF's SDPA attention passes grouped key/value heads to torch as they are (enable_gqa) whenever there is
# no mask; torch's only float32 kernel that takes grouped heads is the math one, which builds the
# [heads, L, L] score matrix (16.7 GiB for one 11k-token item of an 8B model). The reference repeats the
# key/value heads first, so float32 runs on the memory-efficient kernel: the same function, summed in
# another order.
EXACT_ATTENTION = "score_reference_sdpa"


def _repeated_heads_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """HF's attention-function contract ([b, heads, L, d] in, [b, L, heads, d] out), grouped heads
    repeated."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    if is_causal is None:
        is_causal = bool(getattr(module, "is_causal", True))
    causal = is_causal and attention_mask is None and query.shape[2] > 1
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(EXACT_ATTENTION, _repeated_heads_sdpa)
AttentionMaskInterface.register(EXACT_ATTENTION, sdpa_mask)


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
    was = config._attn_implementation
    switch = was == "sdpa"  # another implementation (eager) is the caller's choice and stays
    if switch:
        model.set_attn_implementation(EXACT_ATTENTION)
    try:
        for i, row in enumerate(token_ids):
            logits, pooled = forward_one(model, row)
            scores[i], hidden[i] = logits.float().cpu().numpy()[0], pooled.float().cpu().numpy()[0]
    finally:
        if switch:
            model.set_attn_implementation(was)
    return PathOutput(scores=scores, hidden=hidden)
