"""What W2's worker does under load: its batches (via a recording scorer), thread CPU, GPU use, loop lag."""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models import BatchObserver, EngineWrapper, PendingScores, PreparedRequest, Scorer
from schemas import ScoreRequest, ScoreResult
from worker.app import ScoreWorker
from worker.gc_pauses import GcPauses


@dataclass
class BatchRecord:
    """One score_prepared call of the worker's model thread."""

    start: float
    end: float
    requests: int
    items: int
    tokens: int
    hidden_rows: int
    forward_s: float
    copy_s: float
    hidden_bytes: int
    prepared: list[Any] = field(repr=False)
    kernels_built: int = 0  # Triton kernels compiled during this call (a new shape variant, say)
    graph: str = "none"  # "recorded", "replayed" or "none" (the ordinary forward)
    dynamo_frames: int = 0  # frames torch.compile compiled during this call (a recompile when above 0)
    cpu_start: float = 0.0  # the model thread's CPU time (time.thread_time) at start and end: what it ran
    cpu_end: float = 0.0  # between two calls, against the wall time, tells work from waiting
    reserved_grew_mib: float = 0.0  # how much the CUDA caching allocator reserved during this call


class RecordingScorer(EngineWrapper):
    """The worker's scorer, recording each batch it runs and the native ids of the threads that call it."""

    def __init__(self, scorer: Scorer) -> None:
        super().__init__(scorer)
        self.scorer = scorer
        self.batches: list[BatchRecord] = []
        self._kernel_dir = _triton_cache_dir()
        self.thread_ids: dict[str, int] = {"loop": threading.get_native_id()}
        self._launched: dict[int, _Launch] = {}

    def prepare(self, request: ScoreRequest) -> PreparedRequest | ScoreResult:
        self.thread_ids["prepare"] = threading.get_native_id()
        return self.scorer.prepare(request)

    def launch(
        self, prepared: Sequence[PreparedRequest | ScoreResult], on_batch: BatchObserver | None = None
    ) -> PendingScores:
        """The scorer's launch, noting what the batch's record needs (the worker launches a batch before
        it finishes the one ahead)."""
        self.thread_ids["model"] = threading.get_native_id()
        kernels_before = _entries(self._kernel_dir)
        graphs = self.scorer.executor.graphs
        recorded, replays = (graphs.recorded, graphs.replays) if graphs is not None else (0, 0)
        frames, reserved = _dynamo_frames(), _reserved_bytes()
        cpu_start, start = time.thread_time(), time.monotonic()
        pending = self.scorer.launch(prepared, on_batch)
        graph = "none"
        if graphs is not None:
            graph = (
                "recorded"
                if graphs.recorded > recorded
                else "replayed"
                if graphs.replays > replays
                else "none"
            )
        self._launched[id(pending)] = _Launch(
            list(prepared), start, cpu_start, kernels_before, frames, reserved, graph
        )
        return pending

    def finish(self, pending: PendingScores) -> list[ScoreResult]:
        launch = self._launched.pop(id(pending))
        results = self.scorer.finish(pending)
        end, cpu_end = time.monotonic(), time.thread_time()
        prepared = launch.prepared
        timings = results[0].timings if results else {}
        asked = [p for p in prepared if p.request.return_pooled_hidden_states]
        # Records tile the model thread's time: a batch launched while the one ahead was still to be
        # finished starts where that one's record ends.
        previous = self.batches[-1] if self.batches else None
        start, cpu_start = launch.start, launch.cpu_start
        if previous is not None and previous.end > start:
            start, cpu_start = previous.end, previous.cpu_end
        self.batches.append(
            BatchRecord(
                start=start,
                end=end,
                requests=len(prepared),
                items=sum(len(p.prompts) for p in prepared),
                tokens=sum(p.num_tokens for p in prepared),
                hidden_rows=sum(len(p.prompts) for p in asked),
                forward_s=float(timings.get("forward_s", 0.0)),
                copy_s=float(timings.get("copy_s", 0.0)),
                hidden_bytes=sum(len(t.data) for r in results for t in r.pooled_hidden_states or ()),
                prepared=prepared,
                kernels_built=_entries(self._kernel_dir) - launch.kernels_before,
                graph=launch.graph,
                dynamo_frames=_dynamo_frames() - launch.frames,
                reserved_grew_mib=(_reserved_bytes() - launch.reserved) / 2**20,
                cpu_start=cpu_start,
                cpu_end=cpu_end,
            )
        )
        return results


