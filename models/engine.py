"""Scorer: the padding-free scoring engine (prepare, batch, packed forward, LAST pooling, head, results)."""

from __future__ import annotations

import contextlib
import logging
import operator
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import PreTrainedModel

from models.attention import register_attention
from models.chunks import token_runs
from models.config import ScorerConfig
from models.errors import DeviceLostError, ModelLoadError
from models.fp8 import fp8_supported, quantize_layers
from models.graphs import KEYS_PER_TOKEN, GraphedForward, pooled_row_slots
from models.loading import LoadedModel, load_model, read_config
from models.packing import (
    HostRows,
    KeyLayout,
    PackedBatch,
    PrefixCross,
    RowRequest,
    SharedPrefix,
    find_shared_prefixes,
    hidden_row_bytes,
    pack,
    pool,
    pooled_positions,
    saved_tokens,
    shareable_prefix,
    start_rows_copy,
    to_host_async,
)
from models.pooled_rows import LastLayerAtPooledRows, last_layer_row_wise, padded_rows
from models.prepare import PairTemplate, PreparedRequest, Prompt, PromptBuilder, PromptError
from models.reductions import one_pass_rows
from schemas import ErrorCode, ResultStatus, ScoreRequest, ScoreResult, Tensor

if TYPE_CHECKING:
    from models.fused_mlp import FusedMlps

log = logging.getLogger(__name__)


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
    # Tokens of the packed row the forward computed: `tokens` less what shared prefixes saved (0: not
    # reported, read as `tokens`).
    packed_tokens: int = 0
    # Graphs torch.compile traced for the compiled layers while this batch launched: a kind of batch they
    # had not met (models/warmup.py); each holds the model for seconds on a GPU.
    compiled_graphs: int = 0


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


BatchObserver = Callable[[BatchStats], None]


@dataclass(frozen=True)
class _BatchOutput:
    """Host-side outputs of one forward batch."""

    scores: list[list[tuple[float, ...]]]  # per request, per item
    hidden: list[tuple[Tensor, ...] | None]  # per request; None where not asked
    forward_s: float
    copy_s: float
    hidden_bytes: dict[str, int]
    packed_tokens: int = 0  # tokens of the packed row(s): shared prefixes once


@dataclass
class _GpuTimer:
    """When a batch's forward pass and its copies end: CUDA events on a GPU, where the host returns long
    before the device is done; the host's clock on the CPU, where the work is done when a call returns."""

    events: list[Any] | None  # torch.cuda.Event: the start, then one per mark
    host_marks: list[float] = field(default_factory=list)

    @classmethod
    def start(cls, device: torch.device) -> _GpuTimer:
        return cls([_recorded_event()] if device.type == "cuda" else None)

    def mark(self) -> None:
        if self.events is not None:
            self.events.append(_recorded_event())
        else:
            self.host_marks.append(time.perf_counter())

    def wait(self, started: float) -> tuple[float, float]:
        """Block until the device has passed the last mark; (forward, copy) seconds. On a GPU busy with an
        earlier batch when this one was launched, the forward counts from when it got to this batch."""
        if self.events is None:
            if len(self.host_marks) < 2:
                return 0.0, 0.0
            return self.host_marks[0] - started, self.host_marks[1] - self.host_marks[0]
        self.events[-1].synchronize()
        if len(self.events) < 3:
            return 0.0, 0.0
        start, forward, copies = self.events[:3]
        return start.elapsed_time(forward) / 1000, forward.elapsed_time(copies) / 1000


def _recorded_event() -> Any:
    event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    event.record()
    return event


@dataclass(eq=False)
class _Launched:
    """A batch whose forward pass and output copies are queued on the device (see Scorer.launch)."""

    batch: list[PreparedRequest]
    item_counts: list[int]
    started: float  # host clock at launch
    timer: _GpuTimer
    logits: torch.Tensor | None  # [N, L] float32 on the host once the device has passed the copy
    columns: dict[int, int]  # a judge's label id -> column of `logits`
    rows: HostRows | None  # the asked pooled hidden states, on their way to the host
    hidden_bytes: dict[str, int]
    packed_tokens: int
    compiled_graphs: int = 0  # see BatchStats


@dataclass(eq=False)
class PendingScores:
    """What `Scorer.launch` queued: pass it to `Scorer.finish` (same thread, launch order)."""

    results: list[ScoreResult | None]  # error results passed through; None where a batch will answer
    batches: list[tuple[list[int], _Launched | list[ScoreResult]]]  # request positions, launched batch or
    # its results already (a batch that failed and was bisected)
    on_batch: BatchObserver | None = None


