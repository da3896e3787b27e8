"""`score-worker produce-samples` against a real broker: the mix it sends, its pacing, its clean stop."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from worker_testkit import Names, read_topic

from models import Scorer, ScorerConfig
from schemas import ErrorCode, HiddenDType, ResultStatus, ScoreRequest, decode_request, header_request_id
from worker import sample_producer
from worker.cli import build_parser
from worker.cli import main as cli_main
from worker.config import SECURITY_ENV_VARS, WorkerSettings
from worker.topics import ensure_topics

ROOT = Path(__file__).resolve().parents[2]


def _create_topic(bootstrap: str, names: Names, model_dir: Path) -> None:
    # A real Kafka in compose refuses to auto-create topics; the producer must find the topic there.
    settings = WorkerSettings(
        bootstrap_servers=bootstrap,
        model_dir=model_dir,
        requests_topic=names.requests,
        results_topic=names.results,
        dlq_topic=names.dlq,
        topic_partitions=3,
    )
    asyncio.run(ensure_topics(settings))


def _decoded(bootstrap: str, topic: str, expected: int) -> list[ScoreRequest]:
    records = asyncio.run(read_topic(bootstrap, topic, expected, timeout_s=30, settle_s=0.5))
    requests = []
    for record in records:
        assert record.value is not None
        request = decode_request(record.value)
        assert record.key == request.request_id.encode()
        assert header_request_id(record.headers) == request.request_id
        requests.append(request)
    return requests


@pytest.mark.slow
def test_thirty_requests_arrive_with_the_mix_asked_for(kafka_bootstrap: str, tmp_path: Path) -> None:
    names = Names.unique("samples")
    _create_topic(kafka_bootstrap, names, tmp_path)
    heartbeat = tmp_path / "alive"
    started = time.monotonic()
    code = cli_main(
        [
            *("produce-samples", "--bootstrap-servers", kafka_bootstrap, "--topic", names.requests),
            *("--count", "30", "--rate", "200", "--seed", "7", "--hidden-fraction", "0.5"),
            *("--invalid-fraction", "0.1", "--heartbeat-file", str(heartbeat)),
        ]
    )
    elapsed = time.monotonic() - started
    assert code == 0
    assert heartbeat.is_file()
    # 30 requests at 200/s: 29 intervals of 5 ms, so at least 145 ms (the schedule never runs ahead).
    assert elapsed >= 0.145

    requests = _decoded(kafka_bootstrap, names.requests, 30)
    assert len(requests) == 30
    ids = [request.request_id for request in requests]
    assert len(set(ids)) == 30
    assert all(re.fullmatch(r"sample-[0-9a-f]{12}-\d+", request_id) for request_id in ids)

    hidden = [request for request in requests if request.return_pooled_hidden_states]
    assert len(hidden) == 15  # the fraction is spread exactly, not drawn at random
    assert Counter(request.hidden_states_dtype for request in hidden) == {
        HiddenDType.FLOAT32: 5,
        HiddenDType.FLOAT16: 5,
        HiddenDType.BFLOAT16: 5,
    }
    invalid = [request for request in requests if sample_producer.meant_to_fail(request)]
    assert len(invalid) == 3
    for request in invalid:
        prompts = [item for item in request.items if not isinstance(item, str)]
        assert any(not ids or sample_producer.OUT_OF_VOCABULARY_TOKEN in ids for ids in prompts)

    valid = [request for request in requests if not sample_producer.meant_to_fail(request)]
    assert {isinstance(request.items[0], str) for request in valid} == {True, False}  # text and token ids
    assert {request.query is None for request in valid} == {True, False}
    assert any(request.apply_softmax for request in requests)
    assert {len(request.items) for request in valid} <= {1, 2, 3, 4}
    assert len({len(request.items) for request in valid}) > 1


def test_the_worker_answers_exactly_the_invalid_samples_with_errors(tiny_llama_dir: Path) -> None:
    mix = sample_producer.SampleMix(hidden_fraction=0.5, invalid_fraction=0.1, seed=3)
    requests = [mix.request(n) for n in range(60)]
    results = Scorer(tiny_llama_dir, ScorerConfig(device="cpu")).score(requests)
    failing = {ErrorCode.TOKEN_ID_OUT_OF_RANGE: 0, ErrorCode.EMPTY_INPUT: 0}
    for request, result in zip(requests, results, strict=True):
        if sample_producer.meant_to_fail(request):
            assert result.status is ResultStatus.ERROR and result.error is not None
            failing[result.error.code] += 1
        else:
            assert result.status is ResultStatus.OK, result.error
            assert len(result.scores) == len(request.items)
            if request.return_pooled_hidden_states:
                assert result.pooled_hidden_states is not None
                assert {t.dtype for t in result.pooled_hidden_states} == {request.hidden_states_dtype.value}
    assert failing == {ErrorCode.TOKEN_ID_OUT_OF_RANGE: 3, ErrorCode.EMPTY_INPUT: 3}


@pytest.mark.slow
def test_sigterm_stops_cleanly_after_every_send_is_acknowledged(kafka_bootstrap: str, tmp_path: Path) -> None:
    names = Names.unique("samples-stop")
    _create_topic(kafka_bootstrap, names, tmp_path)
    heartbeat = tmp_path / "alive"
    env = {**os.environ, "SCORE_WORKER_BOOTSTRAP_SERVERS": kafka_bootstrap, "SCORE_SAMPLES_RATE": "40"}
    env["SCORE_WORKER_REQUESTS_TOPIC"] = names.requests
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker", "produce-samples", "--heartbeat-file", str(heartbeat)],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while not heartbeat.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert heartbeat.exists(), "no send was acknowledged"
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    summary = re.search(r"stopped after (\d+) requests: (\d+) acknowledged, 0 failed", stderr)
    assert summary, stderr
    sent, acknowledged = int(summary[1]), int(summary[2])
    assert sent == acknowledged > 0
    assert len(_decoded(kafka_bootstrap, names.requests, sent)) == sent
    assert "producing samples to" in stderr and stderr.count("\n") < 10  # no line per request


def test_environment_sets_the_defaults_of_every_variable_it_declares(monkeypatch: pytest.MonkeyPatch) -> None:
    values = {
        "SCORE_WORKER_BOOTSTRAP_SERVERS": ("bootstrap_servers", "kafka:19092", "kafka:19092"),
        "SCORE_WORKER_REQUESTS_TOPIC": ("topic", "req.topic", "req.topic"),
        "SCORE_SAMPLES_RATE": ("rate", "12.5", 12.5),
        "SCORE_SAMPLES_HIDDEN_FRACTION": ("hidden_fraction", "0.25", 0.25),
        "SCORE_SAMPLES_INVALID_FRACTION": ("invalid_fraction", "0.125", 0.125),
        "SCORE_SAMPLES_COMPRESSION": ("compression", "lz4", "lz4"),
    }
    # The security variables are read by every Kafka command alike (tests/worker/test_security.py).
    assert set(values) | set(SECURITY_ENV_VARS) == set(sample_producer.ENV_VARS)
    for name, (_, raw, _) in values.items():
        monkeypatch.setenv(name, raw)
    args = build_parser(["produce-samples"]).parse_args(["produce-samples"])
    for dest, _, expected in values.values():
        assert getattr(args, dest) == expected
    assert (args.count, str(args.heartbeat_file)) == (0, sample_producer.DEFAULT_HEARTBEAT_FILE)


@pytest.mark.parametrize(
    "flags",
    [["--rate", "0"], ["--hidden-fraction", "1.5"], ["--invalid-fraction", "-0.1"], ["--count", "-1"]],
)
def test_bad_flags_are_refused(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser(["produce-samples"]).parse_args(
            ["produce-samples", "--bootstrap-servers", "k:1", *flags]
        )
    assert exit_info.value.code == 2
    assert flags[0] in capsys.readouterr().err