@dataclass
class _Launch:
    prepared: list[Any]
    start: float
    cpu_start: float
    kernels_before: int
    frames: int
    reserved: int
    graph: str


def _dynamo_frames() -> int:
    """Frames torch.compile has compiled so far in this process."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["frames"]["ok"])
    except Exception:  # a diagnostic only
        return 0


def _reserved_bytes() -> int:
    return torch.cuda.memory_reserved() if torch.cuda.is_available() else 0


def _triton_cache_dir() -> Path | None:
    """Where Triton writes each kernel it compiles (one folder per kernel), for inductor's kernels."""
    if not torch.cuda.is_available():
        return None
    try:
        from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

        return Path(triton_cache_dir(torch.cuda.current_device()))
    except Exception:  # a diagnostic only: without it, compiles are not attributed to batches
        return None


def _entries(folder: Path | None) -> int:
    try:
        return len(os.listdir(folder)) if folder is not None else 0
    except OSError:
        return 0


def _thread_cpu_s(tid: int | None) -> float:
    if tid is None:
        return math.nan
    try:
        # utime and stime are fields 14 and 15; split after the ')' that ends the thread's name.
        fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Sampler:
    """Timestamped samples on a thread: CPU seconds of the process and of the worker's threads, GPU use."""

    def __init__(self, thread_ids: dict[str, int], period_s: float = 0.2) -> None:
        self._ids, self._period = thread_ids, period_s
        self.names = ("process", "loop", "prepare", "model")
        self.samples: list[tuple[float, ...]] = []  # t, cpu of each name, gpu util %
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._nvml: Any = None

    def __enter__(self) -> Sampler:
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device()))
        except Exception:  # NVML is optional: without it the GPU column stays empty
            self._nvml = None
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            cpu = [time.process_time()] + [_thread_cpu_s(self._ids.get(n)) for n in self.names[1:]]
            util = math.nan
            if self._nvml is not None:
                util = float(self._nvml[0].nvmlDeviceGetUtilizationRates(self._nvml[1]).gpu)
            self.samples.append((time.monotonic(), *cpu, util))

    def window(self, a: float, b: float) -> dict[str, float]:
        """CPU cores used by each thread (CPU seconds per second) and median GPU utilisation in [a, b]."""
        rows = np.array([s for s in self.samples if a <= s[0] <= b])
        if len(rows) < 2:
            return {}
        span = rows[-1, 0] - rows[0, 0]
        out = {
            f"cpu_cores_{n}": float((rows[-1, i + 1] - rows[0, i + 1]) / span)
            for i, n in enumerate(self.names)
        }
        out["gpu_util_pct_median"] = (
            float(np.nanmedian(rows[:, -1])) if not np.isnan(rows[:, -1]).all() else math.nan
        )
        return out


async def watch_loop(
    worker: ScoreWorker, out: list[tuple[float, float, int]], period_s: float = 0.01
) -> None:
    """On the worker's loop: how late a 10 ms sleep wakes (the loop's backlog) and the requests in flight."""
    while True:
        before = time.monotonic()
        await asyncio.sleep(period_s)
        now = time.monotonic()
        out.append((now, now - before - period_s, worker.in_flight))


