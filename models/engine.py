"""Scorer: the padding-free scoring engine on one device, the owner of its parts along the flow: prepare
(models/prepare.py), plan (models/plan.py), execute (models/execute.py), transfer (models/transfer.py), head
and results (models/results.py). It implements models.interface.ScoringEngine."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from models import assembly
from models.attention import register_attention
from models.compare import comparisons
from models.config import ScorerConfig
from models.errors import DeviceLostError, ModelLoadError
from models.execute import Executor
from models.heads import NamedHeads, head_scores
from models.interface import BatchObserver, ModelInfo, PendingScores
from models.loading import LoadedModel, read_config
from models.packing import saved_tokens
from models.plan import BatchPlan, order_of_places
from models.prefix_cache import CacheTraffic
from models.prepare import PreparedRequest, PromptBuilder, PromptError
from models.results import (
    Collected,
    Head,
    batch_positions,
    batch_stats,
    failed,
    request_scores,
    scored,
    token_outputs,
)
from models.transfer import (
    DeviceTimer,
    HostRows,
    item_ranges,
    read_hidden,
    start_hidden_copy,
    start_position_copy,
    to_host_async,
    wants_hidden,
)
from models.vision import batch_images
from schemas import ErrorCode, ScoreRequest, ScoreResult, Tensor

if TYPE_CHECKING:
    from models.tensor_parallel import Shard

log = logging.getLogger(__name__)


@dataclass(eq=False)
class LaunchedBatch:
    """A batch whose forward pass and output copies are queued on the device (see Scorer.launch)."""

    batch: list[PreparedRequest]
    item_counts: list[int]
    started: float  # host clock at launch
    timer: DeviceTimer
    logits: torch.Tensor | None  # [N, L] float32 on the host once the device has passed the copy
    columns: dict[int, int]  # a judge's label id -> column of `logits`
    rows: HostRows | None  # the asked pooled hidden states, on their way to the host
    hidden_bytes: dict[str, int]
    packed_tokens: int
    compiled_graphs: int = 0  # see BatchStats
    cache: CacheTraffic | None = None  # what the batch took from the prefix cache (None: no cache)
    # Token outputs: the logits at every position read [M, L] on their way to the host, and the asked
    # hidden states there (None where the batch reads no position).
    token_logits: torch.Tensor | None = None
    token_rows: HostRows | None = None
    # The extra heads the batch's requests name: per head, its rows and scores on their way to the host.
    head_outputs: dict[str, tuple[list[int], torch.Tensor]] | None = None


Finished = LaunchedBatch | list[ScoreResult]  # a batch on the device, or its results already


class Scorer:
    """Scores requests with a local *ForSequenceClassification model; one result per request, never raises.

    Threads: `prepare` is the only method that uses the tokenizer, and `score_prepared` (or its two halves,
    `launch` and `finish`, which let a caller queue the next batch on the device before it builds the last
    one's results) only runs the model, so one thread may prepare while another scores (the worker does
    this). Neither method may run on two threads at once: HF fast tokenizers fail ("Already borrowed") when
    shared that way, and one model runs one batch at a time. `score` does both steps on the calling thread.

    Its parts: `plan` (the token-budget rule), `executor` (the forward and its speed-ups), `head` (the task
    head, pooling rules); `model` is what was loaded.
    """

    def __init__(
        self, model_dir: str | Path, config: ScorerConfig | None = None, shard: Shard | None = None
    ) -> None:
        """`shard`: this rank's share of a model split across a tensor-parallel group (models/parallel.py),
        which every rank of the group runs in step; None: the whole model."""
        self.config = config or ScorerConfig()
        name = Path(model_dir).name
        model_config = read_config(Path(model_dir), self.config.trust_remote_code)
        softcap = model_config.get("attn_logit_softcapping")
        try:
            self.device = self.config.resolve_device()
            self.dtype = self.config.resolve_dtype(self.device)
            # "varlen" or "reference" (packed), or "plain" below for a model that cannot run packed.
            self.attention: str = self.config.resolve_attention(self.device, self.dtype, softcap)
            # The varlen path's kernel: "flash", "triton", "fa4", or "injected" (config.varlen_kernel).
            self.attention_kernel = self.config.varlen_kernel_name(self.attention, self.device)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from exc
        if softcap is not None and self.device.type == "cuda":
            log.warning(
                "%s caps attention logits (%s): the varlen kernel cannot, so it runs the exact per-item "
                "attention path, several times slower on long batches", name, softcap,
            )  # fmt: skip
        implementation = register_attention(self.attention, self.config.varlen_kernel, self.attention_kernel)
        # In a tensor-parallel group a batch that fails on one rank cannot be retried in halves there alone:
        # the other ranks' collectives would wait for a forward it does not run. Such a failure stops the
        # group (DeviceLostError); the supervisor restarts it.
        self.shard = shard
        self.model: LoadedModel = assembly.load(
            Path(model_dir), model_config, self.config, self.device, self.dtype, implementation, shard
        )
        if not self.model.packable:
            self.attention = "plain"  # the model's own attention on a padded batch (Executor.padded_pooled)
            self.attention_kernel = "none"
            log.info("%s cannot run packed: it takes the plain padded path", name)
        self.named_heads: NamedHeads | None = None
        if self.config.head_dirs:
            hidden = int(self.model.model.config.get_text_config().hidden_size)
            self.named_heads = NamedHeads(self.config.head_dirs, hidden, self.device, self.dtype)
        self.pooling = self.config.resolve_pooling(self.model.default_pooling)
        self.head = Head(self.model, self.device, self.dtype, self.pooling, per_row=self.config.deterministic)
        self.reward_rule = assembly.reward_rule(self.model, self.head.width)
        self._prompts = assembly.prompt_builder(self.model, self.config, self.named_heads, self.reward_rule)
        self.executor = Executor(
            self.model, self.config, self.device, self.dtype, self.attention, self.pooling
        )
        # Under adapters a prompt's states depend on its adapter: prefixes are shared only within one.
        adapter_key = (lambda p: self._prompts.adapter_index(p.request)) if self._prompts.adapters else None
        self.plan = BatchPlan(assembly.shared_prefix_tokens(self.model, self.config, name), adapter_key)

    @property
    def model_name(self) -> str:
        """The model's name in results: its directory name."""
        return self.model.name

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
        return self.model.vocab_size

    @property
    def pad_token_id(self) -> int | None:
        return self.model.pad_token_id

    @property
    def hf_model(self) -> PreTrainedModel:
        """The loaded transformers model (for the self-check's plain forward)."""
        return self.model.model

    @property
    def num_labels(self) -> int:
        """Floats per item from the model's own head (a judge has one per label id it is asked for)."""
        return self.head.width

    @property
    def hidden_size(self) -> int:
        """Length of a pooled hidden state vector."""
        return self.executor.hidden_size

    @property
    def info(self) -> ModelInfo:
        """Name, architecture, dtype, device, hidden size and the paths and speed-ups the model runs with."""
        graphs = self.executor.graphs
        return ModelInfo(
            name=self.model_name,
            architecture=type(self.model.model).__name__,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            hidden_size=self.hidden_size,
            attention=self.attention,
            attention_kernel=self.attention_kernel,
            pooling=self.pooling,
            compiled=self.executor.compiled,
            cuda_graphs=graphs is not None and graphs.enabled,
            quantization=self.config.quantization,
            fused_mlp=self.executor.fused_mlps is not None,
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
            timings = {"tokenize_s": time.perf_counter() - started}
            return failed(request, exc.code, exc.message, self.model_name, timings)
        except Exception as exc:  # a tokenizer crash on odd input must not take the worker down
            message = (
                f"The model's tokenizer failed on this request ({_describe(exc)}); send the query and items "
                "as token ids instead, or report the request id."
            )
            timings = {"tokenize_s": time.perf_counter() - started}
            return failed(request, ErrorCode.INTERNAL_ERROR, message, self.model_name, timings)

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
        # Deterministic with every item alone: one request per batch (a judge's label columns then depend on
        # the request alone). With row tiles, batches as usual.
        alone = self.config.deterministic and self.executor.row_tiles is None
        budget = 0 if alone else self.config.max_batch_tokens
        indices, requests = [i for i, _ in pending], [p for _, p in pending]
        if budget and not self.plan.fits(requests, budget):
            # More than one batch: requests that share a prefix side by side first, whatever their arrival
            # order, so that a batch holds them together (within one batch the packing finds them anyway).
            places = self.plan.grouped_places(requests)
            order = order_of_places(places)
            indices, requests = [indices[k] for k in order], [requests[k] for k in order]
            runs = self.plan.grouped_runs(requests, [places[k] for k in order], budget)
        else:
            runs = self.plan.runs(requests, budget)
        batches: list[tuple[list[int], object]] = [
            (indices[run.start : run.stop], self._launch_or_recover(requests[run.start : run.stop], on_batch))
            for run in runs
        ]
        return PendingScores(results, batches, on_batch)

    def finish(self, pending: PendingScores) -> list[ScoreResult]:
        """Wait for a launched call's batches and return its results, in request order."""
        results = pending.results
        for indices, launched in pending.batches:
            if not isinstance(launched, LaunchedBatch | list):
                raise TypeError(f"not a batch this engine launched: {type(launched).__name__}")
            for index, result in zip(indices, self._finish_batch(launched, pending.on_batch), strict=True):
                results[index] = result
        return [result for result in results if result is not None]

    def _run_batch(self, batch: list[PreparedRequest], on_batch: BatchObserver | None) -> list[ScoreResult]:
        """Score a batch now, launch and finish."""
        return self._finish_batch(self._launch_or_recover(batch, on_batch), on_batch)

    def _launch_or_recover(self, batch: list[PreparedRequest], on_batch: BatchObserver | None) -> Finished:
        started = time.perf_counter()
        traced = self.executor.traced_graphs()
        cache = self.executor.prefix_cache
        counted = None if cache is None else cache.traffic()
        try:
            launched = self._launch_batch(batch)
        except DeviceLostError:
            raise
        except Exception as exc:  # out of memory, kernel errors: find the request that causes it
            return self._after_failure(batch, exc, on_batch, started)
        launched.compiled_graphs = self.executor.traced_graphs() - traced
        if cache is not None:
            launched.cache = cache.traffic(since=counted)
        return launched

    def _finish_batch(self, launched: Finished, on_batch: BatchObserver | None) -> list[ScoreResult]:
        """A launched batch's results once the device is done (a failed batch's results as they are)."""
        if isinstance(launched, list):
            return launched
        batch = launched.batch
        try:
            collected = self._collect(launched)
        except DeviceLostError:
            raise
        except Exception as exc:  # a kernel error surfaces where the host waits for the device
            return self._after_failure(batch, exc, on_batch, launched.started)
        if launched.compiled_graphs:
            log.info(
                "a batch of %d prompts (%d tokens) compiled %d layer graphs: it took %.2f s",
                sum(launched.item_counts), launched.packed_tokens, launched.compiled_graphs,
                collected.forward_s,
            )  # fmt: skip
        if on_batch is not None:
            forward_s, copy_s = collected.forward_s, collected.copy_s
            on_batch(
                batch_stats(
                    batch, forward_s, copy_s, launched.hidden_bytes, launched.packed_tokens,
                    compiled_graphs=launched.compiled_graphs, cache=launched.cache,
                )
            )  # fmt: skip
        return scored(batch, collected, self.model_name)

    def _after_failure(
        self, batch: list[PreparedRequest], exc: Exception, on_batch: BatchObserver | None, started: float
    ) -> list[ScoreResult]:
        """A batch failed: score its halves apart, down to single requests, so that only a request that
        fails alone gets MODEL_ERROR (one poisonous or oversized request must not fail the innocent ones
        beside it). Raises DeviceLostError when the device is gone."""
        if on_batch is not None:
            on_batch(batch_stats(batch, time.perf_counter() - started, 0.0, {}, failed=True))
        self._recover(exc)
        if self.shard is not None:
            raise DeviceLostError(
                f"a batch failed on rank {self.shard.rank} of the tensor-parallel group ({_describe(exc)}): "
                "the group stops and is restarted"
            ) from exc
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
        timings = {"tokenize_s": sum(p.tokenize_s for p in batch)}
        return [failed(batch[0].request, ErrorCode.MODEL_ERROR, message, self.model_name, timings)]

    @torch.inference_mode()
    def _launch_batch(self, batch: list[PreparedRequest]) -> LaunchedBatch:
        """Queue a batch's forward pass, head and output copies; on the CPU they have run on return."""
        prompts = [prompt for p in batch for prompt in p.prompts]
        item_counts = [len(p.prompts) for p in batch]
        started = time.perf_counter()
        timer = DeviceTimer.start(self.device)
        if not prompts:  # only requests with no items: nothing to run
            return LaunchedBatch(batch, item_counts, started, timer, None, {}, None, {}, 0)
        token_types = None
        if self.model.token_types:
            token_types = [
                types
                for p in batch
                for types in (p.token_types or tuple((0,) * len(prompt) for prompt in p.prompts))
            ]
        adapters = self._adapters_of(batch)  # per prompt, or None: the base model throughout
        shared = self.plan.shared_prefixes(prompts, adapters)  # none where nothing is shared
        positions = batch_positions(batch)
        images = batch_images(batch)
        pooled, at = self.executor.pooled(prompts, token_types, shared, positions, adapters, images)  # [N, H]
        logits, columns = self.head.logits(pooled, batch)
        token_logits = None
        if at is not None and any(p.request.return_token_scores for p in batch if p.positions):
            token_logits, _ = self.head.logits(at, batch)  # the same label columns as the pooled rows'
        if adapters is not None and self.executor.adapters is not None and self.executor.adapters.heads:
            # Adapters trained with their own head (PEFT's modules_to_save) score their rows with it.
            per_row = self.config.deterministic
            self.executor.adapters.apply_heads(logits, pooled, adapters, per_row)
            if token_logits is not None and at is not None and positions is not None:
                per_position = [a for a, read in zip(adapters, positions, strict=True) for _ in read]
                self.executor.adapters.apply_heads(token_logits, at, per_position, per_row)
        head_outputs = None
        if self.named_heads is not None and any(p.request.heads for p in batch):
            head_outputs = self.named_heads.launch(pooled, batch, item_counts, self.config.deterministic)
        timer.mark()  # the forward's end
        # A few bytes per item: softmax on the host needs no extra upload.
        host_logits = to_host_async(logits)
        rows, hidden_bytes = start_hidden_copy(batch, item_counts, pooled)
        token_rows, token_bytes = start_position_copy(batch, at)
        for dtype, size in token_bytes.items():
            hidden_bytes[dtype] = hidden_bytes.get(dtype, 0) + size
        timer.mark()  # the copies' end
        packed_tokens = self.executor.row_tokens or sum(len(p) for p in prompts) - saved_tokens(shared)
        return LaunchedBatch(
            batch, item_counts, started, timer, host_logits, columns, rows, hidden_bytes, packed_tokens,
            token_logits=None if token_logits is None else to_host_async(token_logits), token_rows=token_rows,
            head_outputs=head_outputs,
        )  # fmt: skip

    def _adapters_of(self, batch: Sequence[PreparedRequest]) -> list[int] | None:
        """Each prompt's LoRA adapter index (-1: the base model), or None when no request names one."""
        if not any(p.request.adapter for p in batch):
            return None
        return [self._prompts.adapter_index(p.request) for p in batch for _ in p.prompts]

    def _collect(self, launched: LaunchedBatch) -> Collected:
        """Wait for a launched batch: per-request scores, hidden states, token outputs, extra heads' scores
        and comparisons, forward and copy seconds."""
        forward_s, copy_s = launched.timer.wait(launched.started)
        batch = launched.batch
        if launched.logits is None:
            hidden: list[tuple[Tensor, ...] | None] = [() if wants_hidden(p) else None for p in batch]
            nothing = token_outputs(batch, None, {}, None, 0)
            heads = head_scores({}, batch, launched.item_counts)
            # No prompt in the batch: none of its requests compares (compare needs two items or more).
            return Collected([[] for _ in batch], hidden, nothing, heads, [None] * len(batch), 0.0, 0.0)
        scores = request_scores(launched.logits, launched.columns, batch, launched.item_counts)
        tokens = token_outputs(
            batch, launched.token_logits, launched.columns, launched.token_rows, self.head.width
        )
        named = head_scores(launched.head_outputs or {}, batch, launched.item_counts)
        rows = zip((p.request for p in batch), item_ranges(launched.item_counts), strict=True)
        compared = comparisons(launched.logits, launched.columns, list(rows), self.reward_rule)
        hidden = read_hidden(batch, launched.rows)
        return Collected(scores, hidden, tokens, named, compared, forward_s, copy_s)

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


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
