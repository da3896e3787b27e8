"""WorkerSettings: defaults, environment vs flags, and the one-line-per-field messages the CLI prints."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from worker.cli import main
from worker.config import WorkerSettings, describe_validation_error


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("SCORE_WORKER_"):
            monkeypatch.delenv(name)


def test_defaults_and_frozen(tmp_path: Path) -> None:
    settings = WorkerSettings(bootstrap_servers="localhost:9092", model_dir=tmp_path)
    assert settings.requests_topic == "score.requests"
    assert settings.results_topic == "score.results"
    assert settings.dlq_topic == "score.requests.dlq"
    assert settings.group_id == "score-worker"
    assert settings.auto_offset_reset == "earliest"
    assert settings.create_topics is True
    with pytest.raises(ValidationError):
        settings.group_id = "other"  # type: ignore[misc]


def test_environment_is_read_and_init_values_win(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCORE_WORKER_BOOTSTRAP_SERVERS", "a:1, b:2")
    monkeypatch.setenv("SCORE_WORKER_MODEL_DIR", str(tmp_path))
    monkeypatch.setenv("SCORE_WORKER_MAX_WAIT_MS", "7")
    monkeypatch.setenv("SCORE_WORKER_CREATE_TOPICS", "false")
    settings = WorkerSettings()  # type: ignore[call-arg]
    assert settings.bootstrap_servers == "a:1,b:2"
    assert settings.max_wait_ms == 7 and settings.create_topics is False
    assert WorkerSettings(max_wait_ms=9).max_wait_ms == 9  # type: ignore[call-arg]


def _message(**values: object) -> str:
    with pytest.raises(ValidationError) as info:
        WorkerSettings(**values)  # type: ignore[arg-type]
    return describe_validation_error(info.value)


def test_messages_name_the_field_its_flag_and_its_variable(tmp_path: Path) -> None:
    text = _message(
        bootstrap_servers="nohost",
        model_dir=tmp_path / "missing",
        max_batch_tokens=0,
        dtype="float64",
    )
    lines = text.splitlines()
    assert len(lines) == 4, text
    assert any(
        line.startswith(
            "bootstrap_servers (--bootstrap-servers / SCORE_WORKER_BOOTSTRAP_SERVERS): expected HOST:PORT"
        )
        for line in lines
    )
    assert any(line.startswith("model_dir (--model / SCORE_WORKER_MODEL_DIR): directory") for line in lines)
    assert any("does not exist" in line for line in lines)
    assert any(
        line.startswith("max_batch_tokens (--max-batch-tokens") and "greater than 0" in line for line in lines
    )
    assert any(line.startswith("dtype (--dtype") for line in lines)


def test_missing_required_fields_are_listed() -> None:
    lines = _message().splitlines()
    assert sorted(lines) == [
        "bootstrap_servers (--bootstrap-servers / SCORE_WORKER_BOOTSTRAP_SERVERS): required",
        "model_dir (--model / SCORE_WORKER_MODEL_DIR): required",
    ]


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (
            {"heartbeat_interval_ms": 3000, "session_timeout_ms": 3000},
            "must be lower than session_timeout_ms",
        ),
        ({"results_topic": "score.requests"}, "topics must differ"),
        ({"requests_topic": "bad topic"}, "not a valid Kafka topic name"),
        ({"device": "tpu"}, "not a device"),
        ({"security_protocol": "SASL_SSL"}, "needs sasl_username and sasl_password"),
    ],
)
def test_cross_field_and_format_rules(tmp_path: Path, values: dict[str, object], expected: str) -> None:
    text = _message(bootstrap_servers="h:1", model_dir=tmp_path, **values)
    assert expected in text and len(text.splitlines()) == 1, text


def test_sasl_settings_reach_the_client_and_the_password_stays_hidden(tmp_path: Path) -> None:
    settings = WorkerSettings(
        bootstrap_servers="h:1",
        model_dir=tmp_path,
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism="SCRAM-SHA-256",
        sasl_username="svc",
        sasl_password="s3cret",  # type: ignore[arg-type]
    )
    kwargs = settings.kafka_client_kwargs()
    assert kwargs["sasl_mechanism"] == "SCRAM-SHA-256"
    assert kwargs["sasl_plain_username"] == "svc" and kwargs["sasl_plain_password"] == "s3cret"
    assert "s3cret" not in repr(settings)
    plain = WorkerSettings(bootstrap_servers="h:1", model_dir=tmp_path).kafka_client_kwargs()
    assert "sasl_plain_password" not in plain and "ssl_context" not in plain


def test_cli_prints_one_line_per_field_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["run", "--model", str(tmp_path / "nope"), "--bootstrap-servers", "x", "--max-wait-ms", "-1"])
    assert code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "score-worker run: invalid settings"
    assert len(err) == 4
    assert {line.split(" ", 1)[0] for line in err[1:]} == {"model_dir", "bootstrap_servers", "max_wait_ms"}
