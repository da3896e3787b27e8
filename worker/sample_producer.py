"""`score-worker produce-samples`: a steady trickle of mixed sample requests, so a live stack has traffic.

Requests mix text and token ids, one to four items, with and without a query, some with apply_softmax; a
set fraction asks for pooled hidden states (rotating through float32, float16 and bfloat16) and a set
fraction is meant to fail (a token id outside any vocabulary, or an empty prompt) so error results show up
too. Each request's metadata says whether it is meant to fail. Runs until SIGTERM / SIGINT or `--count`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import random
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas import REQUESTS_TOPIC, HiddenDType, Input, ScoreRequest, encode_request, request_headers
from worker.codecs import CODEC_NAMES, DEFAULT_COMPRESSION, Compression, producer_compression
from worker.config import (
    SECURITY_ENV_VARS,
    ClientEnvironment,
    environment_variables,
    read_environment,
    security_from_environment,
)

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


# Every environment variable this command reads (the deployment tests check compose against it).
class SamplesEnvironment(BaseSettings):
    """The sample producer's own SCORE_SAMPLES_* variables (flags override them)."""

    model_config = SettingsConfigDict(env_prefix="SCORE_SAMPLES_", frozen=True, extra="ignore")

    rate: float = Field(5.0, gt=0, allow_inf_nan=False, description="requests per second")
    hidden_fraction: float = Field(0.5, ge=0, le=1, description="share asking for pooled hidden states")
    invalid_fraction: float = Field(
        0.02, ge=0, le=1, description="share the worker must answer with an error"
    )
    compression: Compression = Field(DEFAULT_COMPRESSION, description="codec of the batches sent")


ENV_VARS: tuple[str, ...] = (
    "SCORE_WORKER_BOOTSTRAP_SERVERS",
    "SCORE_WORKER_REQUESTS_TOPIC",
    *environment_variables(SamplesEnvironment),
    *SECURITY_ENV_VARS,
)
DEFAULT_HEARTBEAT_FILE = "/tmp/score-samples.alive"
DEFAULT_TOPIC = REQUESTS_TOPIC

HIDDEN_DTYPES = (HiddenDType.FLOAT32, HiddenDType.FLOAT16, HiddenDType.BFLOAT16)
# The largest id the wire format admits (below 2**31): valid on the wire, outside every model's vocabulary.
OUT_OF_VOCABULARY_TOKEN = 2**31 - 1
# Small enough to sit inside any vocabulary, the tiny test models' included.
_TOKEN_IDS = range(10, 250)
_PROSE = (
    "the answer is clear and the reasoning holds up well under a second look while some steps "
    "could be shorter a careful reader might ask for sources yet the main claim is sound overall "
    "this reply misses the point of the question entirely and adds facts nobody asked about here "
    "numbers dates and names are correct but the tone feels rushed compared with what was needed"
)
_WORDS = _PROSE.split()
_QUERIES = (
    "Is this answer correct?",
    "How helpful is this reply?",
    "Rate the following response.",
    "Does the text answer the question?",
)
# After a stall longer than this (a broker outage, a paused process) the schedule restarts from now:
# catching up on every missed slot would hit the worker with a burst that is not the configured rate.
_MAX_BEHIND_S = 1.0
# Unacknowledged sends above which sending waits; bounds memory while the broker is slow or away.
_MAX_PENDING = 1000
_STOP_FLUSH_TIMEOUT_S = 30.0


def _rate(value: str) -> float:
    rate = float(value)
    if not math.isfinite(rate) or rate <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of requests per second, got {value}")
    return rate


def _fraction(value: str) -> float:
    fraction = float(value)
    if not 0.0 <= fraction <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {value}")
    return fraction


