"""`score-worker demo`: embedded broker, tiny local model, one in-process worker, sample requests printed."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from pydantic import ValidationError
from transformers.utils import logging as hf_logging

from models import ModelLoadError, Scorer, ScorerConfig, write_tiny_model
from schemas import HiddenDType, ResultStatus, ScoreRequest, ScoreResult
from worker.app import ScoreWorker
from worker.broker import EmbeddedBroker
from worker.client import ScoreClient, ScoreClientError
from worker.config import WorkerSettings, describe_validation_error
from worker.errors import WorkerError
from worker.topics import ensure_topics

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
_DEMO_GROUP = "score-demo"
_SHOWN_VALUES = 4  # leading values of each hidden state to print
_OUT_OF_RANGE_TOKEN = 1_000_000  # far beyond any vocabulary: the invalid request
# transformers leaves these unannotated; typed aliases keep the calls checked.
_disable_progress_bar: Callable[[], None] = hf_logging.disable_progress_bar
_enable_progress_bar: Callable[[], None] = hf_logging.enable_progress_bar


@dataclass(frozen=True)
class Sample:
    """A demo request, what it shows, and whether it should be scored (the invalid one should not)."""

    request: ScoreRequest
    description: str
    expect_ok: bool = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `score-worker demo`."""
    parser.add_argument(
        "--model", type=Path, default=None, help="local HF model directory (default: write a tiny random one)"
    )
    parser.add_argument("--device", default="cpu", help="auto, cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for all results")
    parser.add_argument("--verbose", action="store_true", help="show the worker's and broker client's logs")


def run(args: argparse.Namespace) -> int:
    """Run the whole pipeline once on this machine; returns the exit code (0 when every result was right)."""
    out = sys.stdout
    with _quiet_unless(args.verbose), tempfile.TemporaryDirectory(prefix="score-worker-demo-") as tmp:
        model_dir = args.model or _write_demo_model(Path(tmp) / "tiny-llama", out)
        try:
            return _run_with_broker(model_dir, args, out)
        except ValidationError as exc:
            print(f"demo: invalid settings\n{describe_validation_error(exc)}", file=sys.stderr)
            return EXIT_USAGE
        except (WorkerError, ModelLoadError, OSError) as exc:
            print(f"demo failed: {exc}", file=sys.stderr)
            return EXIT_FAILED


def sample_requests() -> list[Sample]:
    """A dozen requests showing each feature: text and token ids, multi-item, hidden-state dtypes, errors."""
    reply = ("The library opens at nine o'clock.", "It is closed on Sunday.", "Ask the farmer.")
    specs: list[tuple[dict[str, object], str]] = [
        ({"items": ("The quick brown fox jumps over the lazy dog.",)}, "text, one item"),
        (
            {"query": "When does the library open?", "items": reply},
            "multi-item: one query, three answers",
        ),
        ({"items": ("Good answers are helpful and honest.",), "apply_softmax": True}, "apply_softmax"),
        ({"items": ((5, 17, 42, 99, 250),)}, "token ids"),
        ({"query": (12, 40, 77), "items": ((300, 8), (9, 10, 11))}, "token ids, query + two items"),
        (
            {"items": ("Cooking dinner takes time.",), **_hidden(HiddenDType.FLOAT32)},
            "hidden states, float32",
        ),
        ({"items": ("Birds sing in the trees.",), **_hidden(HiddenDType.FLOAT16)}, "hidden states, float16"),
        (
            {"items": ("Numbers like one and two.",), **_hidden(HiddenDType.BFLOAT16)},
            "hidden states, bfloat16",
        ),
        (
            {"query": "Is this response correct?", "items": ("Yes.", "No."), **_hidden(HiddenDType.FLOAT16)},
            "multi-item with hidden states",
        ),
        ({"query": "Rate this answer.", "items": ("It is fine.",), "item_first": True}, "item_first"),
        ({"items": ("Echo me back.",), "metadata": {"user": "demo", "attempt": 1}}, "metadata echoed"),
        ({"items": ((4, 5, _OUT_OF_RANGE_TOKEN),)}, "invalid: token id out of range"),
    ]
    samples = [
        Sample(ScoreRequest(request_id=f"demo-{n:02d}", **fields), text)  # type: ignore[arg-type]
        for n, (fields, text) in enumerate(specs, start=1)
    ]
    last = samples[-1]
    samples[-1] = Sample(last.request, last.description, expect_ok=False)
    return samples


def _hidden(dtype: HiddenDType) -> dict[str, object]:
    return {"return_pooled_hidden_states": True, "hidden_states_dtype": dtype}


def _write_demo_model(target: Path, out: TextIO) -> Path:
    # Two labels rather than a single reward score, so that apply_softmax visibly gives probabilities.
    write_tiny_model(target, "llama", seed=0, num_labels=2)
    print(f"model:  tiny random-weight Llama classifier (2 labels) written to {target}", file=out)
    return target


