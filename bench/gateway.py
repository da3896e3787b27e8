"""The HTTP gateway's cost beside ScoreClient, measured in the same run on one broker
(embedded, or Apache Kafka with --broker kafka).

(a) One call in flight: a real worker (`score-worker run`, a tiny Llama on the CPU) answers calls made
    alternately through ScoreClient and through a `score-worker gateway` process (POST /v1/score on one
    keep-alive HTTP/1.1 connection); p50/p95 of each and their difference. Goal: at most 2 ms more p50.
(b) Throughput with the model step excluded: in place of the worker, a stub process reads the requests topic
    and answers every request at once with scores computed from its token ids (no model, no batching);
    what is left is the broker, the gateway and the client. A driver process of its own (so that its CPU is
    not the gateway's) keeps many calls in flight, first through ScoreClient, then through as many
    keep-alive connections to the gateway; calls/s of each and their ratio. Goal: one gateway process
    sustains 2,000 calls/s of one small item each.

Every timed call is checked: answered (200, or an OK result), and its scores equal to ScoreClient's for the
same request (a): within the bound of two float32 forwards; (b): exactly, the stub's own values. A run
where a check fails exits 1; a goal not met is reported, not a failure.

    python3 bench/gateway.py            # about a minute on a 2-core machine
    python3 bench/gateway.py --quick    # a few seconds of each phase (the test suite's smoke run)
    python3 bench/gateway.py --broker kafka  # Apache Kafka from its jars: it answers a waiting fetch at once

To see where the gateway's CPU goes, sample its process during (b) with py-spy (the dev extra):
`py-spy record --pid <the gateway's pid> --duration 8 --format raw -o gateway.raw`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import add_options, argument_parser, report_header, report_path, stop_process, write_verdict
from bench.w2_load import latency_summary
from worker.apache_kafka import start_local_broker
from worker.broker import free_port

GOAL_EXTRA_P50_MS = 2.0
GOAL_CALLS_PER_S = 2000.0
TOPICS = {"worker": ("gwb.requests", "gwb.results"), "stub": ("gwb.stub.requests", "gwb.stub.results")}
VOCAB = 500  # token ids 1..499: inside the tiny model's vocabulary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argument_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="a few seconds of each phase")
    parser.add_argument("--pairs", type=int, help="calls of phase (a) through each path (default 300)")
    parser.add_argument("--seconds", type=float, help="seconds of each throughput run (default 10)")
    parser.add_argument("--connections", type=int, default=64, help="calls in flight in phase (b)")
    add_options(parser, "gateway", broker="embedded")
    # Internal: the stub and the driver are this script run again in processes of their own.
    parser.add_argument("--stub", nargs=2, metavar=("BOOTSTRAP", "REQUESTS_TOPIC"), help=argparse.SUPPRESS)
    parser.add_argument("--drive", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.pairs = args.pairs or (40 if args.quick else 300)
    args.seconds = args.seconds or (2.0 if args.quick else 10.0)
    return args


def stub_score(item: Sequence[int]) -> float:
    """The stub's score of one item: a function of its token ids that the check can recompute."""
    return (sum(item) % 9973) / 9973.0


def small_item(index: int, tokens: int = 16) -> list[int]:
    """The index-th small item: `tokens` token ids that differ from one call to the next."""
    return [1 + (index * 7 + position * 13) % (VOCAB - 1) for position in range(tokens)]


# --- the stub: the worker's place in phase (b), with no model --------------------------------------------


