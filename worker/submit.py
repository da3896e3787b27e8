"""`score-worker submit`: send a JSONL file of requests to Kafka, write their results in input order."""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import msgpack
from aiokafka.errors import KafkaError

from schemas import (
    SCHEMA_VERSION,
    ResultStatus,
    SchemaError,
    ScoreRequest,
    ScoreResult,
    decode_request,
    encode_result,
)
from worker.client import (
    ScoreClient,
    ScoreClientError,
    new_request_id,
)
from worker.codecs import CODEC_NAMES, DEFAULT_COMPRESSION
from worker.config import ClientEnvironment, read_environment, security_from_environment

EXIT_OK = 0
EXIT_FAILED = 1  # the broker could not be reached, or results were missing at the timeout
EXIT_BAD_INPUT = 2  # nothing was sent
_MSGPACK_SUFFIXES = {".msgpack", ".mpk", ".mp"}


class InputError(ValueError):
    """A request line is invalid; the message names the line."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `score-worker submit`."""
    env = read_environment(ClientEnvironment, "submit")
    parser.add_argument(
        "--bootstrap-servers",
        default=env.bootstrap_servers,
        required=env.bootstrap_servers is None,
        metavar="HOST:PORT",
        help="Kafka bootstrap servers, HOST:PORT[,HOST:PORT...] (default: $SCORE_WORKER_BOOTSTRAP_SERVERS)",
    )
    parser.add_argument(
        "--input",
        required=True,
        metavar="FILE",
        help="JSONL file of requests, one JSON object per line ('-' for stdin)",
    )
    parser.add_argument(
        "--output", default="-", metavar="FILE", help="where results go (default '-', stdout)"
    )
    parser.add_argument(
        "--format",
        choices=("jsonl", "msgpack"),
        help="result format (default: msgpack for a .msgpack/.mpk output file, JSONL otherwise)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="seconds to wait for all results (default 300)",
    )
    parser.add_argument(
        "--max-record-bytes",
        type=int,
        default=env.max_record_bytes,
        metavar="BYTES",
        help="largest request record to send (default: $SCORE_WORKER_MAX_RECORD_BYTES or 1048576)",
    )
    parser.add_argument(
        "--requests-topic",
        default=env.requests_topic,
        metavar="TOPIC",
        help="topic requests are sent to (default: $SCORE_WORKER_REQUESTS_TOPIC or score.requests)",
    )
    parser.add_argument(
        "--results-topic",
        default=env.results_topic,
        metavar="TOPIC",
        help="topic results are read from (default: $SCORE_WORKER_RESULTS_TOPIC or score.results)",
    )
    parser.add_argument(
        "--compression",
        choices=CODEC_NAMES,
        default=env.requests_compression,
        help=f"codec of the request batches sent (default: $SCORE_WORKER_REQUESTS_COMPRESSION or "
        f"{DEFAULT_COMPRESSION}); results of any codec are read",
    )
    _add_compare_arguments(parser)
    parser.add_argument(
        "--reply-topic",
        default=None,
        metavar="TOPIC",
        help="have the results sent to this topic of your own (created if missing; the workers' "
        "reply_topic_pattern must allow it, by default score.results.<anything>) and read only it",
    )


def _add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    """The comparison flags: what `compare` and `reward_column` lines without them get."""
    parser.add_argument(
        "--compare",
        choices=("pairwise", "rank"),
        default=None,
        help="compare the items of every request that does not say otherwise: 'pairwise' (two items: "
        "P(first preferred)) or 'rank' (the order by reward and each item's probability of being the best)",
    )
    parser.add_argument(
        "--reward-column",
        type=int,
        default=None,
        metavar="INDEX",
        help="with --compare: the index of the score that is each item's reward, where an item has several",
    )


def run(args: argparse.Namespace) -> int:
    """Validate every input line, send the requests, write one result per request; returns the exit code."""
    try:
        requests = read_requests(args.input, _line_defaults(args))
        security = security_from_environment().kafka_security_kwargs()
    except (InputError, UnicodeDecodeError, OSError, ValueError) as exc:
        print(f"score-worker submit: {exc} (nothing was sent)", file=sys.stderr)
        return EXIT_BAD_INPUT
    output_format = args.format or _format_for(args.output)
    try:
        with _open_output(args.output, output_format) as stream:
            counts = asyncio.run(_score_to(stream, output_format, requests, args, security))
    except (ScoreClientError, KafkaError, OSError) as exc:
        print(f"score-worker submit: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(
        f"score-worker submit: {len(requests)} results ({counts[ResultStatus.OK]} ok, "
        f"{counts[ResultStatus.ERROR]} error)",
        file=sys.stderr,
    )
    return EXIT_OK


