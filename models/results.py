"""From pooled hidden states to results: the model's head (a judge's label logits), softmax, and the one
result per request, scored or failed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from models.compare import Comparison
from models.interface import BatchStats
from models.loading import LoadedModel
from models.packing import Pooling, pooled_positions
from models.prefix_cache import CacheTraffic
from models.prepare import PreparedRequest
from models.transfer import HostRows, item_ranges, wants_hidden
from schemas import ErrorCode, ResultStatus, ScoreRequest, ScoreResult, Tensor

Scores = list[list[tuple[float, ...]]]  # per request, per item


@dataclass(frozen=True)
class TokenOutputs:
    """One request's token outputs: per item, the positions read, their scores and hidden states (each
    None where not asked)."""

    positions: tuple[tuple[int, ...], ...]
    scores: tuple[Tensor, ...] | None
    hidden: tuple[Tensor, ...] | None


class Head:
    """The model's task head over pooled states [N, H]: float32 logits [N, L] (a judge's: [N, U] over the
    label ids its batch asked for), in the model's dtype as HF runs it."""

    def __init__(
        self, loaded: LoadedModel, device: torch.device, dtype: torch.dtype, pooling: Pooling, per_row: bool
    ) -> None:
        self._loaded = loaded
        self.device, self.dtype, self.pooling = device, dtype, pooling
        self._per_row = per_row  # deterministic: each row alone, so no row depends on the batch's shape
        hidden = int(loaded.model.config.get_text_config().hidden_size)
        with torch.inference_mode():
            probe = torch.zeros(1, hidden, dtype=dtype, device=device)
            self.width = int(loaded.head(probe).shape[-1])

    @property
    def pools_like_its_head(self) -> bool:
        """Whether HF's own forward computes these scores: the model's own head (not a TRL value head loaded
        beside it) with the pooling that head uses."""
        return self.pooling == self._loaded.default_pooling and not self._loaded.value_head

    def pooled_row(self, prompt: Sequence[int]) -> int | None:
        """Index of the pooled token of one prompt (None for MEAN pooling)."""
        if self.pooling == "mean":
            return None
        bounds = np.array([0]), np.array([len(prompt)])
        return int(pooled_positions([prompt], *bounds, self.pooling, self._loaded.pad_token_id)[0])

    @torch.inference_mode()
    def apply(self, pooled: torch.Tensor) -> torch.Tensor:
        """The head on pooled states [N, H] -> float32 scores [N, L]."""
        scores: torch.Tensor = self._loaded.head(pooled.to(device=self.device, dtype=self.dtype))
        return scores.float()

    def logits(
        self, pooled: torch.Tensor, batch: Sequence[PreparedRequest]
    ) -> tuple[torch.Tensor, dict[int, int]]:
        """A batch's logits [N, L] in float32 whatever the model's dtype, and, for a judge, each label id's
        column (empty otherwise)."""
        head_input = pooled.to(self.dtype)  # MEAN pools in float32; the head runs in the model's dtype
        if self._loaded.judge:
            return self._label_logits(head_input, batch)
        if self._per_row:
            return torch.cat([self._loaded.head(row[None]).float() for row in head_input]), {}
        return self._loaded.head(head_input).float(), {}

    def _label_logits(
        self, pooled: torch.Tensor, batch: Sequence[PreparedRequest]
    ) -> tuple[torch.Tensor, dict[int, int]]:
        """A judge's logits for the label tokens any request of the batch asked for, and each label's column.

        Only those rows of lm_head are multiplied: [N, H] x [H, U] instead of [N, H] x [H, vocab].
        """
        labels = sorted({label for p in batch for label in p.request.label_token_ids or ()})
        head = self._loaded.head
        assert isinstance(head, torch.nn.Linear)
        index = torch.tensor(labels, dtype=torch.long, device=pooled.device)
        logits = pooled @ head.weight.index_select(0, index).T  # [N, U]
        if head.bias is not None:
            logits = logits + head.bias.index_select(0, index)
        logits = logits.float()
        cap = self._loaded.final_softcap
        if cap is not None:  # Gemma 2 caps its output logits: tanh(x / cap) * cap, as its HF forward does
            logits = torch.tanh(logits / cap) * cap
        return logits, {label: column for column, label in enumerate(labels)}


def request_scores(
    logits: torch.Tensor,
    columns: dict[int, int],
    batch: Sequence[PreparedRequest],
    item_counts: Sequence[int],
) -> Scores:
    """Each request's rows of the batch's host logits [N, L]: a judge's in the order of its label ids, with
    softmax where the request asked."""
    per_request: Scores = []
    # One conversion for the requests that take their logits as they are (a judge's never do).
    plain = None if columns else logits.tolist()
    for p, rows in zip(batch, item_ranges(item_counts), strict=True):
        if plain is not None and not p.request.apply_softmax:
            per_request.append([tuple(row) for row in plain[rows.start : rows.stop]])
            continue
        scores = _as_asked(logits[rows.start : rows.stop], columns, p.request)
        per_request.append([tuple(row) for row in scores.tolist()])
    return per_request


def _as_asked(logits: torch.Tensor, columns: dict[int, int], request: ScoreRequest) -> torch.Tensor:
    """Rows of a batch's logits [n, L] as `request` asked for them: a judge's label columns (`columns`) in the
    order it sent its label ids, softmax over them where it asked."""
    if columns:
        logits = logits[:, [columns[label] for label in request.label_token_ids or ()]]
    return torch.softmax(logits, dim=-1) if request.apply_softmax else logits


