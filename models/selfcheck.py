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
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import PreTrainedModel

from models.errors import ModelLoadError
from models.fp8 import jittered
from models.linear_attention import hf_torch_functions
from models.prepare import PreparedRequest
from schemas import HiddenDType, ScoreRequest

if TYPE_CHECKING:
    from models.engine import Scorer

# Allowed |packed - HF| per dtype, relative to the scale of the scores (at least 1), at the least: the two
# paths order their arithmetic differently, so they round differently. Deep half-precision models round
# more than any fixed bound foresees (32 bf16 layers of random weights: 6% of the scale), so the bound also
# grows with HF's own rounding noise, measured on the same prompts (alone vs in a padded batch): a wrong
# position, mask or head moves scores by their whole scale, far beyond either.
SCORE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
# Pooled hidden states: the smallest cosine similarity accepted, per item (also widened by HF's noise).
HIDDEN_MIN_COSINE = {torch.float32: 0.9999, torch.float16: 0.999, torch.bfloat16: 0.99}
# FP8 projections (models/fp8.py) round each activation to 3 mantissa bits: the two paths' last-bit
# differences flip elements to the next e4m3 value (a step of 6-12%), and how far that carries depends on
# the model (2-layer random models on the H200: 0.05-0.14 of a unit score scale). Such a model is held to
# bf16's bounds at the least, widened by HF's own result moved by a last-bit change of every projection's
# input (FP8_JITTER, models.fp8.jittered): the same cause, measured on the same prompts.
FP8_SCORE_TOLERANCE = SCORE_TOLERANCE[torch.bfloat16]
FP8_MIN_COSINE = HIDDEN_MIN_COSINE[torch.bfloat16]
FP8_JITTER = 2.0**-8  # a bfloat16 step
NOISE_MARGIN = 4.0  # times HF's own rounding noise that the packed path may differ by
_LENGTHS = (7, 19, 33)


@dataclass(frozen=True)
class SelfCheckReport:
    """What the check compared and how close the two paths came."""

    items: int
    max_score_diff: float
    score_scale: float
    min_hidden_cosine: float
    seconds: float
    hf_noise: float = 0.0  # HF's own score difference, alone vs in a padded batch
    score_bound: float = 0.0  # the largest score difference that was accepted


def run_self_check(scorer: Scorer) -> SelfCheckReport:
    """Score fixed prompts packed and through HF's plain forward; raise ModelLoadError when they disagree."""
    started = time.perf_counter()
    prompts = _fixed_prompts(scorer)
    labels = judge_labels(scorer)
    request = ScoreRequest(
        request_id="self-check",
        items=tuple(prompts),
        return_pooled_hidden_states=True,
        hidden_states_dtype=HiddenDType.FLOAT32,
        label_token_ids=labels,
    )
    with scorer.executor.prefix_cache_paused():  # the packed path as traffic without a cache finds it
        result = scorer.score([request])[0]
    if not result.ok or result.pooled_hidden_states is None:
        raise ModelLoadError(f"self-check: the packed path failed on a fixed input: {result.error}")
    packed_scores = np.asarray(result.scores, dtype=np.float64)
    packed_hidden = np.stack([t.to_numpy().astype(np.float64) for t in result.pooled_hidden_states])
    inputs = _prepared_inputs(scorer, prompts, labels)
    plain_scores, plain_hidden = _plain_forward(scorer, inputs, labels, batched=False)
    scale = max(1.0, float(np.abs(plain_scores).max()))
    diff = float(np.abs(packed_scores - plain_scores).max())
    cosine = _min_cosine(packed_hidden, plain_hidden)
    noise, noise_cosine = _hf_noise(scorer, inputs, labels, plain_scores, plain_hidden)
    tolerance, floor = SCORE_TOLERANCE[scorer.dtype], HIDDEN_MIN_COSINE[scorer.dtype]
    if scorer.config.quantization == "fp8":
        tolerance, floor = max(tolerance, FP8_SCORE_TOLERANCE), min(floor, FP8_MIN_COSINE)
    bound = max(tolerance * scale, NOISE_MARGIN * noise)
    min_cosine = min(floor, 1.0 - NOISE_MARGIN * (1.0 - noise_cosine))
    report = SelfCheckReport(
        len(prompts), diff, scale, cosine, time.perf_counter() - started, hf_noise=noise, score_bound=bound
    )
    if diff > bound or cosine < min_cosine:
        raise ModelLoadError(
            f"self-check failed: on a fixed input the packed path and HuggingFace's own forward disagree "
            f"(largest score difference {diff:.3g}, allowed {bound:.3g}, on a scale of {scale:.3g}; smallest "
            f"hidden-state cosine {cosine:.5f}, allowed {min_cosine:.5f}); this model would be scored "
            "wrongly. Report the model's architecture, or run with attention='reference' to see whether the "
            "attention kernel is the cause."
        )
    return report


def judge_labels(scorer: Scorer) -> tuple[int, ...] | None:
    """A judge's label ids for a synthetic request (the self-check, the warm-up): spread over its vocabulary;
    None for the classifiers, which score with a head."""
    if not scorer.model.judge:
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


Inputs = tuple[list[list[int]], list[list[int] | None]]  # token ids and (encoders) token types per prompt


