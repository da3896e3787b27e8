"""What the worker uses of a scoring engine, declared once: models.Scorer implements it on one device, and an
engine spread over several devices implements the same members."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from models.plan import BatchPlan
from models.prepare import PreparedRequest, PromptBuilder
from schemas import ScoreRequest, ScoreResult


@dataclass(frozen=True)
class BatchStats:
    """What one forward batch cost: reported once per batch to an observer (the worker's metrics)."""

    requests: int
    items: int
    tokens: int
    forward_s: float
    copy_s: float
    hidden_requests: int  # requests of the batch that asked for pooled hidden states
    # Bytes of pooled hidden states copied to the host, by dtype name ("float32", "float16", "bfloat16").
    hidden_bytes: dict[str, int] = field(default_factory=dict)
    failed: bool = False  # the forward pass raised: its requests are scored again in halves
    # Tokens of the packed row the forward computed: `tokens` less what shared prefixes and the prefix
    # cache saved (0: not reported, read as `tokens`).
    packed_tokens: int = 0
    # Graphs torch.compile traced for the compiled layers while this batch launched: a kind of batch they
    # had not met (models/warmup.py); each holds the model for seconds on a GPU.
    compiled_graphs: int = 0
    # The prefix cache (models/prefix_cache.py), where one is set: prompts looked up, those that found a
    # cached prefix, the tokens they took from it instead of computing, and the bytes it holds after the
    # batch (None: no cache).
    cache_lookups: int = 0
    cache_hits: int = 0
    cached_tokens: int = 0
    cache_bytes: int | None = None


BatchObserver = Callable[[BatchStats], None]


@dataclass(frozen=True)
class ModelInfo:
    """What a loaded model is, for logs and the model info metric."""

    name: str
    architecture: str
    dtype: str
    device: str
    hidden_size: int
    attention: str = "unknown"  # "varlen" (the packed kernel) or "reference" (exact, per item)
    attention_kernel: str = "none"  # the varlen path's kernel: "flash", "triton", "fa4" or "injected"
    pooling: str = "unknown"  # models.packing.Pooling
    compiled: bool = False  # the decoder layers run under torch.compile
    cuda_graphs: bool = False  # small packed batches replay recorded CUDA graphs
    quantization: str = "none"  # "fp8": the transformer layers' projections run in FP8 (models/fp8.py)
    fused_mlp: bool = False  # SiLU-gated MLPs run their gate/up products and activation as one kernel


@dataclass(eq=False)
class PendingScores:
    """What an engine's `launch` queued: pass it to the same engine's `finish` (same thread, launch order)."""

    results: list[ScoreResult | None]  # error results passed through; None where a batch will answer
    # Per batch: the positions of its requests in `results`, and the engine's handle on its device work
    # (or the batch's results already, where it failed and was scored again in parts).
    batches: list[tuple[list[int], object]]
    on_batch: BatchObserver | None = None


class ScoringEngine(Protocol):
    """Everything the worker uses of a model engine, and nothing else.

    Threads: `prepare` runs on the worker's tokeniser thread (and intake processes run copies of
    `prompt_builder`); `launch` and `finish` on its model thread, `finish` in launch order; `plan` is asked
    on both. The other members are read at start-up.
    """

    @property
    def model_name(self) -> str:
        """The model's name in results."""
        ...

    @property
    def info(self) -> ModelInfo:
        """What the loaded model is and how it runs (device, dtype, attention path, speed-ups)."""
        ...

    @property
    def plan(self) -> BatchPlan:
        """The token-budget rule this engine's batches follow."""
        ...

    @property
    def prompt_builder(self) -> PromptBuilder:
        """What `prepare` runs (picklable, tokenizer included)."""
        ...

    @property
    def num_labels(self) -> int:
        """Floats per item from the model's own head (a judge has one per label id it is asked for)."""
        ...

    @property
    def hidden_size(self) -> int:
        """Length of a pooled hidden state vector."""
        ...

    def prepare(self, request: ScoreRequest) -> PreparedRequest | ScoreResult:
        """Tokenise and check a request: prepared, or an error result saying what to change."""
        ...

    def launch(
        self, prepared: Sequence[PreparedRequest | ScoreResult], on_batch: BatchObserver | None = None
    ) -> PendingScores:
        """Queue the forward passes of prepared requests (error results pass through) on the device."""
        ...

    def finish(self, pending: PendingScores) -> list[ScoreResult]:
        """Wait for a launched call and return its results, one per request, in order."""
        ...

    def device_memory(self) -> tuple[int, int] | None:
        """Bytes (allocated, reserved) on the device; None where there is nothing to report (the CPU)."""
        ...


class EngineWrapper:
    """An engine that forwards every member to another: tests and benchmarks subclass it to observe, slow or
    fail one member while the wrapped engine does the work."""

    def __init__(self, engine: ScoringEngine) -> None:
        self.engine = engine

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def info(self) -> ModelInfo:
        return self.engine.info

    @property
    def plan(self) -> BatchPlan:
        return self.engine.plan

    @property
    def prompt_builder(self) -> PromptBuilder:
        return self.engine.prompt_builder

    @property
    def num_labels(self) -> int:
        return self.engine.num_labels

    @property
    def hidden_size(self) -> int:
        return self.engine.hidden_size

    def prepare(self, request: ScoreRequest) -> PreparedRequest | ScoreResult:
        return self.engine.prepare(request)

    def launch(
        self, prepared: Sequence[PreparedRequest | ScoreResult], on_batch: BatchObserver | None = None
    ) -> PendingScores:
        return self.engine.launch(prepared, on_batch)

    def finish(self, pending: PendingScores) -> list[ScoreResult]:
        return self.engine.finish(pending)

    def device_memory(self) -> tuple[int, int] | None:
        return self.engine.device_memory()

    def score_prepared(
        self, prepared: Sequence[PreparedRequest | ScoreResult], on_batch: BatchObserver | None = None
    ) -> list[ScoreResult]:
        """`launch` then `finish`, through this wrapper's own members."""
        return self.finish(self.launch(prepared, on_batch))
