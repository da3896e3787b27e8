"""`score-worker run` as a service: health endpoints first, the model loaded off the loop, then the worker."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

from worker.config import WorkerSettings
from worker.health import HealthServer, Readiness
from worker.metrics import WorkerMetrics

if TYPE_CHECKING:
    from models import ScoringEngine
    from worker.app import ScoreWorker

log = logging.getLogger(__name__)


class WorkerService:
    """One worker process: /healthz answers from the start, /readyz once the model is loaded, the group
    joined and the broker reachable. `stop()` (or SIGTERM/SIGINT under `serve_with_signals`) drains."""

    def __init__(
        self,
        settings: WorkerSettings,
        load_engine: Callable[[], ScoringEngine],
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.settings = settings
        self._load_engine = load_engine
        self.metrics = metrics or WorkerMetrics(settings.worker_id)
        self.readiness = Readiness(self.metrics)
        self.health: HealthServer | None = None
        if settings.metrics_port:
            # Under a host's supervisor: the socket it bound for this process, inherited.
            fd = settings.metrics_fd
            self.health = HealthServer(
                settings.metrics_host, settings.metrics_port, self.metrics.exposition,
                self.readiness.checks, self.readiness.details,
                listener=None if fd is None else socket.socket(fileno=fd),
            )  # fmt: skip
        self.worker: ScoreWorker | None = None
        self._stop_requested = False

    def stop(self) -> None:
        """Stop: before the model is loaded, exit once it is; after, drain and commit (loop thread only)."""
        self._stop_requested = True
        if self.worker is not None:
            self.worker.stop()

    async def run(self) -> None:
        """Serve until stopped; raises what the worker raises (PublishError, a broker it cannot reach...)."""
        from worker.app import ScoreWorker

        if self.health is not None:
            await self.health.start()
        try:
            # Loading takes seconds to minutes: off the loop, so /healthz and /metrics answer meanwhile.
            engine = await asyncio.get_running_loop().run_in_executor(None, self._load_engine)
            info = engine.info
            log.info(
                "loaded model %s (%s, %s%s on %s, hidden size %d, %s attention, %s, %s)",
                info.name, info.architecture, info.dtype,
                " with FP8 projections" if info.quantization == "fp8" else "", info.device, info.hidden_size,
                info.attention + ("" if info.attention_kernel == "none" else f" ({info.attention_kernel})"),
                ("compiled layers" if info.compiled else "eager layers")
                + (", fused MLP kernel" if info.fused_mlp else ""),
                "CUDA graphs for small batches" if info.cuda_graphs else "no CUDA graphs",
            )  # fmt: skip
            self.metrics.bind_model(info, self.settings.max_batch_tokens, engine.device_memory)
            self.readiness.update(model_loaded=True)
            if self._stop_requested:
                log.info("stop requested during start-up: exiting")
                return
            self.worker = ScoreWorker(self.settings, engine, self.metrics, self.readiness)
            await self.worker.run()
        finally:
            self.readiness.update(model_loaded=False)
            if self.health is not None:
                await self.health.stop()


async def serve_with_signals(service: WorkerService) -> None:
    """Run the service; the first SIGTERM/SIGINT drains, a second one exits at once."""
    loop = asyncio.get_running_loop()
    signals_seen: list[int] = []

    def on_signal(signum: int) -> None:
        signals_seen.append(signum)
        if len(signals_seen) == 1:
            log.info("signal %d: stopping", signum)
            service.stop()
            return
        # A second signal means "now": exit without publishing; uncommitted requests are redelivered.
        log.warning("second signal: exiting without finishing in-flight requests")
        os._exit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        await service.run()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