async def run_stub(bootstrap: str, requests_topic: str) -> None:
    """Answer every request on `requests_topic` at once (to its reply topic, else the results topic)."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    from bench.w2_load import assign_whole_topic
    from schemas import ResultStatus, ScoreResult, decode_request, encode_result, result_headers
    from schemas.headers import HEADER_REPLY_TOPIC, header_value

    results_topic = TOPICS["stub"][1]
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False, fetch_max_wait_ms=2
    )
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks=1, linger_ms=1)
    await consumer.start()
    await producer.start()
    tps = await assign_whole_topic(consumer, requests_topic)
    await consumer.seek_to_end(*tps)
    print("stub ready", flush=True)
    while True:
        batches = await consumer.getmany(timeout_ms=500)
        for records in batches.values():
            for record in records:
                request = decode_request(bytes(record.value or b""))
                scores = tuple((stub_score(item),) for item in request.items)  # type: ignore[arg-type]
                result = ScoreResult(request.request_id, ResultStatus.OK, scores)
                reply = header_value(record.headers, HEADER_REPLY_TOPIC)
                topic = reply.decode() if reply else results_topic
                await producer.send(
                    topic, encode_result(result), key=record.key, headers=result_headers(request.request_id)
                )


# --- a raw keep-alive HTTP/1.1 client: the least client CPU per call -------------------------------------


class Connection:
    """One keep-alive HTTP/1.1 connection, one call at a time on it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self._reader, self._writer, self._host = reader, writer, host

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer, f"{host}:{port}")

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self._host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        self._writer.write(head.encode() + body)
        lines = (await self._reader.readuntil(b"\r\n\r\n")).split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return status, await self._reader.readexactly(length)

    def close(self) -> None:
        self._writer.close()


def score_body(item: Sequence[int]) -> bytes:
    return json.dumps({"items": [list(item)]}).encode()


def gateway_scores(status: int, payload: bytes) -> list[list[float]] | None:
    """The scores of a 200 answer of /v1/score; None for any other answer."""
    if status != 200:
        return None
    return json.loads(payload)["scores"]  # type: ignore[no-any-return]


# --- the driver of phase (b), in a process of its own -----------------------------------------------------


async def drive(config: dict[str, Any]) -> dict[str, Any]:
    """ScoreClient with `connections` calls in flight for `seconds`, then the gateway on as many
    keep-alive connections for as long: calls/s of each and what every call was answered."""
    from schemas import ResultStatus, ScoreRequest
    from worker.client import ScoreClient, new_request_id

    seconds, width = config["seconds"], config["connections"]
    report: dict[str, Any] = {}
    async with ScoreClient(
        config["bootstrap"], requests_topic=config["requests"], results_topic=config["results"],
        reply_topic=config["results"] + ".driver",
    ) as client:  # fmt: skip
        wrong: list[str] = []

        async def direct_loop(lane: int, until: float, counts: list[int]) -> None:
            index = lane
            while time.monotonic() < until:
                item = small_item(index)
                request = ScoreRequest(request_id=new_request_id(), items=(tuple(item),))
                (result,) = await client.score([request], timeout=30)
                if result.status is not ResultStatus.OK or result.scores != ((stub_score(item),),):
                    wrong.append(f"ScoreClient {index}: {result}")
                counts[lane] += 1
                index += width

        report["client"] = await timed(direct_loop, width, 0.5, seconds)
        report["client"]["wrong"] = wrong[:5]
        report["client"]["wrong_count"] = len(wrong)

    connections = [await Connection.open("127.0.0.1", config["port"]) for _ in range(width)]
    statuses: Counter[int] = Counter()
    wrong_http: list[str] = []

    async def http_loop(lane: int, until: float, counts: list[int]) -> None:
        index = lane
        while time.monotonic() < until:
            item = small_item(index)
            status, payload = await connections[lane].post("/v1/score", score_body(item))
            statuses[status] += 1
            if gateway_scores(status, payload) != [[stub_score(item)]]:
                wrong_http.append(f"gateway {index}: {status} {payload[:200]!r}")
            counts[lane] += 1
            index += width

    cpu = process_cpu_s(config["pid"])
    report["gateway"] = await timed(http_loop, width, 0.5, seconds)
    report["gateway"]["gateway_cpu_s"] = process_cpu_s(config["pid"]) - cpu
    report["gateway"].update(statuses={str(k): v for k, v in statuses.items()}, wrong=wrong_http[:5])
    report["gateway"]["wrong_count"] = len(wrong_http)
    for connection in connections:
        connection.close()
    return report


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user and system) a process has used so far, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def timed(loop: Any, width: int, warm_s: float, seconds: float) -> dict[str, Any]:
    """`width` lanes of `loop` for a warm-up and then `seconds`; calls/s over the timed part only (the
    calls finished in it), every lane's calls awaited to the end (each is checked)."""
    warm = [0] * width
    await asyncio.gather(*(loop(lane, time.monotonic() + warm_s, warm) for lane in range(width)))
    counts = [0] * width
    started = time.monotonic()
    await asyncio.gather(*(loop(lane, started + seconds, counts) for lane in range(width)))
    elapsed = time.monotonic() - started
    return {"calls": sum(counts), "seconds": elapsed, "calls_per_s": sum(counts) / elapsed}


