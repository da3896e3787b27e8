"""score-worker models: load a local HF sequence-classification model and score requests padding-free."""

from models.config import ScorerConfig
from models.engine import Scorer
from models.errors import ModelLoadError
from models.interface import BatchObserver, BatchStats, EngineWrapper, ModelInfo, PendingScores, ScoringEngine
from models.plan import BatchPlan
from models.prepare import PreparedRequest
from models.tiny import write_tiny_model

__all__ = [
    "BatchObserver",
    "BatchPlan",
    "BatchStats",
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