def _prepared_inputs(
    scorer: Scorer, prompts: list[tuple[int, ...]], labels: tuple[int, ...] | None
) -> Inputs:
    """The prompts as the scorer prepares them (with the template an encoder adds), for HF's forward."""
    prepared = [
        scorer.prepare(ScoreRequest(request_id=f"self-check-{i}", items=(p,), label_token_ids=labels))
        for i, p in enumerate(prompts)
    ]
    ready = [p for p in prepared if isinstance(p, PreparedRequest)]
    if len(ready) != len(prepared):
        raise ModelLoadError("self-check: the fixed input could not be prepared for this model")
    ids = [list(p.prompts[0]) for p in ready]
    types = [list(p.token_types[0]) if p.token_types else None for p in ready]
    return ids, types


@torch.inference_mode()
def _plain_forward(
    scorer: Scorer, inputs: Inputs, labels: tuple[int, ...] | None, batched: bool
) -> tuple[np.ndarray, np.ndarray]:
    """HF's own forward of the prepared prompts, each alone or all in one right-padded batch: the scores and
    pooled hidden states it gives."""
    ids, types = inputs
    groups = [list(range(len(ids)))] if batched else [[i] for i in range(len(ids))]
    scores: list[np.ndarray] = [np.empty(0)] * len(ids)
    hidden: list[np.ndarray] = [np.empty(0)] * len(ids)
    with _plain_attention(scorer.hf_model), hf_torch_functions():
        for group in groups:
            out = _padded_forward(scorer, [ids[i] for i in group], [types[i] for i in group])
            for slot, index in enumerate(group):
                scores[index], hidden[index] = _read(scorer, out, slot, ids[index], labels)
    return np.stack(scores), np.stack(hidden)


def _padded_forward(scorer: Scorer, ids: list[list[int]], types: list[list[int] | None]) -> Any:
    width = max(len(row) for row in ids)
    pad = scorer.pad_token_id if scorer.pad_token_id is not None else 0
    device = scorer.device
    tokens = torch.tensor([row + [pad] * (width - len(row)) for row in ids], device=device)
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids], device=device)
    extra: dict[str, torch.Tensor] = {}
    if scorer.model.token_types:
        padded = [(t or [0] * len(row)) + [0] * (width - len(row)) for t, row in zip(types, ids, strict=True)]
        extra["token_type_ids"] = torch.tensor(padded, device=device)
    return scorer.hf_model(input_ids=tokens, attention_mask=mask, output_hidden_states=True, **extra)


def _read(
    scorer: Scorer, out: Any, slot: int, ids: list[int], labels: tuple[int, ...] | None
) -> tuple[np.ndarray, np.ndarray]:
    """Scores and pooled state of one row of an HF forward (its real tokens only)."""
    row = scorer.head.pooled_row(ids)
    states = out.hidden_states[-1][slot, : len(ids)]  # [L, H]
    pooled = states.float().mean(0) if row is None else states[row].float()
    # With the model's own pooling, HF's logits are the reference; with another, its head on the plainly
    # computed pooled state; a judge's are its logits at the pooled position, label columns only.
    if labels is not None:
        logits = out.logits[slot, row if row is not None else len(ids) - 1, list(labels)]
    elif scorer.head.pools_like_its_head:
        logits = out.logits[slot]
    else:
        logits = scorer.head.apply(pooled[None])[0]
    return logits.double().cpu().numpy(), pooled.double().cpu().numpy()


def _hf_noise(
    scorer: Scorer,
    inputs: Inputs,
    labels: tuple[int, ...] | None,
    alone: np.ndarray,
    alone_hidden: np.ndarray,
) -> tuple[float, float]:
    """How much HF's own results move between two equivalent layouts (alone vs one padded batch), and, with
    FP8 projections, when every projection's input moves by a last bit before it is rounded."""
    noise, cosine = 0.0, 1.0
    if scorer.pad_token_id is not None or scorer.model.judge:  # HF's classifiers pool no pad-less batch
        batched, batched_hidden = _plain_forward(scorer, inputs, labels, batched=True)
        noise, cosine = float(np.abs(batched - alone).max()), _min_cosine(batched_hidden, alone_hidden)
    with jittered(scorer.hf_model, FP8_JITTER) as touched:
        if touched:
            moved, moved_hidden = _plain_forward(scorer, inputs, labels, batched=False)
            noise = max(noise, float(np.abs(moved - alone).max()))
            cosine = min(cosine, _min_cosine(moved_hidden, alone_hidden))
    return noise, cosine


def _min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(min(_cosine(x, y) for x, y in zip(a, b, strict=True)))


@contextlib.contextmanager
def _plain_attention(model: PreTrainedModel) -> Iterator[None]:
    """HF's own attention for the plain forward (eager where SDPA cannot soft-cap), then ours again."""
    config = model.config
    ours = config._attn_implementation
    if ours in ("eager", "sdpa"):
        yield  # a model on the plain path already runs HF's own attention (DeBERTa)
        return
    softcap = getattr(config.get_text_config(), "attn_logit_softcapping", None)
    # Each sub-model's own restored: a packed image-text model's vision tower runs HF's attention, not ours.
    subs = {key: getattr(config, key, None) for key in getattr(config, "sub_configs", {})}
    saved = {"": ours, **{key: sub._attn_implementation for key, sub in subs.items() if sub is not None}}
    model.set_attn_implementation("eager" if softcap is not None else "sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(saved)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    denominator = float(np.linalg.norm(a) * np.linalg.norm(b))
    return 1.0 if denominator == 0 else float(np.dot(a, b) / denominator)