# --- phase (a), in this process ---------------------------------------------------------------------------


async def one_in_flight(bootstrap: str, port: int, pairs: int) -> dict[str, Any]:
    """`pairs` calls through each path, alternating which goes first; each call alone in flight."""
    from schemas import ResultStatus, ScoreRequest
    from worker.client import ScoreClient, new_request_id

    requests_topic, results_topic = TOPICS["worker"]
    times: dict[str, list[float]] = {"client": [], "gateway": []}
    answers: dict[str, list[Any]] = {"client": [], "gateway": []}
    items = [small_item(i) for i in range(pairs + 10)]
    connection = await Connection.open("127.0.0.1", port)
    async with ScoreClient(bootstrap, requests_topic=requests_topic, results_topic=results_topic) as client:

        async def via_client(item: list[int]) -> Any:
            request = ScoreRequest(request_id=new_request_id(), items=(tuple(item),))
            (result,) = await client.score([request], timeout=30)
            return [list(row) for row in result.scores] if result.status is ResultStatus.OK else None

        async def via_gateway(item: list[int]) -> Any:
            return gateway_scores(*await connection.post("/v1/score", score_body(item)))

        paths = {"client": via_client, "gateway": via_gateway}
        for index, item in enumerate(items):
            order = ("client", "gateway") if index % 2 else ("gateway", "client")
            for name in order:
                started = time.perf_counter()
                answer = await paths[name](item)
                elapsed = time.perf_counter() - started
                if index >= 10:  # the first ten of each: warm-up
                    times[name].append(elapsed)
                    answers[name].append(answer)
    connection.close()
    report: dict[str, Any] = {name: latency_summary(values) for name, values in times.items()}
    for name, values in times.items():
        report[name]["p95_ms"] = float(np.percentile(np.asarray(values) * 1000, 95))
    report["extra_p50_ms"] = report["gateway"]["p50_ms"] - report["client"]["p50_ms"]
    # Each gateway call beside the ScoreClient call of the same pair: less noise from the shared machine.
    paired = np.asarray(times["gateway"]) - np.asarray(times["client"])
    report["paired_extra_p50_ms"] = float(np.median(paired) * 1000)
    report["extra_p95_ms"] = report["gateway"]["p95_ms"] - report["client"]["p95_ms"]
    report["check"] = compare_forwards(answers["client"], answers["gateway"])
    return report


def compare_forwards(direct: Sequence[Any], gateway: Sequence[Any]) -> dict[str, Any]:
    """Each gateway score against ScoreClient's for the same item, which must be equal: one call in flight,
    each item is alone in its batch, so both are the same float32 forward of the same worker on the same
    machine (the same arithmetic in the same order), and the gateway's JSON carries float64 exactly."""
    missing = sum(answer is None for answer in [*direct, *gateway])
    if missing:
        return {"ok": False, "unanswered": missing}
    a, b = np.asarray(direct, dtype=np.float64), np.asarray(gateway, dtype=np.float64)
    diff = float(np.abs(a - b).max())
    return {"ok": bool(a.shape == b.shape and diff == 0.0), "max_abs_diff": diff, "calls": len(direct)}


# --- the processes: worker, stub, gateway, driver ----------------------------------------------------------


