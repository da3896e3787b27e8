"""score-worker models: load a local HF sequence-classification model and score requests padding-free.

Names are loaded on first use: `models.settings` (pydantic alone) is imported by the light install's
commands, which have no torch, and must not pull in the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from models.config import ScorerConfig
    from models.engine import Scorer
    from models.errors import ModelLoadError
    from models.interface import (
        BatchObserver,
        BatchStats,
        EngineWrapper,
        ModelInfo,
        PendingScores,
        ScoringEngine,
    )
    from models.plan import BatchPlan
    from models.prepare import PreparedRequest
    from models.settings import EngineSettings
    from models.tiny import write_tiny_model

_HOMES = {
    "BatchObserver": "models.interface",
    "BatchPlan": "models.plan",
    "BatchStats": "models.interface",
    "EngineSettings": "models.settings",
    "EngineWrapper": "models.interface",
    "ModelInfo": "models.interface",
    "ModelLoadError": "models.errors",
    "PendingScores": "models.interface",
    "PreparedRequest": "models.prepare",
    "Scorer": "models.engine",
    "ScorerConfig": "models.config",
    "ScoringEngine": "models.interface",
    "write_tiny_model": "models.tiny",
}

__all__ = [
    "BatchObserver",
    "BatchPlan",
    "BatchStats",
    "EngineSettings",
    "EngineWrapper",
    "ModelInfo",
    "ModelLoadError",
    "PendingScores",
    "PreparedRequest",
    "Scorer",
    "ScorerConfig",
    "ScoringEngine",
    "write_tiny_model",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