def _count(value: str) -> int:
    count = int(value)
    if count < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (forever) or more, got {value}")
    return count


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `score-worker produce-samples`; the environment supplies the defaults named in ENV_VARS."""
    client = read_environment(ClientEnvironment, "produce-samples")
    env = read_environment(SamplesEnvironment, "produce-samples")
    parser.add_argument(
        "--bootstrap-servers",
        default=client.bootstrap_servers,
        required=client.bootstrap_servers is None,
        metavar="HOST:PORT",
        help="Kafka bootstrap servers, HOST:PORT[,HOST:PORT...] (default: $SCORE_WORKER_BOOTSTRAP_SERVERS)",
    )
    parser.add_argument(
        "--topic",
        default=client.requests_topic,
        metavar="TOPIC",
        help=f"requests topic (default: $SCORE_WORKER_REQUESTS_TOPIC or {DEFAULT_TOPIC})",
    )
    parser.add_argument(
        "--rate",
        type=_rate,
        default=env.rate,
        metavar="PER_SECOND",
        help="requests per second (default: $SCORE_SAMPLES_RATE or 5)",
    )
    parser.add_argument(
        "--hidden-fraction",
        type=_fraction,
        default=env.hidden_fraction,
        metavar="FRACTION",
        help="share of requests asking for pooled hidden states, dtypes in rotation "
        "(default: $SCORE_SAMPLES_HIDDEN_FRACTION or 0.5)",
    )
    parser.add_argument(
        "--invalid-fraction",
        type=_fraction,
        default=env.invalid_fraction,
        metavar="FRACTION",
        help="share of requests the worker must answer with an error "
        "(default: $SCORE_SAMPLES_INVALID_FRACTION or 0.02)",
    )
    parser.add_argument(
        "--count", type=_count, default=0, metavar="N", help="stop after N requests (default 0: forever)"
    )
    parser.add_argument("--seed", type=int, default=None, help="random seed of the mix (default: random)")
    parser.add_argument(
        "--compression",
        choices=CODEC_NAMES,
        default=env.compression,
        help=f"codec of the batches sent (default: $SCORE_SAMPLES_COMPRESSION or {DEFAULT_COMPRESSION})",
    )
    parser.add_argument(
        "--heartbeat-file",
        type=Path,
        default=Path(DEFAULT_HEARTBEAT_FILE),
        metavar="PATH",
        help=f"touched after each acknowledged send, for health checks (default {DEFAULT_HEARTBEAT_FILE})",
    )
    parser.add_argument(
        "--log-interval",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="seconds between progress lines (default 30)",
    )


def run(args: argparse.Namespace) -> int:
    """Send until stopped or `--count` is reached; 0 on a signal or when every request was acknowledged."""
    mix = SampleMix(args.hidden_fraction, args.invalid_fraction, seed=args.seed)
    try:
        security = security_from_environment().kafka_security_kwargs()
    except ValueError as error:
        log.error("%s", error)
        return EXIT_USAGE
    log.info(
        "producing samples to %s on %s: %.3g/s, %.0f%% with hidden states, %.0f%% meant to fail, %s",
        args.topic, args.bootstrap_servers, args.rate, 100 * args.hidden_fraction,
        100 * args.invalid_fraction, f"{args.count} requests" if args.count else "until stopped",
    )  # fmt: skip
    try:
        counts = asyncio.run(_produce(args, mix, security))
    except (KafkaError, OSError) as error:
        log.error("cannot produce to %s on %s: %s", args.topic, args.bootstrap_servers, error)
        return EXIT_FAILED
    log.info("stopped after %s", counts.describe())
    if args.count and counts.acknowledged != counts.sent:
        return EXIT_FAILED
    return EXIT_OK


def meant_to_fail(request: ScoreRequest) -> bool:
    """Whether a sample request was built to be answered with an error (its metadata says so)."""
    return isinstance(request.metadata, dict) and request.metadata.get("expect") == "error"


class _Spread:
    """Picks `fraction` of the request numbers, evenly spread: exact over any run, never in clumps."""

    def __init__(self, fraction: float, phase: float) -> None:
        self._fraction = fraction
        self._phase = phase

    def __call__(self, n: int) -> bool:
        before = n * self._fraction + self._phase
        return math.floor(before + self._fraction) > math.floor(before)


class SampleMix:
    """The n-th sample request, reproducible from the seed (the ids carry a per-run random tag)."""

    def __init__(self, hidden_fraction: float, invalid_fraction: float, seed: int | None = None) -> None:
        self._rng = random.Random(seed)
        self._hidden = _Spread(hidden_fraction, self._rng.random())
        self._invalid = _Spread(invalid_fraction, self._rng.random())
        self._hidden_asked = 0
        self._invalid_made = 0
        self.run_tag = uuid.uuid4().hex[:12]

    def request(self, n: int) -> ScoreRequest:
        fails = self._invalid(n)
        hidden = self._hidden(n)
        dtype = HiddenDType.FLOAT32
        if hidden:
            dtype = HIDDEN_DTYPES[self._hidden_asked % len(HIDDEN_DTYPES)]
            self._hidden_asked += 1
        query, items, item_first = self._invalid_inputs() if fails else self._inputs()
        return ScoreRequest(
            request_id=f"sample-{self.run_tag}-{n}",
            items=items,
            query=query,
            item_first=item_first,
            apply_softmax=self._rng.random() < 0.25,
            return_pooled_hidden_states=hidden,
            hidden_states_dtype=dtype,
            metadata={"source": "produce-samples", "n": n, "expect": "error" if fails else "ok"},
        )

    def _inputs(self) -> tuple[Input | None, tuple[Input, ...], bool]:
        rng = self._rng
        as_text = rng.random() < 0.5
        make: Callable[[], Input] = self._text if as_text else self._token_ids
        items = tuple(make() for _ in range(rng.randint(1, 4)))
        query: Input | None = None
        if rng.random() < 0.5:
            query = rng.choice(_QUERIES) + " " if as_text else self._token_ids()
        return query, items, query is not None and rng.random() < 0.2

    def _invalid_inputs(self) -> tuple[Input | None, tuple[Input, ...], bool]:
        # Both are valid on the wire, so the worker itself must answer them: TOKEN_ID_OUT_OF_RANGE and
        # EMPTY_INPUT (token ids get no special tokens added, so an empty array stays an empty prompt).
        self._invalid_made += 1
        if self._invalid_made % 2:
            return None, ((*self._token_ids(), OUT_OF_VOCABULARY_TOKEN), self._token_ids()), False
        return None, ((),), False

    def _text(self) -> str:
        words = self._rng.choices(_WORDS, k=self._rng.randint(3, 30))
        return " ".join(words).capitalize() + "."

    def _token_ids(self) -> tuple[int, ...]:
        return tuple(self._rng.choices(_TOKEN_IDS, k=self._rng.randint(3, 40)))


@dataclass
class Counts:
    """What was sent since the start, and how the broker answered."""

    sent: int = 0
    acknowledged: int = 0
    failed: int = 0
    hidden: int = 0
    meant_to_fail: int = 0

    def describe(self) -> str:
        return (
            f"{self.sent} requests: {self.acknowledged} acknowledged, {self.failed} failed, "
            f"{self.hidden} asking hidden states, {self.meant_to_fail} meant to fail"
        )


class _Sender:
    """Sends on schedule, counts acknowledgements in callbacks, touches the heartbeat on each success."""

    def __init__(self, args: argparse.Namespace, producer: AIOKafkaProducer, mix: SampleMix) -> None:
        self._args = args
        self._producer = producer
        self._mix = mix
        self.counts = Counts()
        self._pending: set[asyncio.Future[object]] = set()
        self._failing = False

    async def send(self, n: int) -> None:
        request = self._mix.request(n)
        if len(self._pending) >= _MAX_PENDING:
            await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
        self.counts.sent += 1
        self.counts.hidden += request.return_pooled_hidden_states
        self.counts.meant_to_fail += meant_to_fail(request)
        try:
            future = await self._producer.send(
                self._args.topic,
                value=encode_request(request),
                key=request.request_id.encode(),
                headers=request_headers(request.request_id),
            )
        except KafkaError as error:
            self._on_failure(error)
            return
        self._pending.add(future)
        future.add_done_callback(self._on_done)

    def _on_done(self, future: asyncio.Future[object]) -> None:
        self._pending.discard(future)
        if future.cancelled():
            self._on_failure(asyncio.CancelledError())
            return
        error = future.exception()
        if error is not None:
            self._on_failure(error)
            return
        self.counts.acknowledged += 1
        if self._failing:
            self._failing = False
            log.info("sends are acknowledged again")
        try:
            self._args.heartbeat_file.touch()
        except OSError as touch_error:  # the health check will notice; sending goes on
            log.debug("cannot touch %s: %s", self._args.heartbeat_file, touch_error)

    def _on_failure(self, error: BaseException) -> None:
        self.counts.failed += 1
        # Once per outage, not once per request: the progress lines carry the running count.
        if not self._failing:
            self._failing = True
            log.warning("a send failed (%s); counting further failures in the progress lines", error)

    async def drain(self) -> None:
        if self._pending:
            await asyncio.wait(self._pending, timeout=_STOP_FLUSH_TIMEOUT_S)


async def _produce(args: argparse.Namespace, mix: SampleMix, security: dict[str, Any]) -> Counts:
    stop = asyncio.Event()
    producer = AIOKafkaProducer(
        bootstrap_servers=args.bootstrap_servers, client_id="score-samples", acks="all", linger_ms=5,
        compression_type=producer_compression(args.compression), **security,
    )  # fmt: skip
    sender = _Sender(args, producer, mix)
    with _stop_on_signals(stop):
        try:
            await producer.start()
            # A missing topic fails here, with its name, rather than at the first send's timeout.
            await producer.partitions_for(args.topic)
            reporter = asyncio.create_task(_report(sender.counts, args.log_interval, stop))
            try:
                await _paced(sender, args.rate, args.count, stop)
                await sender.drain()
            finally:
                stop.set()
                await reporter
        finally:
            await producer.stop()
    return sender.counts


async def _paced(sender: _Sender, rate: float, count: int, stop: asyncio.Event) -> None:
    """Request n is due at start + n / rate on the monotonic clock, so the rate never drifts."""
    interval = 1.0 / rate
    started = time.monotonic()
    slot = 0  # request slots since `started`
    n = 0
    while not stop.is_set() and (count == 0 or n < count):
        delay = started + slot * interval - time.monotonic()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            if stop.is_set():
                break
        elif -delay > _MAX_BEHIND_S:
            started, slot = time.monotonic(), 0
        await sender.send(n)
        n += 1
        slot += 1


async def _report(counts: Counts, interval_s: float, stop: asyncio.Event) -> None:
    last = Counts()
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)
        if stop.is_set():
            return
        log.info(
            "last %g s: sent %d, acknowledged %d, failed %d; in all %s",
            interval_s, counts.sent - last.sent, counts.acknowledged - last.acknowledged,
            counts.failed - last.failed, counts.describe(),
        )  # fmt: skip
        last = Counts(**vars(counts))


@contextlib.contextmanager
def _stop_on_signals(stop: asyncio.Event) -> Iterator[None]:
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
            continue
        installed.append(sig)
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
