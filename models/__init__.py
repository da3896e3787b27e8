"""score-worker models: load a local HF sequence-classification model and score requests padding-free."""

from models.config import ScorerConfig
from models.engine import BatchObserver, BatchStats, ModelInfo, Scorer
from models.errors import ModelLoadError
from models.prepare import PreparedRequest
from models.tiny import write_tiny_model

__all__ = [
    "BatchObserver",
    "BatchStats",
    "ModelInfo",
    "ModelLoadError",
    "PreparedRequest",
    "Scorer",
    "ScorerConfig",
    "write_tiny_model",
]