class Scorer:
    """Scores requests with a local *ForSequenceClassification model; one result per request, never raises.

    Threads: `prepare` is the only method that uses the tokenizer, and `score_prepared` (or its two halves,
    `launch` and `finish`, which let a caller queue the next batch on the device before it builds the last
    one's results) only runs the model, so one thread may prepare while another scores (the worker does
    this). Neither method may run on two
    threads at once: HF fast tokenizers fail ("Already borrowed") when shared that way, and one model runs
    one batch at a time. `score` does both steps on the calling thread.
    """

    def __init__(self, model_dir: str | Path, config: ScorerConfig | None = None) -> None:
        self.config = config or ScorerConfig()
        softcap = read_config(Path(model_dir), self.config.trust_remote_code).get("attn_logit_softcapping")
        try:
            self.device = self.config.resolve_device()
            self.dtype = self.config.resolve_dtype(self.device)
            # "varlen" or "reference" (packed), or "plain" below for a model that cannot run packed.
            self.attention: str = self.config.resolve_attention(self.device, self.dtype, softcap)
            # The varlen path's kernel: "flash", "triton", "fa4", or "injected" (config.varlen_kernel).
            self.attention_kernel = (
                "none"
                if self.attention != "varlen"
                else "injected"
                if self.config.varlen_kernel is not None
                else self.config.resolve_attention_kernel(self.device)
            )
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from exc
        if softcap is not None and self.device.type == "cuda":
            log.warning(
                "%s caps attention logits (%s): the varlen kernel cannot, so it runs the exact per-item "
                "attention path, several times slower on long batches", Path(model_dir).name, softcap,
            )  # fmt: skip
        implementation = register_attention(self.attention, self.config.varlen_kernel, self.attention_kernel)
        self._loaded: LoadedModel = load_model(
            Path(model_dir),
            device=self.device,
            dtype=self.dtype,
            attn_implementation=implementation,
            trust_remote_code=self.config.trust_remote_code,
            allow_pickle_weights=self.config.allow_pickle_weights,
        )
        limit = self._loaded.max_position_embeddings
        if self.config.max_input_tokens is not None:
            limit = min(limit, self.config.max_input_tokens)
        if not self._loaded.packable:
            self.attention = "plain"  # the model's own attention on a padded batch (see _plain_pooled_hidden)
            self.attention_kernel = "none"
            log.info("%s cannot run packed: it takes the plain padded path", Path(model_dir).name)
        template = PairTemplate.from_tokenizer(self._loaded.tokenizer) if self._loaded.encoder else None
        self._prompts = PromptBuilder(
            self._loaded.tokenizer,
            self._loaded.vocab_size,
            limit,
            template,
            judge=self._loaded.judge,
            max_request_items=self.config.max_request_items,
            max_request_tokens=self.config.max_request_tokens,
        )
        self.pooling = self.config.resolve_pooling(self._loaded.default_pooling)
        # Read once here: the worker's prepare thread asks for both while the model thread runs, and a
        # transformers config's attribute lookup costs tens of microseconds per request.
        text_config = self._loaded.model.config.get_text_config()
        self._hidden_size = int(text_config.hidden_size)
        self._sliding_window = sliding_window(text_config)
        self._num_labels = self._head_width()
        if self.config.quantization == "fp8":
            self._quantize_fp8(Path(model_dir).name)
        # The shared prefixes of the batch last measured or launched (see _shared_prefixes).
        self._groups_memo: tuple[tuple[Prompt, ...], tuple[SharedPrefix, ...]] | None = None
        self._fused_mlps = self._fuse_mlps(Path(model_dir).name)
        self._pooled_layer = self._last_layer_at_pooled_rows()
        self._compiled: CompiledLayers | None = None
        if self.config.resolve_compile(self.attention, self.device):
            self._compiled = compile_layers(self._loaded.base)
            if self._compiled is None:
                log.info("%s has no decoder layer list to compile: it runs eager", Path(model_dir).name)
        self._graphs: GraphedForward | None = None
        if self.config.resolve_graphs(self.device, self.attention):
            self._graphs = GraphedForward(
                self._fast_packed_forward,
                self.device,
                self.config.graph_max_tokens,
                self.hidden_size,
                self.dtype,
                token_types=self._loaded.token_types,
                pooled_rows=self._pooled_layer is not None,
                recorder=self.config.graph_recorder,
            )
        elif self.config.cuda_graphs == "on":
            log.info(
                "%s takes the %s path, which CUDA graphs cannot record", Path(model_dir).name, self.attention
            )
        if self.config.share_prefix_min_tokens and self._loaded.packable:
            if self._causal_decoder():
                log.info(
                    "prefixes of %d tokens or more that prompts of a batch share are computed once",
                    self.config.share_prefix_min_tokens,
                )
            else:
                log.info("%s is an encoder: its prompts are computed whole", Path(model_dir).name)

    def _quantize_fp8(self, name: str) -> None:
        """Swap the layers' projections for FP8 ones, or refuse to load (ModelLoadError)."""
        reason = fp8_supported(self.device)
        if reason is None and self.device.type == "cuda" and self.dtype != torch.bfloat16:
            reason = f"FP8 projections on CUDA produce bfloat16 (row-wise scales), not {self.dtype}"
        layers = transformer_layers(self._loaded.base)
        if reason is None and layers is None:
            reason = f"{name} has no layer list whose projections could run in FP8"
        if reason is not None or layers is None:
            raise ModelLoadError(f"quantization='fp8': {reason}")
        replaced, kept = quantize_layers(layers)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the bfloat16 weights just dropped
        log.info(
            "%s: %d projections of its %d layers run in FP8 e4m3 (%d of other shapes do not)",
            name, replaced, len(layers), kept,
        )  # fmt: skip

    def _last_layer_at_pooled_rows(self) -> LastLayerAtPooledRows | None:
        """The last layer's row-wise modules restricted to the pooled rows (models/pooled_rows.py), where set,
        on a causal decoder's varlen path (the exact path stays HF's arithmetic) whose pooling selects rows
        (MEAN reads every row); else None."""
        wanted = self.config.last_layer_pooled_rows and self.pooling != "mean"
        if not (wanted and self.attention == "varlen" and self._causal_decoder()):
            return None
        modules = last_layer_row_wise(decoder_layers(self._loaded.base))
        if not modules:
            return None
        log.info("the last layer's %s run only at the rows a batch pools", ", ".join(modules))
        return LastLayerAtPooledRows(modules)

    def _fuse_mlps(self, name: str) -> FusedMlps | None:
        """The layers' SiLU-gated MLPs on the fused kernel where the setting asks (models/fused_mlp.py), or
        None; ModelLoadError when "on" cannot be had."""
        try:
            wanted = self.config.resolve_fused_mlp(self.device, self.dtype, self.attention, self._hidden_size)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from exc
        if not wanted:
            return None
        from models.fused_mlp import FusedMlps  # imports Triton: only where the kernel is wanted

        layers = decoder_layers(self._loaded.base)
        fused = None if layers is None else FusedMlps.of(layers)
        if fused is None:
            log.info("%s has no SiLU-gated MLP the fused kernel takes: its MLPs stay as loaded", name)
        else:
            log.info("%s: the gate/up products and SiLU of %d MLPs run as one kernel", name, len(fused))
        return fused

    @property
    def model_name(self) -> str:
        """The model's name in results: its directory name."""
        return self._loaded.name

    @property
    def prompt_builder(self) -> PromptBuilder:
        """What `prepare` runs (picklable, tokenizer included): intake processes run copies of it."""
        return self._prompts

    @property
    def max_input_tokens(self) -> int:
        """The longest prompt (query + item, in tokens) this scorer accepts."""
        return self._prompts.max_input_tokens

    @property
    def vocab_size(self) -> int:
        return self._loaded.vocab_size

    @property
    def pad_token_id(self) -> int | None:
        return self._loaded.pad_token_id

    @property
    def hf_model(self) -> PreTrainedModel:
        """The loaded transformers model (for the self-check's plain forward)."""
        return self._loaded.model

    @property
    def is_judge(self) -> bool:
        """A causal LM scored on label tokens (requests must carry label_token_ids)."""
        return self._loaded.judge

    @property
    def uses_token_types(self) -> bool:
        return self._loaded.token_types

    @property
    def pools_like_its_head(self) -> bool:
        """Whether HF's own forward computes this scorer's scores: the model's own head (not a TRL value head
        loaded beside it) with the pooling that head uses."""
        return self.pooling == self._loaded.default_pooling and not self._loaded.value_head

    def pooled_row(self, prompt: Sequence[int]) -> int | None:
        """Index of the pooled token of one prompt (None for MEAN pooling)."""
        if self.pooling == "mean":
            return None
        bounds = np.array([0]), np.array([len(prompt)])
        return int(pooled_positions([prompt], *bounds, self.pooling, self.pad_token_id)[0])

    @torch.inference_mode()
    def apply_head(self, pooled: torch.Tensor) -> torch.Tensor:
        """The model's head on pooled states [N, H] -> float32 scores [N, L]."""
        scores: torch.Tensor = self._loaded.head(pooled.to(device=self.device, dtype=self.dtype))
        return scores.float()

    @property
    def sliding_window(self) -> int | None:
        """The tokens a windowed layer lets a token see (itself included), or None when no layer has one."""
        return self._sliding_window

    @property
    def compiled(self) -> bool:
        """The packed path runs the decoder layers under torch.compile."""
        return self._compiled is not None

    @property
    def graphs(self) -> GraphedForward | None:
        """The CUDA graphs of small packed batches (None when off): counts of recordings and replays."""
        return self._graphs

    @torch.inference_mode()
    def record_small_batch_graphs(self) -> int:
        """Record the CUDA graphs of every small batch a request of a few items can make
        (GraphedForward.record_ahead), up to the token budget; how many were recorded (0 without graphs)."""
        if self._graphs is None:
            return 0
        return self._graphs.record_ahead(self.config.max_batch_tokens)

    @property
    def num_labels(self) -> int:
        """Floats per item from the model's own head (a judge has one per label id it is asked for)."""
        return self._num_labels

    def _head_width(self) -> int:
        head_input = torch.zeros(1, self.hidden_size, dtype=self.dtype, device=self.device)
        with torch.inference_mode():
            return int(self._loaded.head(head_input).shape[-1])

    @property
    def hidden_size(self) -> int:
        """Length of a pooled hidden state vector."""
        return self._hidden_size

    @property
    def info(self) -> ModelInfo:
        """Name, architecture, dtype, device and hidden size of the loaded model."""
        model = self._loaded.model
        return ModelInfo(
            name=self.model_name,
            architecture=type(model).__name__,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            hidden_size=self.hidden_size,
            attention=self.attention,
            attention_kernel=self.attention_kernel,
            pooling=self.pooling,
            compiled=self.compiled,
            cuda_graphs=self._graphs is not None and self._graphs.enabled,
            quantization=self.config.quantization,
            fused_mlp=self._fused_mlps is not None,
        )

    def device_memory(self) -> tuple[int, int] | None:
        """Bytes (allocated, reserved) by torch's caching allocator on a CUDA device; None on the CPU."""
        if self.device.type != "cuda":
            return None
        return torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)

    def prepare(self, request: ScoreRequest) -> PreparedRequest | ScoreResult:
        """Tokenize and validate: a PreparedRequest, or an error result saying what is wrong."""
        started = time.perf_counter()
        try:
            return self._prompts.prepare(request)
        except PromptError as exc:
            return self._failure(
                request, exc.code, exc.message, {"tokenize_s": time.perf_counter() - started}
            )
        except Exception as exc:  # a tokenizer crash on odd input must not take the worker down
            message = (
                f"The model's tokenizer failed on this request ({_describe(exc)}); send the query and items "
                "as token ids instead, or report the request id."
            )
            return self._failure(
                request, ErrorCode.INTERNAL_ERROR, message, {"tokenize_s": time.perf_counter() - started}
            )

    def score(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Score requests; results are in request order, one per request."""
        return self.score_prepared([self.prepare(request) for request in requests])

    def score_prepared(
        self, prepared: Sequence[PreparedRequest | ScoreResult], on_batch: BatchObserver | None = None
    ) -> list[ScoreResult]:
        """Run prepared requests in batches of at most max_batch_tokens; error results pass through.

        `on_batch`, when given, is called on this thread with the cost of each forward batch.
        """
        return self.finish(self.launch(prepared, on_batch))

    def launch(
        self, prepared: Sequence[PreparedRequest | ScoreResult], on_batch: BatchObserver | None = None
    ) -> PendingScores:
        """The first half of `score_prepared`: queue the forward passes and the copies of their outputs on
        the device and return without waiting for them. `finish` waits and builds the results. A caller
        that launches the next batch before finishing this one keeps the GPU busy while the host turns this
        batch's outputs into results (the worker does; on the CPU all the work happens here).
        `finish` must follow on the same thread, in launch order.
        """
        results: list[ScoreResult | None] = [
            item if isinstance(item, ScoreResult) else None for item in prepared
        ]
        pending = [(i, item) for i, item in enumerate(prepared) if isinstance(item, PreparedRequest)]
        # Deterministic: one request per batch (a judge's label columns then depend on the request alone).
        budget = 0 if self.config.deterministic else self.config.max_batch_tokens
        indices, requests = [i for i, _ in pending], [p for _, p in pending]
        batches = [
            (indices[run.start : run.stop], self._launch_or_recover(requests[run.start : run.stop], on_batch))
            for run in self.batch_runs(requests, budget)
        ]
        return PendingScores(results, batches, on_batch)

    def batch_runs(self, prepared: Sequence[PreparedRequest], max_tokens: int) -> Iterator[range]:
        """The requests cut, in order, into runs of at most `max_tokens` tokens each (a request over it
        alone), as the engine's split cuts a call: with shared prefixes, by what a run computes, and with
        the requests that share a prompt kept together at a cut (models.chunks.token_runs)."""
        sizes = [p.num_tokens for p in prepared]
        if not self.shares_prefixes:
            return token_runs(sizes, max_tokens)

        def measure(start: int, stop: int) -> int:
            return self.batch_tokens([prompt for p in prepared[start:stop] for prompt in p.prompts])

        def joins(earlier: int, later: int) -> bool:
            return self.share_prefix(prepared[earlier], prepared[later])

        return token_runs(sizes, max_tokens, measure, joins)

    def finish(self, pending: PendingScores) -> list[ScoreResult]:
        """Wait for a launched call's batches and return its results, in request order."""
        results = pending.results
        for indices, launched in pending.batches:
            for index, result in zip(indices, self._finish_batch(launched, pending.on_batch), strict=True):
                results[index] = result
        return [result for result in results if result is not None]

    def _run_batch(self, batch: list[PreparedRequest], on_batch: BatchObserver | None) -> list[ScoreResult]:
        """Score a batch now, launch and finish."""
        return self._finish_batch(self._launch_or_recover(batch, on_batch), on_batch)

    def _launch_or_recover(
        self, batch: list[PreparedRequest], on_batch: BatchObserver | None
    ) -> _Launched | list[ScoreResult]:
        started = time.perf_counter()
        traced = traced_graphs() if self._compiled is not None else 0
        try:
            launched = self._launch_batch(batch)
        except DeviceLostError:
            raise
        except Exception as exc:  # out of memory, kernel errors: find the request that causes it
            return self._after_failure(batch, exc, on_batch, started)
        if self._compiled is not None:
            launched.compiled_graphs = traced_graphs() - traced
        return launched

    def _finish_batch(
        self, launched: _Launched | list[ScoreResult], on_batch: BatchObserver | None
    ) -> list[ScoreResult]:
        """A launched batch's results once the device is done (a failed batch's results as they are)."""
        if isinstance(launched, list):
            return launched
        batch = launched.batch
        try:
            output = self._collect(launched)
        except DeviceLostError:
            raise
        except Exception as exc:  # a kernel error surfaces where the host waits for the device
            return self._after_failure(batch, exc, on_batch, launched.started)
        if launched.compiled_graphs:
            log.info(
                "a batch of %d prompts (%d tokens) compiled %d layer graphs: it took %.2f s",
                sum(launched.item_counts), output.packed_tokens,
                launched.compiled_graphs, output.forward_s,
            )  # fmt: skip
        if on_batch is not None:
            on_batch(
                _stats(
                    batch, output.forward_s, output.copy_s, output.hidden_bytes, output.packed_tokens,
                    compiled_graphs=launched.compiled_graphs,
                )
            )  # fmt: skip
        tokenize_s = sum(p.tokenize_s for p in batch)
        timings = {"tokenize_s": tokenize_s, "forward_s": output.forward_s, "copy_s": output.copy_s}
        return [
            ScoreResult(
                request_id=p.request.request_id,
                status=ResultStatus.OK,
                scores=tuple(scores),
                pooled_hidden_states=hidden,
                prompt_tokens=p.num_tokens,
                model=self.model_name,
                timings=dict(timings),
                error=None,
                metadata=p.request.metadata,
                truncated_tokens=p.truncated,
            )
            for p, scores, hidden in zip(batch, output.scores, output.hidden, strict=True)
        ]

    def _after_failure(
        self, batch: list[PreparedRequest], exc: Exception, on_batch: BatchObserver | None, started: float
    ) -> list[ScoreResult]:
        """A batch failed: score its halves apart, down to single requests, so that only a request that
        fails alone gets MODEL_ERROR (one poisonous or oversized request must not fail the innocent ones
        beside it). Raises DeviceLostError when the device is gone."""
        if on_batch is not None:
            on_batch(_stats(batch, time.perf_counter() - started, 0.0, {}, failed=True))
        self._recover(exc)
        if len(batch) > 1:
            log.warning(
                "a batch of %d requests failed (%s); scoring its halves apart", len(batch), _describe(exc)
            )
            half = len(batch) // 2
            return self._run_batch(batch[:half], on_batch) + self._run_batch(batch[half:], on_batch)
        log.warning("request %s fails alone: %s", batch[0].request.request_id, _describe(exc))
        message = (
            f"The forward pass failed for this request on its own ({_describe(exc)}); if it is out of "
            "memory, send fewer or shorter items; otherwise report the request id."
        )
        tokenize_s = sum(p.tokenize_s for p in batch)
        return [self._failure(batch[0].request, ErrorCode.MODEL_ERROR, message, {"tokenize_s": tokenize_s})]

    @torch.inference_mode()
    def _launch_batch(self, batch: list[PreparedRequest]) -> _Launched:
        """Queue a batch's forward pass, head and output copies; on the CPU they have run on return."""
        prompts = [prompt for p in batch for prompt in p.prompts]
        item_counts = [len(p.prompts) for p in batch]
        started = time.perf_counter()
        timer = _GpuTimer.start(self.device)
        if not prompts:  # only requests with no items: nothing to run
            return _Launched(batch, item_counts, started, timer, None, {}, None, {}, 0)
        token_types = None
        if self._loaded.token_types:
            token_types = [
                types
                for p in batch
                for types in (p.token_types or tuple((0,) * len(prompt) for prompt in p.prompts))
            ]
        # Packed, and counted in the batch's stats (an item alone never shares).
        shared = self._shared_prefixes(prompts) if self.shares_prefixes else []
        if self.config.deterministic:
            forward = self._packed_pooled_hidden if self._loaded.packable else self._plain_pooled_hidden
            # Every item alone, head included: no result depends on what else shares the batch (kernels
            # pick their tiling by the matrix shapes, so a row's rounding can change with the batch).
            pooled = torch.cat(
                [forward([p], None if token_types is None else [t]) for p, t in _with(token_types, prompts)]
            )
        elif self._loaded.packable:
            pooled = self._packed_pooled_hidden(prompts, token_types, shared)
        else:
            pooled = self._plain_pooled_hidden(prompts, token_types)
        head_input = pooled.to(self.dtype)  # MEAN pools in float32; the head runs in the model's dtype
        columns: dict[int, int] = {}
        if self._loaded.judge:
            logits, columns = self._label_logits(head_input, batch)  # [N, U] over the batch's label ids
        elif self.config.deterministic:
            logits = torch.cat([self._loaded.head(row[None]).float() for row in head_input])
        else:
            logits = self._loaded.head(head_input).float()  # [N, L]: float32 whatever the model dtype
        timer.mark()  # the forward's end
        # A few bytes per item: softmax on the host needs no extra upload.
        host_logits = to_host_async(logits)
        rows, hidden_bytes = self._start_hidden_copy(batch, item_counts, pooled)
        timer.mark()  # the copies' end
        packed_tokens = sum(len(p) for p in prompts) - saved_tokens(shared)
        return _Launched(
            batch, item_counts, started, timer, host_logits, columns, rows, hidden_bytes, packed_tokens
        )

    def _collect(self, launched: _Launched) -> _BatchOutput:
        """Wait for a launched batch and turn its outputs into per-request scores and hidden states."""
        forward_s, copy_s = launched.timer.wait(launched.started)
        batch = launched.batch
        if launched.logits is None:
            empty: list[tuple[Tensor, ...] | None] = [() if _wants_hidden(p) else None for p in batch]
            return _BatchOutput([[] for _ in batch], empty, 0.0, 0.0, {})
        hidden = self._read_hidden(batch, launched.rows)
        per_request: list[list[tuple[float, ...]]] = []
        # One conversion for the requests that take their logits as they are (a judge's never do).
        plain = None if launched.columns else launched.logits.tolist()
        for p, rows in zip(batch, _item_ranges(launched.item_counts), strict=True):
            if plain is not None and not p.request.apply_softmax:
                per_request.append([tuple(row) for row in plain[rows.start : rows.stop]])
                continue
            scores = launched.logits[rows.start : rows.stop]
            if launched.columns:  # a judge: this request's labels, in the order it sent them
                scores = scores[:, [launched.columns[label] for label in p.request.label_token_ids or ()]]
            if p.request.apply_softmax:
                scores = torch.softmax(scores, dim=-1)
            per_request.append([tuple(row) for row in scores.tolist()])
        return _BatchOutput(
            per_request, hidden, forward_s, copy_s, launched.hidden_bytes, launched.packed_tokens
        )

    def _packed_pooled_hidden(
        self, prompts: list[Prompt], token_types: list[Prompt] | None, groups: Sequence[SharedPrefix] = ()
    ) -> torch.Tensor:
        """Run the base model on the packed row, the prefixes of shared `groups` once, and pool each item:
        [N, H] (float32 for MEAN)."""
        packed = pack(
            prompts,
            self.device,
            self.pooling,
            self._loaded.pad_token_id,
            token_types=token_types,
            position_pad=self._loaded.position_pad,
            shared=groups,
            gather_keys=bool(groups) and self._gathers_keys(prompts),
        )
        # A replayed graph runs no Python forward: the layers are swapped in only where one runs (in the
        # graphs' own forward when they record, and below).
        hidden = None if self._graphs is None else self._graphs.run(packed)
        if hidden is None:
            # The varlen kernel reads the bounds on the device; the exact path loops over items in
            # Python, and reading them from a device tensor would stall on a copy in every layer.
            on_device = self.attention == "varlen"
            cu_seqlens = packed.cu_seqlens if on_device else packed.host_cu_seqlens
            keys = None
            if packed.shared is not None:
                shared = packed.shared
                cu_k = shared.cu_seqlens_k if on_device else shared.host_cu_seqlens_k
                keys = KeyLayout(shared.key_index, cu_k, shared.max_length_k)
            hidden = self._fast_packed_forward(
                packed.input_ids,
                packed.position_ids,
                cu_seqlens,
                packed.max_length,
                packed.token_type_ids,
                keys=keys,
                cross=packed.cross,
                pooled_rows=self._pooled_rows(packed),
            )
        return pool(hidden, packed)  # [N, H]; float32 for MEAN pooling

    def _fast_packed_forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """`_packed_forward` with the compiled layers and the fused MLPs in place (where the scorer has them)
        for the call: HF's own modules stay as they are for everything else (the self-check's reference,
        the padded path). Swapping them costs host time, which a replayed graph does not spend."""
        with self._compiled or contextlib.nullcontext(), self._fused_mlps or contextlib.nullcontext():
            return self._packed_forward(*args, **kwargs)

    def _pooled_rows(self, packed: PackedBatch) -> torch.Tensor | None:
        """The rows at which a batch's last layer computes its row-wise modules (padded as a CUDA graph of
        its shape pads them), or None: the whole layer."""
        if self._pooled_layer is None:
            return None
        return padded_rows(packed.pooled_rows, pooled_row_slots(len(packed.host_cu_seqlens) - 1))

    @property
    def shares_prefixes(self) -> bool:
        """Batches compute the prefixes their prompts share once: set, on a packed causal decoder, and not
        deterministic (where every item runs alone)."""
        return (
            self.config.share_prefix_min_tokens > 0
            and self._loaded.packable
            and not self.config.deterministic
            and self._causal_decoder()
        )

    def batch_tokens(self, prompts: Sequence[Prompt]) -> int:
        """What a batch of these prompts counts against the token budget (the engine's split, the worker's
        batcher, a large request's parts): the tokens its packed row computes, a shared prefix once. Where
        keys are gathered (sliding windows, the exact path) each suffix reads its prefix's keys again, so
        the count is never below 1/KEYS_PER_TOKEN of the tokens the prompts hold: that bounds the keys a
        layer gathers (and a graph's key buffer holds)."""
        held = sum(len(p) for p in prompts)
        if not self.shares_prefixes:
            return held
        return max(held - saved_tokens(self._shared_prefixes(prompts)), -(-held // KEYS_PER_TOKEN))

    def share_prefix(self, earlier: PreparedRequest, later: PreparedRequest) -> bool:
        """Whether a batch holding both requests would compute a prefix of theirs once: the last prompt of
        the one and the first of the other share at least `share_prefix_min_tokens`, each keeping a token of
        its own. Batch cuts keep such requests together where they can (models.chunks.group_cut)."""
        if not (self.shares_prefixes and earlier.prompts and later.prompts):
            return False
        shared = shareable_prefix(earlier.prompts[-1], later.prompts[0])
        return shared >= self.config.share_prefix_min_tokens

    def _shared_prefixes(self, prompts: Sequence[Prompt]) -> list[SharedPrefix]:
        """find_shared_prefixes, remembered for the last prompts asked about: the batch a caller has just
        measured (the worker's batcher, the engine's split) is the batch launched next, and finding a
        large batch's groups costs milliseconds of host time. The same prompt objects, not equal ones:
        comparing by identity costs nothing, and the memo is replaced in one assignment (the worker
        measures on its intake thread)."""
        memo = self._groups_memo
        if memo is not None and len(memo[0]) == len(prompts) and all(map(operator.is_, memo[0], prompts)):
            return list(memo[1])
        groups = find_shared_prefixes(prompts, self.config.share_prefix_min_tokens)
        self._groups_memo = (tuple(prompts), tuple(groups))
        return groups

    def _gathers_keys(self, prompts: Sequence[Prompt]) -> bool:
        """Whether a batch with shared prefixes gathers each sequence's keys: on the exact path, which reads
        them so, and where a sliding window is shorter than a prompt (a suffix's window then ends inside
        its prefix, which the cross pass over the whole prefix cannot express)."""
        if self.attention != "varlen":
            return True
        window = self._sliding_window
        return window is not None and max(len(p) for p in prompts) > window

    def _causal_decoder(self) -> bool:
        loaded = self._loaded
        return not (loaded.encoder or loaded.token_types or loaded.position_pad is not None)

    def _packed_forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_length: int,
        token_type_ids: torch.Tensor | None,
        *,
        keys: KeyLayout | None = None,
        cross: PrefixCross | None = None,
        pooled_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The base model on one packed row [1, T]: its last hidden states [T, H]. Shared prefixes
        (models/packing.py): suffixes attend to their prefixes through `cross` and, where given, attention
        sequences find their keys through `keys`. With `pooled_rows`, the last layer's row-wise modules run
        at those rows only (models/pooled_rows.py), and only they of the result are meaningful."""
        extra: dict[str, Any] = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        if keys is not None:
            extra["packed_key_index"] = keys.key_index
        if cross is not None:
            extra["prefix_cross"] = cross
        restricted: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if pooled_rows is not None and self._pooled_layer is not None:
            restricted = self._pooled_layer.at(pooled_rows)
        with restricted:
            output = self._loaded.base(
                input_ids=input_ids,
                position_ids=position_ids,
                **extra,
                use_cache=False,
                # Reach our attention function through HF's **kwargs plumbing (see models/attention.py).
                cu_seq_lens_q=cu_seqlens,
                cu_seq_lens_k=cu_seqlens if keys is None else keys.cu_seqlens_k,
                max_length_q=max_length,
                max_length_k=max_length if keys is None else keys.max_length_k,
            )
        hidden: torch.Tensor = output.last_hidden_state[0]
        return hidden

    def _label_logits(
        self, pooled: torch.Tensor, batch: list[PreparedRequest]
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

    def _plain_pooled_hidden(self, prompts: list[Prompt], token_types: list[Prompt] | None) -> torch.Tensor:
        """Models whose attention cannot be packed: HF's own forward on a right-padded batch, then the same
        pooling as the packed path: [N, H] (float32 for MEAN)."""
        count, width = len(prompts), max(len(p) for p in prompts)
        pad = self._loaded.pad_token_id or 0
        ids = np.full((count, width), pad, dtype=np.int64)
        mask = np.zeros((count, width), dtype=np.int64)
        types = np.zeros((count, width), dtype=np.int64)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = prompt
            mask[row, : len(prompt)] = 1
            if token_types is not None:
                types[row, : len(prompt)] = token_types[row]
        extra = {} if token_types is None else {"token_type_ids": torch.from_numpy(types).to(self.device)}
        output = self._loaded.base(
            input_ids=torch.from_numpy(ids).to(self.device),
            attention_mask=torch.from_numpy(mask).to(self.device),
            **extra,
        )
        hidden: torch.Tensor = output.last_hidden_state  # [N, W, H]
        if self.pooling == "mean":
            weights = torch.from_numpy(mask).to(self.device, torch.float32).unsqueeze(-1)  # [N, W, 1]
            return (hidden.float() * weights).sum(1) / weights.sum(1)
        lengths = np.array([len(p) for p in prompts], dtype=np.int64)
        starts = np.arange(count, dtype=np.int64) * width
        rows = pooled_positions(prompts, starts, starts + lengths, self.pooling, self._loaded.pad_token_id)
        return hidden.reshape(count * width, -1).index_select(0, torch.from_numpy(rows).to(self.device))

    def _start_hidden_copy(
        self, batch: list[PreparedRequest], item_counts: list[int], pooled: torch.Tensor
    ) -> tuple[HostRows, dict[str, int]]:
        """Queue the copy of the pooled hidden states the requests asked for (the others cost nothing), and
        count the bytes copied to the host per dtype."""
        asking = [i for i, p in enumerate(batch) if _wants_hidden(p)]
        ranges = list(_item_ranges(item_counts))
        wanted = [RowRequest(tuple(ranges[i]), batch[i].request.hidden_states_dtype) for i in asking]
        copied_bytes: dict[str, int] = {}
        for entry in wanted:
            size = len(entry.rows) * hidden_row_bytes(pooled.shape[1], entry.dtype)
            copied_bytes[entry.dtype.value] = copied_bytes.get(entry.dtype.value, 0) + size
        return start_rows_copy(pooled, [w for w in wanted if w.rows]), copied_bytes

    @staticmethod
    def _read_hidden(batch: list[PreparedRequest], rows: HostRows | None) -> list[tuple[Tensor, ...] | None]:
        """Per request: its pooled hidden states once copied (() for no items), or None where not asked."""
        copied = iter(rows.read() if rows is not None else [])
        return [(next(copied) if len(p.prompts) else ()) if _wants_hidden(p) else None for p in batch]

    def _recover(self, error: BaseException) -> None:
        """After a failed forward: free the cached blocks (an out-of-memory retry needs them), and raise
        DeviceLostError when the device no longer runs anything (a kernel fault kills the CUDA context)."""
        if self.device.type != "cuda":
            return
        try:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            probe = torch.ones(1, device=self.device) + 1
            torch.cuda.synchronize(self.device)
            if probe.item() != 2.0:
                raise RuntimeError("the device computes 1 + 1 wrongly")
        except Exception as probe_error:
            raise DeviceLostError(
                f"{self.device} failed after {_describe(error)} and no longer runs anything "
                f"({_describe(probe_error)}); the process must restart"
            ) from error

    def _failure(
        self, request: ScoreRequest, code: ErrorCode, message: str, timings: dict[str, float]
    ) -> ScoreResult:
        return ScoreResult.failure(
            request.request_id,
            code,
            message,
            model=self.model_name,
            metadata=request.metadata,
            timings=timings,
        )


class CompiledLayers:
    """The decoder layers of a base model under torch.compile, swapped in only for the packed forward.

    One layer at a time rather than the whole model: the layers share one compiled graph (their weights are
    its inputs), compiling takes seconds rather than minutes, and the packed attention kwargs, the pooling
    and the head stay eager. Token counts are dynamic, so batches of any size reuse the graph. HF's own
    forward (the self-check's reference, the plain padded path) keeps the eager layers: it calls them with
    other arguments (masks, caches), each of which would cost a compilation.
    """

    # The layers share their class's forward, so torch.compile keeps all their graphs under one code object
    # and counts them against one recompile limit (8 by default). The last layer at the pooled rows, shared
    # prefixes, gathered keys and a one-token batch each add graphs; past the limit the layers would run
    # eager for the rest of the process. This leaves room for every combination.
    RECOMPILE_LIMIT = 32

    def __init__(self, layers: torch.nn.ModuleList) -> None:
        self._layers = list(layers)
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, self.RECOMPILE_LIMIT)
        self._compiled = [torch.compile(layer.forward, dynamic=True) for layer in self._layers]
        self._reductions: contextlib.AbstractContextManager[None] = contextlib.nullcontext()

    def __enter__(self) -> CompiledLayers:
        for layer, compiled in zip(self._layers, self._compiled, strict=True):
            layer.forward = compiled
        # Traced and compiled on this thread, at a batch's first call: with one-pass row reductions.
        self._reductions = one_pass_rows()
        self._reductions.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._reductions.__exit__(None, None, None)
        for layer in self._layers:
            del layer.forward  # the class's forward again


def sliding_window(config: Any) -> int | None:
    """The tokens a windowed layer of this model lets a token see (itself included), or None when no layer
    has a window. HF configs carry a window some models do not use: Qwen2's unless use_sliding_window,
    Gemma's only on layers typed "sliding_attention"."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window <= 0 or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return window


def decoder_layers(base: torch.nn.Module) -> torch.nn.ModuleList | None:
    """`base`'s decoder layers (its `layers` list), or None when it has none (encoders)."""
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        return None
    return layers


def transformer_layers(base: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The layer stack of a decoder (`layers`) or of a BERT-style encoder (`encoder.layer`), or None."""
    layers = decoder_layers(base)
    if layers is not None:
        return layers
    stack = getattr(getattr(base, "encoder", None), "layer", None)
    return stack if isinstance(stack, torch.nn.ModuleList) and len(stack) > 0 else None


def compile_layers(base: torch.nn.Module) -> CompiledLayers | None:
    """CompiledLayers for `base`'s decoder layers, or None when it has none."""
    layers = decoder_layers(base)
    return None if layers is None else CompiledLayers(layers)


def traced_graphs() -> int:
    """Graphs torch.compile has traced in this process so far."""
    import torch._dynamo.utils  # loaded with torch.compile; imported here for a process that never compiled

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _stats(
    batch: list[PreparedRequest],
    forward_s: float,
    copy_s: float,
    hidden_bytes: dict[str, int],
    packed_tokens: int | None = None,
    failed: bool = False,
    compiled_graphs: int = 0,
) -> BatchStats:
    return BatchStats(
        requests=len(batch),
        items=sum(len(p.prompts) for p in batch),
        tokens=sum(p.num_tokens for p in batch),
        packed_tokens=sum(p.num_tokens for p in batch) if packed_tokens is None else packed_tokens,
        forward_s=forward_s,
        copy_s=copy_s,
        hidden_requests=sum(1 for p in batch if _wants_hidden(p)),
        hidden_bytes=hidden_bytes,
        failed=failed,
        compiled_graphs=compiled_graphs,
    )


def _with(token_types: list[Prompt] | None, prompts: list[Prompt]) -> Iterator[tuple[Prompt, Prompt]]:
    """(prompt, its token types or ()) pairs."""
    for index, prompt in enumerate(prompts):
        yield prompt, () if token_types is None else token_types[index]


def _wants_hidden(prepared: PreparedRequest) -> bool:
    return bool(prepared.request.return_pooled_hidden_states)


def _item_ranges(item_counts: Sequence[int]) -> Iterator[range]:
    start = 0
    for count in item_counts:
        yield range(start, start + count)
        start += count


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