def _spread(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    v = np.asarray(values, dtype=np.float64)
    return {
        "min": v.min(),
        "p50": float(np.median(v)),
        "mean": v.mean(),
        "p90": float(np.percentile(v, 90)),
        "max": v.max(),
    }


class GcLog:
    """Every garbage-collector pause of the process while entered: (when it ended, generation, seconds)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[float, int, float]] = []
        self._watch = GcPauses(
            lambda generation, seconds: self.pauses.append((time.monotonic(), generation, seconds))
        )

    def __enter__(self) -> GcLog:
        self._watch.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._watch.__exit__(None, None, None)

    def window(self, a: float, b: float) -> dict[str, Any]:
        """Per generation in [a, b]: pauses, their total and the longest."""
        out: dict[str, Any] = {}
        for generation in (0, 1, 2):
            inside = [s for t, g, s in self.pauses if g == generation and a <= t <= b]
            out[f"gc{generation}"] = {
                "count": len(inside),
                "total_s": round(sum(inside), 4),
                "max_ms": round(1000 * max(inside, default=0.0), 2),
            }
        return out


def slowest_batches(
    a: float, b: float, batches: Sequence[BatchRecord], count: int = 5
) -> list[dict[str, Any]]:
    """The longest score_prepared calls in [a, b], with their size: where a phase's outliers came from."""
    inside = sorted((r for r in batches if a <= r.start <= b), key=lambda r: r.end - r.start, reverse=True)
    return [
        {
            "ms": round(1000 * (r.end - r.start), 1),
            "tokens": r.tokens,
            "items": r.items,
            "at_s": round(r.start - a, 2),
            "graph": r.graph,
            "kernels_built": r.kernels_built,
            "dynamo_frames": r.dynamo_frames,
            "reserved_grew_mib": round(r.reserved_grew_mib, 1),
        }
        for r in inside[:count]
    ]


def window_stats(
    a: float, b: float, batches: Sequence[BatchRecord], loop: Sequence[tuple[float, float, int]], budget: int
) -> dict[str, Any]:
    """What the worker did in [a, b]: batches formed, model-thread busy share, copies, loop lag, in-flight."""
    inside = [r for r in batches if a <= r.start <= b]
    busy = sum(max(0.0, min(r.end, b) - max(r.start, a)) for r in batches)
    forward, copy = sum(r.forward_s for r in inside), sum(r.copy_s for r in inside)
    scorer_s = sum(r.end - r.start for r in inside)
    # Model-thread time between one score_prepared and the next: result encoding, the executor hand-over,
    # and waiting for the next batch to be formed.
    gaps = [nxt.start - cur.end for cur, nxt in itertools.pairwise(inside)]
    gaps_cpu = [nxt.cpu_start - cur.cpu_end for cur, nxt in itertools.pairwise(inside)]
    lags = [lag for t, lag, _ in loop if a <= t <= b]
    flight = [n for t, _, n in loop if a <= t <= b]
    return {
        "seconds": b - a,
        "batches": len(inside),
        "kernels_built": sum(r.kernels_built for r in inside),
        "dynamo_frames": sum(r.dynamo_frames for r in inside),
        "graphs": {
            kind: {"batches": len(runs), "seconds": round(sum(r.end - r.start for r in runs), 3)}
            for kind in ("recorded", "replayed", "none")
            for runs in [[r for r in inside if r.graph == kind]]
        },
        "batch_tokens": _spread([r.tokens for r in inside]),
        "batch_requests": _spread([r.requests for r in inside]),
        "full_batches_pct": 100.0 * sum(r.tokens >= 0.9 * budget for r in inside) / max(len(inside), 1),
        "model_thread_busy_pct": 100.0 * busy / max(b - a, 1e-9),
        "scorer_s": scorer_s,
        "forward_s": forward,
        "copy_s": copy,
        "host_in_scorer_s": scorer_s - forward - copy,
        "forward_tokens_per_s": sum(r.tokens for r in inside) / max(forward, 1e-9),
        "score_prepared_ms": {k: 1000.0 * v for k, v in _spread([r.end - r.start for r in inside]).items()},
        "copy_share_pct": 100.0 * copy / max(forward + copy, 1e-12),
        "hidden_rows": sum(r.hidden_rows for r in inside),
        "hidden_bytes": sum(r.hidden_bytes for r in inside),
        "gap_between_batches_ms": {k: 1000.0 * v for k, v in _spread(gaps).items()},
        # The model thread's own CPU time in those gaps: the rest it spent waiting (for the interpreter
        # lock, or for a batch to be handed over).
        "gap_cpu_ms": {k: 1000.0 * v for k, v in _spread(gaps_cpu).items()},
        "loop_lag_ms": {k: 1000.0 * v for k, v in _spread(lags).items()},
        "in_flight": _spread(flight),
    }
