"""Start-up self-check: a fixed input through the packed path and through HF's own forward must agree.

The most reported failure of scoring servers is a model that loads and then returns wrong numbers (a head
initialised at random, a pooling position off by one, an attention kernel that ignores a model's quirk).
A few short prompts scored both ways catch that in well under a second on the GPU, before any request.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import PreTrainedModel

from models.errors import ModelLoadError
from schemas import HiddenDType, ScoreRequest

if TYPE_CHECKING:
    from models.engine import Scorer

# Allowed |packed - HF| per dtype, relative to the scale of the scores (at least 1): the two paths order
# their arithmetic differently, so they round differently; 32 bf16 layers of random weights move scores by
# up to 3% of their scale (W1), a wrong position or mask by the whole scale.
SCORE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
# Pooled hidden states: the smallest cosine similarity accepted, per item.
HIDDEN_MIN_COSINE = {torch.float32: 0.9999, torch.float16: 0.999, torch.bfloat16: 0.99}
_LENGTHS = (7, 19, 33)


@dataclass(frozen=True)
class SelfCheckReport:
    """What the check compared and how close the two paths came."""

    items: int
    max_score_diff: float
    score_scale: float
    min_hidden_cosine: float
    seconds: float


def run_self_check(scorer: Scorer) -> SelfCheckReport:
    """Score fixed prompts packed and through HF's plain forward; raise ModelLoadError when they disagree."""
    started = time.perf_counter()
    prompts = _fixed_prompts(scorer)
    labels = _fixed_labels(scorer)
    request = ScoreRequest(
        request_id="self-check",
        items=tuple(prompts),
        return_pooled_hidden_states=True,
        hidden_states_dtype=HiddenDType.FLOAT32,
        label_token_ids=labels,
    )
    result = scorer.score([request])[0]
    if not result.ok or result.pooled_hidden_states is None:
        raise ModelLoadError(f"self-check: the packed path failed on a fixed input: {result.error}")
    packed_scores = np.asarray(result.scores, dtype=np.float64)
    packed_hidden = np.stack([t.to_numpy().astype(np.float64) for t in result.pooled_hidden_states])
    plain_scores, plain_hidden = _plain_forward(scorer, prompts, labels)
    scale = max(1.0, float(np.abs(plain_scores).max()))
    diff = float(np.abs(packed_scores - plain_scores).max())
    cosine = float(min(_cosine(a, b) for a, b in zip(packed_hidden, plain_hidden, strict=True)))
    report = SelfCheckReport(len(prompts), diff, scale, cosine, time.perf_counter() - started)
    if diff > SCORE_TOLERANCE[scorer.dtype] * scale or cosine < HIDDEN_MIN_COSINE[scorer.dtype]:
        raise ModelLoadError(
            f"self-check failed: on a fixed input the packed path and HuggingFace's own forward disagree "
            f"(largest score difference {diff:.3g} on a scale of {scale:.3g}, smallest hidden-state cosine "
            f"{cosine:.5f}); this model would be scored wrongly. Report the model's architecture, or run "
            "with attention='reference' to see whether the attention kernel is the cause."
        )
    return report


def _fixed_labels(scorer: Scorer) -> tuple[int, ...] | None:
    """A judge's label ids for the check: spread over its vocabulary (the classifiers score with a head)."""
    if not scorer.is_judge:
        return None
    vocab = scorer.vocab_size
    return tuple(sorted({vocab - 1, vocab // 2, min(5, vocab - 1)}))


def _fixed_prompts(scorer: Scorer) -> list[tuple[int, ...]]:
    """Deterministic token ids, never the pad id, short enough for any model."""
    vocab = scorer.vocab_size
    pad = scorer.pad_token_id
    generator = torch.Generator().manual_seed(1234)
    prompts = []
    for length in _LENGTHS:
        size = (max(1, min(length, scorer.max_input_tokens - 8)),)
        ids = torch.randint(min(4, vocab - 1), vocab, size, generator=generator)
        prompts.append(tuple(int(t) for t in ids if int(t) != pad) or (min(4, vocab - 1),))
    return prompts


@torch.inference_mode()
def _plain_forward(
    scorer: Scorer, prompts: list[tuple[int, ...]], labels: tuple[int, ...] | None
) -> tuple[np.ndarray, np.ndarray]:
    """HF's own forward of each prepared prompt alone (no padding): logits and the pooled hidden state."""
    model = scorer.hf_model
    scores, hidden = [], []
    with _plain_attention(model):
        for index, prompt in enumerate(prompts):
            prepared = scorer.prepare(
                ScoreRequest(request_id=f"self-check-{index}", items=(prompt,), label_token_ids=labels)
            )
            ids = prepared.prompts[0]  # type: ignore[union-attr]  # with the template an encoder adds
            extra = {}
            types = getattr(prepared, "token_types", None)
            if types is not None and scorer.uses_token_types:
                extra["token_type_ids"] = torch.tensor([list(types[0])], device=scorer.device)
            out = model(
                input_ids=torch.tensor([list(ids)], device=scorer.device), output_hidden_states=True, **extra
            )
            row = scorer.pooled_row(list(ids))
            states = out.hidden_states[-1][0]  # [L, H]
            pooled = states.float().mean(0) if row is None else states[row].float()
            hidden.append(pooled.double().cpu().numpy())
            # With the model's own pooling, HF's logits are the reference; with another, its head on the
            # plainly computed pooled state.
            if labels is not None:  # a causal LM's logits at the pooled (last) position, label columns only
                logits = out.logits[0, row if row is not None else -1, list(labels)]
            elif scorer.pools_like_its_head:
                logits = out.logits[0]
            else:
                logits = scorer.apply_head(pooled[None])[0]
            scores.append(logits.double().cpu().numpy())
    return np.stack(scores), np.stack(hidden)


@contextlib.contextmanager
def _plain_attention(model: PreTrainedModel) -> Iterator[None]:
    """HF's own attention for the plain forward (eager where SDPA cannot soft-cap), then ours again."""
    config = model.config
    ours = config._attn_implementation
    if ours in ("eager", "sdpa"):
        yield  # a model on the plain path already runs HF's own attention (DeBERTa)
        return
    softcap = getattr(config.get_text_config(), "attn_logit_softcapping", None)
    model.set_attn_implementation("eager" if softcap is not None else "sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(ours)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    denominator = float(np.linalg.norm(a) * np.linalg.norm(b))
    return 1.0 if denominator == 0 else float(np.dot(a, b) / denominator)
