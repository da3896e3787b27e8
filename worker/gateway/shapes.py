"""Pieces the response shapes share: OpenAI-style ids and creation times, one score per item."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

from worker.gateway.errors import invalid


def call_id(prefix: str) -> str:
    """An id for one answer, as vLLM names them ("classify-...", "pool-...")."""
    return f"{prefix}-{uuid.uuid4().hex}"


def created() -> int:
    return int(time.time())


def single_scores(rows: Sequence[Sequence[float]], route: str) -> Sequence[Sequence[float]]:
    """The rows, each of one score: a route that answers one number per item needs a one-label model."""
    for row in rows:
        if len(row) != 1:
            raise invalid(
                f"{route} answers one score per item, but the model gives {len(row)} per item; use /classify "
                "or /v1/score for a model with several labels"
            )
    return rows