def _line_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """Request fields the flags give every line that does not set them itself."""
    if args.reward_column is not None and args.compare is None:
        raise InputError("--reward-column needs --compare")
    if args.compare is None:
        return {}
    return {"compare": args.compare, "reward_column": args.reward_column}


def read_requests(path: str, defaults: dict[str, Any] | None = None) -> list[ScoreRequest]:
    """Parse and validate a whole JSONL input, each line's missing fields taken from `defaults` (the
    flags'); raises `InputError` naming the first bad line."""
    requests: list[ScoreRequest] = []
    first_line_of: dict[str, int] = {}
    with _open_input(path) as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            request = parse_request_line(line, number, defaults)
            if request.request_id in first_line_of:
                raise InputError(
                    f"line {number}: request_id {request.request_id!r} already used on line "
                    f"{first_line_of[request.request_id]}"
                )
            first_line_of[request.request_id] = number
            requests.append(request)
    return requests


def parse_request_line(line: str, number: int, defaults: dict[str, Any] | None = None) -> ScoreRequest:
    """One JSON object with the wire format's field names; a missing request_id is generated, and other
    missing fields are taken from `defaults`."""
    try:
        fields = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"line {number}: not valid JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(fields, dict):
        raise InputError(f"line {number}: expected a JSON object, got {type(fields).__name__}")
    for name, value in (defaults or {}).items():
        if fields.get(name) is None:
            fields[name] = value
    requires = fields.get("requires")
    if defaults and "compare" in defaults and (requires is None or isinstance(requires, list)):
        # A worker older than compare must refuse the line, not answer it with scores alone.
        fields["requires"] = [*(requires or []), *(["compare"] if "compare" not in (requires or []) else [])]
    fields.setdefault("request_id", new_request_id())
    fields.setdefault("version", SCHEMA_VERSION)
    # Validate through the wire decoder itself, so the file accepts exactly what a worker accepts.
    try:
        packed = msgpack.packb(fields)
    except (OverflowError, ValueError, TypeError) as exc:  # e.g. an integer too large for msgpack
        raise InputError(f"line {number}: cannot be encoded: {exc}") from None
    try:
        return decode_request(packed)
    except SchemaError as exc:
        raise InputError(f"line {number}: {exc.code.value}: {exc.message}") from None


def result_to_json(result: ScoreResult) -> dict[str, Any]:
    """The wire result map with each tensor as {dtype, shape, data_base64}."""
    wire = msgpack.unpackb(encode_result(result), raw=False)
    return {key: _jsonable(value) for key, value in wire.items()}


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        if isinstance(value.get("data"), bytes) and {"dtype", "shape"} <= value.keys():
            rest = {k: _jsonable(v) for k, v in value.items() if k != "data"}
            return {**rest, "data_base64": base64.b64encode(value["data"]).decode("ascii")}
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes):  # only possible inside echoed metadata
        return {"base64": base64.b64encode(value).decode("ascii")}
    return value


async def _score_to(
    stream: IO[bytes],
    output_format: str,
    requests: list[ScoreRequest],
    args: argparse.Namespace,
    security: dict[str, Any],
) -> dict[ResultStatus, int]:
    index_of = {request.request_id: i for i, request in enumerate(requests)}
    arrived: dict[int, ScoreResult] = {}
    next_index = 0
    counts = dict.fromkeys(ResultStatus, 0)
    async with ScoreClient(
        args.bootstrap_servers,
        requests_topic=args.requests_topic,
        results_topic=args.results_topic,
        reply_topic=args.reply_topic,
        max_message_bytes=args.max_record_bytes,
        kafka_options=security,
        compression=args.compression,
    ) as client:
        async for result in client.stream(requests, timeout=args.timeout):
            arrived[index_of[result.request_id]] = result
            counts[result.status] += 1
            # Results come in any order; write each as soon as all before it are written.
            while next_index in arrived:
                stream.write(_render(arrived.pop(next_index), output_format))
                next_index += 1
            stream.flush()
    return counts


def _render(result: ScoreResult, output_format: str) -> bytes:
    if output_format == "msgpack":
        return encode_result(result)
    return (json.dumps(result_to_json(result), ensure_ascii=False, allow_nan=True) + "\n").encode()


def _format_for(output: str) -> str:
    return "msgpack" if output != "-" and Path(output).suffix.lower() in _MSGPACK_SUFFIXES else "jsonl"


@contextmanager
def _open_input(path: str) -> Iterator[IO[str]]:
    if path == "-":
        yield sys.stdin
    else:
        with open(path, encoding="utf-8") as handle:
            yield handle


@contextmanager
def _open_output(path: str, output_format: str) -> Iterator[IO[bytes]]:
    if path == "-":
        yield sys.stdout.buffer
    else:
        with open(path, "wb") as handle:
            yield handle