def child_env(settings: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCORE_WORKER_")}
    env.update({f"SCORE_WORKER_{name}": value for name, value in settings.items()})
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    return env


@contextmanager
def process(command: list[str], env: dict[str, str], log: Path) -> Any:
    """A child process, stopped by SIGTERM (then killed) when the block ends."""
    with open(log, "wb") as out:
        child = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield child
    finally:
        stop_process(child, 30)


def wait_for(url: str, child: subprocess.Popen[bytes], log: Path, timeout_s: float = 120.0) -> None:
    """Until `url` answers 200; the child's log in the error when it exits or never does."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise RuntimeError(f"{child.args!r} exited with {child.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer 200 in {timeout_s:.0f} s: {log.read_text()[-2000:]}")


def start_gateway(
    stack: ExitStack, bootstrap: str, topics: tuple[str, str], workdir: Path
) -> tuple[int, int]:
    """A `score-worker gateway` process on `topics`, once it has seen a worker (or the stub) answer."""
    port = free_port()
    settings = {
        "BOOTSTRAP_SERVERS": bootstrap, "REQUESTS_TOPIC": topics[0], "RESULTS_TOPIC": topics[1],
        "GATEWAY_HOST": "127.0.0.1", "GATEWAY_PORT": str(port), "GATEWAY_PROBE_INTERVAL_S": "0.5",
        "GATEWAY_MAX_CALLS": "4096", "LOG_FORMAT": "json",
    }  # fmt: skip
    log = workdir / f"gateway-{topics[0]}.log"
    child = stack.enter_context(
        process([sys.executable, "-m", "worker", "gateway"], child_env(settings), log)
    )
    wait_for(f"http://127.0.0.1:{port}/health", child, log)
    return port, child.pid


def start_worker(stack: ExitStack, bootstrap: str, model_dir: Path, workdir: Path) -> None:
    """`score-worker run` of the tiny model on the CPU, answering the gateway's reply topic too."""
    port = free_port()
    requests_topic, results_topic = TOPICS["worker"]
    settings = {
        "BOOTSTRAP_SERVERS": bootstrap, "MODEL_DIR": str(model_dir), "GROUP_ID": "gwb",
        "REQUESTS_TOPIC": requests_topic, "RESULTS_TOPIC": results_topic, "DLQ_TOPIC": "gwb.dlq",
        "DEVICE": "cpu", "DTYPE": "float32", "METRICS_PORT": str(port), "METRICS_HOST": "127.0.0.1",
        "SELF_CHECK": "false", "WARM_UP": "false", "WORKER_ID": "gwb", "LOG_FORMAT": "json",
        # The embedded broker looks for new records only part-way through a fetch's wait: a short one
        # keeps the worker's share of the latency (common to both paths) from drowning the difference.
        "FETCH_MAX_WAIT_MS": "5",
        "REPLY_TOPIC_PATTERN": r"gwb\.results\..+",
    }  # fmt: skip
    log = workdir / "worker.log"
    child = stack.enter_context(process([sys.executable, "-m", "worker", "run"], child_env(settings), log))
    wait_for(f"http://127.0.0.1:{port}/readyz", child, log)


def start_stub(stack: ExitStack, bootstrap: str, workdir: Path) -> None:
    log = workdir / "stub.log"
    command = [sys.executable, __file__, "--stub", bootstrap, TOPICS["stub"][0]]
    child = stack.enter_context(process(command, child_env({}), log))
    deadline = time.monotonic() + 60
    while b"stub ready" not in log.read_bytes():
        if child.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the stub did not start: {log.read_text()[-2000:]}")
        time.sleep(0.1)


def run_driver(config: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    command = [sys.executable, __file__, "--drive", json.dumps(config)]
    done = subprocess.run(command, env=child_env({}), capture_output=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the driver failed: {done.stderr.decode()[-3000:]}")
    return json.loads(done.stdout.decode().strip().splitlines()[-1])  # type: ignore[no-any-return]


async def make_topics(bootstrap: str) -> None:
    from worker.topics import create_missing_topics

    names = [name for pair in TOPICS.values() for name in pair] + ["gwb.dlq"]
    await create_missing_topics({"bootstrap_servers": bootstrap}, names, 1, 1)


def verdict(report: dict[str, Any]) -> list[str]:
    """The checks of what was timed: every call answered, every score as it should be."""
    failures = []
    latency = report["one_in_flight"]
    if not latency["check"]["ok"]:
        failures.append(f"one in flight: the gateway's scores differ from ScoreClient's: {latency['check']}")
    for name in ("client", "gateway"):
        run = report["throughput"][name]
        if run["wrong_count"]:
            failures.append(
                f"throughput via {name}: {run['wrong_count']} calls answered wrong: {run['wrong']}"
            )
        if not run["calls"]:
            failures.append(f"throughput via {name}: no call answered")
    statuses = report["throughput"]["gateway"]["statuses"]
    if set(statuses) - {"200"}:
        failures.append(f"throughput via the gateway: statuses other than 200: {statuses}")
    return failures


def goals(report: dict[str, Any]) -> dict[str, Any]:
    extra = report["one_in_flight"]["extra_p50_ms"]
    rate = report["throughput"]["gateway"]["calls_per_s"]
    return {
        "extra_p50_ms": {"value": extra, "goal": GOAL_EXTRA_P50_MS, "met": extra <= GOAL_EXTRA_P50_MS},
        "gateway_calls_per_s": {"value": rate, "goal": GOAL_CALLS_PER_S, "met": rate >= GOAL_CALLS_PER_S},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.stub:
        asyncio.run(run_stub(*args.stub))
        return 0
    if args.drive:
        print(json.dumps(asyncio.run(drive(json.loads(args.drive)))))
        return 0
    from models import write_tiny_model

    report: dict[str, Any] = {**report_header(args), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        broker = stack.enter_context(start_local_broker(args.broker))
        bootstrap = broker.bootstrap_servers
        asyncio.run(make_topics(bootstrap))
        model_dir = write_tiny_model(workdir / "llama", "llama", seed=0)
        with ExitStack() as phase:
            start_worker(phase, bootstrap, model_dir, workdir)
            port, _ = start_gateway(phase, bootstrap, TOPICS["worker"], workdir)
            report["one_in_flight"] = asyncio.run(one_in_flight(bootstrap, port, args.pairs))
        with ExitStack() as phase:
            start_stub(phase, bootstrap, workdir)
            port, pid = start_gateway(phase, bootstrap, TOPICS["stub"], workdir)
            requests_topic, results_topic = TOPICS["stub"]
            config = {"bootstrap": bootstrap, "requests": requests_topic, "results": results_topic,
                      "port": port, "pid": pid, "seconds": args.seconds,
                      "connections": args.connections}  # fmt: skip
            report["throughput"] = run_driver(config, timeout_s=4 * args.seconds + 120)
    through = report["throughput"]
    through["gateway_to_client"] = through["gateway"]["calls_per_s"] / through["client"]["calls_per_s"]
    gateway = through["gateway"]
    # What one gateway process would sustain with a core of its own: calls per CPU second it used. The
    # timed window's CPU includes the warm-up's last calls' completion, so this errs low.
    gateway["calls_per_gateway_cpu_s"] = gateway["calls"] / max(gateway["gateway_cpu_s"], 1e-9)
    report["goals"] = goals(report)
    print_summary(report)
    return write_verdict(report, verdict(report), report_path("gateway", args.json, args.quick), "gateway")


def print_summary(report: dict[str, Any]) -> None:
    one, through = report["one_in_flight"], report["throughput"]
    for name in ("client", "gateway"):
        print(
            f"one in flight via {name:8}: p50 {one[name]['p50_ms']:.2f} ms  p95 {one[name]['p95_ms']:.2f} ms"
        )
    print(
        f"gateway adds: p50 {one['extra_p50_ms']:+.2f} ms  p95 {one['extra_p95_ms']:+.2f} ms  "
        f"median of pairs {one['paired_extra_p50_ms']:+.2f} ms"
    )
    for name in ("client", "gateway"):
        print(
            f"throughput via {name:8}: {through[name]['calls_per_s']:.0f} calls/s ({through[name]['calls']})"
        )
    print(f"gateway / ScoreClient: {through['gateway_to_client']:.2f}")
    gateway = through["gateway"]
    print(
        f"gateway process: {gateway['gateway_cpu_s']:.2f} CPU s for {gateway['calls']} calls: "
        f"{gateway['calls_per_gateway_cpu_s']:.0f} calls per CPU second"
    )
    for name, goal in report["goals"].items():
        print(
            f"goal {name}: {goal['value']:.2f} against {goal['goal']}: {'met' if goal['met'] else 'NOT met'}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