def _run_with_broker(model_dir: Path, args: argparse.Namespace, out: TextIO) -> int:
    with EmbeddedBroker() as broker:
        print(f"broker: embedded Tansu on {broker.bootstrap_servers} (in memory)", file=out)
        values: dict[str, Any] = {
            "bootstrap_servers": broker.bootstrap_servers,
            "model_dir": model_dir,
            "device": args.device,
            "group_id": _DEMO_GROUP,
            # A short session: joining a group on Tansu waits about half of it.
            "session_timeout_ms": 3000,
            "heartbeat_interval_ms": 1000,
        }
        settings = WorkerSettings(**values)
        scorer = Scorer(
            model_dir, ScorerConfig(device=settings.device, max_batch_tokens=settings.max_batch_tokens)
        )
        print(f"worker: one in-process worker, model {scorer.model_name} on {settings.device}", file=out)
        code = asyncio.run(_serve_and_send(settings, scorer, args.timeout, out))
        print("worker stopped; broker stopping", file=out)
        return code


async def _serve_and_send(settings: WorkerSettings, scorer: Scorer, timeout_s: float, out: TextIO) -> int:
    # The client reads the results topic from its end, so it must exist before the client starts.
    await ensure_topics(settings)
    worker = ScoreWorker(settings, scorer)
    worker_task = asyncio.create_task(worker.run(), name="demo-worker")
    sender = asyncio.create_task(_send_and_print(settings, timeout_s, out), name="demo-sender")
    try:
        # A worker that dies (e.g. it cannot publish) must end the demo now, not at the timeout.
        await asyncio.wait({worker_task, sender}, return_when=asyncio.FIRST_COMPLETED)
        if sender.done():
            return sender.result()
        sender.cancel()
        await worker_task  # raises the worker's error
        raise ScoreClientError("the worker stopped before all results arrived")
    finally:
        worker.stop()
        await asyncio.gather(worker_task, return_exceptions=True)


async def _send_and_print(settings: WorkerSettings, timeout_s: float, out: TextIO) -> int:
    samples = {sample.request.request_id: sample for sample in sample_requests()}
    print(f"sending {len(samples)} requests to {settings.requests_topic}; results as they arrive:", file=out)
    started = time.monotonic()
    wrong: list[str] = []
    counts = dict.fromkeys(ResultStatus, 0)
    async with ScoreClient(
        settings.bootstrap_servers,
        requests_topic=settings.requests_topic,
        results_topic=settings.results_topic,
    ) as client:
        requests = [sample.request for sample in samples.values()]
        async for result in client.stream(requests, timeout=timeout_s):
            sample = samples[result.request_id]
            print(format_result(result, sample.description), file=out)
            counts[result.status] += 1
            if result.ok != sample.expect_ok:
                wrong.append(result.request_id)
    print(
        f"{len(samples)} results in {time.monotonic() - started:.1f} s: {counts[ResultStatus.OK]} ok, "
        f"{counts[ResultStatus.ERROR]} error (the invalid request is meant to fail)",
        file=out,
    )
    if wrong:
        print(f"unexpected outcome for: {', '.join(wrong)}", file=out)
        return EXIT_FAILED
    return EXIT_OK


def format_result(result: ScoreResult, description: str) -> str:
    """One line per result, plus one per pooled hidden state (dtype, shape and its first values)."""
    head = f"{result.request_id}  {result.status.value:<5}  {description}"
    if not result.ok:
        assert result.error is not None
        return f"{head}\n    error {result.error.code.value}: {result.error.message}"
    scores = "[" + ", ".join("[" + ", ".join(f"{s:.4f}" for s in row) + "]" for row in result.scores) + "]"
    lines = [f"{head}\n    scores {scores}  prompt_tokens {result.prompt_tokens}"]
    if result.metadata is not None:
        lines.append(f"    metadata {result.metadata!r}")
    for index, tensor in enumerate(result.pooled_hidden_states or ()):
        values = tensor.to_numpy().reshape(-1)[:_SHOWN_VALUES]
        shown = ", ".join(f"{float(v):.4f}" for v in values)
        lines.append(f"    hidden[{index}] {tensor.dtype} shape {tensor.shape} [{shown}, ...]")
    return "\n".join(lines)


@contextmanager
def _quiet_unless(verbose: bool) -> Iterator[None]:
    """The demo's own lines are the point: hold the worker's INFO logs and loading bars back by default."""
    if verbose:
        yield
        return
    quieted = [logging.getLogger(name) for name in ("worker", "models", "aiokafka")]
    levels = [logger.level for logger in quieted]
    for logger in quieted:
        logger.setLevel(logging.WARNING)
    bars = hf_logging.is_progress_bar_enabled()
    _disable_progress_bar()
    try:
        yield
    finally:
        for logger, level in zip(quieted, levels, strict=True):
            logger.setLevel(level)
        if bars:
            _enable_progress_bar()
