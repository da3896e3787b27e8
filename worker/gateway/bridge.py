"""The Kafka side of the gateway: sends a call's score requests, waits for their results on the gateway's
reply topic, bounds how many calls wait, and keeps track of whether any worker answers."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import time
from collections.abc import Sequence
from typing import Any

from aiokafka.errors import KafkaError

from schemas import ScoreRequest, ScoreResult
from worker.client import ResultsTimeoutError, ScoreClient, ScoreClientError, new_request_id
from worker.environment import GatewaySettings
from worker.gateway.errors import GatewayCode, GatewayError
from worker.gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1.0  # what a refused caller is told to wait: about one worker batch, one probe interval


def default_reply_topic(results_topic: str) -> str:
    """`<results_topic>.gw-<host>-<pid>`: one topic per gateway process, under the results topic's name so
    that the workers' default reply_topic_pattern allows it; the host name cut to Kafka's characters."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:100] or "host"
    return f"{results_topic}.gw-{host}-{os.getpid()}"


class KafkaBridge:
    """One ScoreClient on the gateway's reply topic, shared by every call."""

    def __init__(
        self, settings: GatewaySettings, metrics: GatewayMetrics, kafka_options: dict[str, Any] | None = None
    ) -> None:
        assert settings.bootstrap_servers is not None
        self.reply_topic = settings.gateway_reply_topic or default_reply_topic(settings.results_topic)
        self._client = ScoreClient(
            settings.bootstrap_servers,
            requests_topic=settings.requests_topic,
            results_topic=settings.results_topic,
            client_id="score-gateway",
            max_message_bytes=settings.max_record_bytes,
            kafka_options=kafka_options,
            reply_topic=self.reply_topic,
            compression=settings.requests_compression,
        )
        self._probe_interval = settings.gateway_probe_interval_s
        self._metrics = metrics
        self.waiting = 0
        metrics.waiting.set_function(lambda: self.waiting)  # read at scrape time: no lock per call
        self.model = settings.gateway_model_name
        # None until the first probe or result says; False while probes go unanswered.
        self.answering: bool | None = None
        self._last_answer = 0.0
        self._prober: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._client.start()
        self._prober = asyncio.create_task(self._probe_forever(), name="gateway-probe")
        log.info("gateway reads its results from %s", self.reply_topic)

    async def stop(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            await asyncio.gather(self._prober, return_exceptions=True)
        await self._client.stop()

    async def score(self, requests: Sequence[ScoreRequest], timeout_s: float) -> list[ScoreResult]:
        """The results of `requests`, in order; GatewayError when they cannot come in `timeout_s`."""
        if self.answering is False:
            raise GatewayError(
                503,
                GatewayCode.NO_WORKER,
                "no worker answers on the requests topic; retry later",
                RETRY_AFTER_S,
            )
        self.waiting += 1
        try:
            results = await self._client.score(requests, timeout=timeout_s)
        except ResultsTimeoutError:
            raise GatewayError(
                504, GatewayCode.DEADLINE_EXCEEDED,
                f"no result within the call's deadline ({timeout_s:.3g} s)",
            ) from None  # fmt: skip
        except (KafkaError, ScoreClientError) as error:
            log.warning("a call could not reach Kafka: %s", error)
            raise GatewayError(
                503,
                GatewayCode.BROKER_UNAVAILABLE,
                "the brokers cannot be reached; retry later",
                RETRY_AFTER_S,
            ) from None
        finally:
            self.waiting -= 1
        self._answered(results[-1] if results else None)
        return results

    def _answered(self, result: ScoreResult | None) -> None:
        self._last_answer = time.monotonic()
        if self.answering is not True:
            log.info("a worker answers on %s", self._client.requests_topic)
        self.answering = True
        self._metrics.answering.set(1)
        if result is not None and result.model and not self.model:
            self.model = result.model

    async def _probe_forever(self) -> None:
        """While no result arrives, send an empty request (no model work) and wait one interval for it."""
        while True:
            if time.monotonic() - self._last_answer >= self._probe_interval:
                await self._probe()
            await asyncio.sleep(self._probe_interval / 2)

    async def _probe(self) -> None:
        deadline_ms = int((time.time() + self._probe_interval) * 1000)
        probe = ScoreRequest(request_id=f"probe-{new_request_id()}", items=(), deadline_ms=deadline_ms)
        try:
            (result,) = await self._client.score([probe], timeout=self._probe_interval)
        except (ResultsTimeoutError, KafkaError, ScoreClientError) as error:
            if self.answering is not False:
                log.warning("no worker answers (%s); calls get 503 until one does", type(error).__name__)
            self.answering = False
            self._metrics.answering.set(0)
            return
        self._answered(result)