def batch_positions(batch: Sequence[PreparedRequest]) -> list[tuple[int, ...]] | None:
    """Per prompt of the batch, the positions its token outputs read (() for a request without them); None
    when no request of the batch reads any."""
    if not any(p.positions for p in batch):
        return None
    return [at for p in batch for at in (p.positions or ((),) * len(p.prompts))]


def token_outputs(
    batch: Sequence[PreparedRequest],
    logits: torch.Tensor | None,
    columns: dict[int, int],
    rows: HostRows | None,
    width: int,
) -> list[TokenOutputs | None]:
    """Each request's token outputs from the batch's host logits at every position read [M, L] and the
    copied hidden states there (one block per item of the requests that asked), in the batch's order."""
    blocks = iter(rows.read_blocks() if rows is not None else [])
    out: list[TokenOutputs | None] = []
    start = 0
    for p in batch:
        if p.positions is None:
            out.append(None)
            continue
        request = p.request
        scores: list[Tensor] | None = [] if request.return_token_scores else None
        for at in p.positions:
            if scores is not None:
                scores.append(_token_scores(logits, columns, request, start, len(at), width))
            start += len(at)
        hidden = None
        if request.return_token_hidden_states:
            hidden = tuple(next(blocks) for _ in p.positions)
        out.append(TokenOutputs(p.positions, None if scores is None else tuple(scores), hidden))
    return out


def _token_scores(
    logits: torch.Tensor | None,
    columns: dict[int, int],
    request: ScoreRequest,
    start: int,
    count: int,
    width: int,
) -> Tensor:
    """One item's scores at its positions [P, L] in float32: a judge's in the order of its label ids, with
    softmax where the request asked."""
    labels = request.label_token_ids
    if logits is None or count == 0:
        return Tensor.from_numpy(np.zeros((count, len(labels) if labels else width), dtype=np.float32))
    scores = _as_asked(logits[start : start + count], columns, request)
    return Tensor.from_numpy(scores.numpy().astype(np.float32, copy=False))


class Collected(NamedTuple):
    """A finished batch's outputs, per request of the batch: scores, hidden states, token outputs, extra
    heads' scores and comparisons (None where not asked), and the forward and copy seconds."""

    scores: Scores
    hidden: Sequence[tuple[Tensor, ...] | None]
    tokens: Sequence[TokenOutputs | None]
    heads: Sequence[dict[str, tuple[tuple[float, ...], ...]] | None]
    compared: Sequence[Comparison | None]
    forward_s: float
    copy_s: float


def scored(batch: Sequence[PreparedRequest], out: Collected, model: str) -> list[ScoreResult]:
    """One OK result per request of a batch, with the batch's timings."""
    tokenize_s = sum(p.tokenize_s for p in batch)
    timings = {"tokenize_s": tokenize_s, "forward_s": out.forward_s, "copy_s": out.copy_s}
    return [
        ScoreResult(
            request_id=p.request.request_id,
            status=ResultStatus.OK,
            scores=tuple(item_scores),
            pooled_hidden_states=rows,
            prompt_tokens=p.num_tokens,
            model=model,
            timings=dict(timings),
            error=None,
            metadata=p.request.metadata,
            truncated_tokens=p.truncated,
            token_positions=None if outputs is None else outputs.positions,
            token_scores=None if outputs is None else outputs.scores,
            token_hidden_states=None if outputs is None else outputs.hidden,
            head_scores=named,
            rewards=None if compared is None else compared.rewards,
            preference=None if compared is None else compared.preference,
            ranking=None if compared is None else compared.ranking,
            best_probability=None if compared is None else compared.best_probability,
        )
        for p, item_scores, rows, outputs, named, compared in zip(
            batch, out.scores, out.hidden, out.tokens, out.heads, out.compared, strict=True
        )
    ]


def failed(
    request: ScoreRequest, code: ErrorCode, message: str, model: str, timings: dict[str, float]
) -> ScoreResult:
    """The error result of one request."""
    return ScoreResult.failure(
        request.request_id, code, message, model=model, metadata=request.metadata, timings=timings
    )


def batch_stats(
    batch: Sequence[PreparedRequest],
    forward_s: float,
    copy_s: float,
    hidden_bytes: dict[str, int],
    packed_tokens: int | None = None,
    failed: bool = False,
    compiled_graphs: int = 0,
    cache: CacheTraffic | None = None,
) -> BatchStats:
    """What a batch cost, for the engine's observer. `cache`: what it took from the prefix cache (None: no
    cache)."""
    tokens = sum(p.num_tokens for p in batch)
    return BatchStats(
        requests=len(batch),
        items=sum(len(p.prompts) for p in batch),
        tokens=tokens,
        packed_tokens=tokens if packed_tokens is None else packed_tokens,
        forward_s=forward_s,
        copy_s=copy_s,
        hidden_requests=sum(1 for p in batch if wants_hidden(p)),
        hidden_bytes=hidden_bytes,
        failed=failed,
        compiled_graphs=compiled_graphs,
        **(
            {}
            if cache is None
            else {
                "cache_lookups": cache.lookups,
                "cache_hits": cache.hits,
                "cached_tokens": cache.tokens,
                "cache_bytes": cache.bytes,
            }
        ),
    )
