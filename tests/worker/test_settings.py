"""WorkerSettings: defaults, environment vs flags, and the one-line-per-field messages the CLI prints."""

from __future__ import annotations

import os
import ssl
from pathlib import Path

import pytest
from pydantic import ValidationError
from secure_proxy import Pki

from worker.cli import main
from worker.config import KafkaSecurity, WorkerSettings, describe_validation_error, security_from_environment


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


# --- Kafka security: client certificates, hostname checks, settings that go together, hidden secrets


def test_client_certificate_and_hostname_check_reach_the_ssl_context(tmp_path: Path, pki: Pki) -> None:
    kwargs = WorkerSettings(bootstrap_servers="h:1", model_dir=tmp_path, **pki.mtls()).kafka_client_kwargs()  # type: ignore[arg-type]
    context = kwargs["ssl_context"]
    assert kwargs["security_protocol"] == "SSL" and "sasl_mechanism" not in kwargs
    assert context.check_hostname and context.verify_mode == ssl.CERT_REQUIRED
    trusted = [dict(pair for rdn in cert["subject"] for pair in rdn) for cert in context.get_ca_certs()]
    assert trusted == [{"commonName": "score-worker test ca"}]  # the CA file only, not the system's
    relaxed = KafkaSecurity(**pki.mtls(ssl_check_hostname=False)).kafka_security_kwargs()  # type: ignore[arg-type]
    # Only the name check goes: the certificate chain is still verified.
    assert not relaxed["ssl_context"].check_hostname
    assert relaxed["ssl_context"].verify_mode == ssl.CERT_REQUIRED


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"ssl_keyfile": None, "ssl_key_password": None}, "ssl_certfile and ssl_keyfile go together"),
        ({"ssl_certfile": None}, "ssl_certfile and ssl_keyfile go together"),
        ({"ssl_certfile": Path("/no/such/cert.pem")}, "file '/no/such/cert.pem' does not exist"),
        ({"ssl_key_password": None}, "is encrypted: set SCORE_WORKER_SSL_KEY_PASSWORD"),
        ({"ssl_key_password": "not-the-password"}, "cannot load the client certificate"),
        ({"security_protocol": "PLAINTEXT"}, "ssl_cafile, ssl_certfile, ssl_keyfile, ssl_key_password set"),
        ({"sasl_username": "svc"}, "sasl_username set but security_protocol is SSL"),
    ],
)
def test_security_settings_that_cannot_work_are_one_clear_line(
    pki: Pki, changes: dict[str, object], expected: str
) -> None:
    with pytest.raises(ValidationError) as info:
        KafkaSecurity(**pki.mtls(**changes))  # type: ignore[arg-type]
    text = describe_validation_error(info.value)
    assert expected in text and len(text.splitlines()) == 1, text
    assert "not-the-password" not in text and pki.client_key_password not in text


def test_a_ca_file_that_holds_no_certificate_is_named(pki: Pki) -> None:
    with pytest.raises(ValidationError, match="cannot read CA certificates from ssl_cafile"):
        KafkaSecurity(**pki.mtls(ssl_cafile=pki.client_key))  # type: ignore[arg-type]


def test_secrets_never_appear_in_reprs_or_validation_errors(tmp_path: Path, pki: Pki) -> None:
    values = {**pki.mtls(security_protocol="SASL_SSL"), "sasl_password": "s3cret-sasl"}
    settings = WorkerSettings(bootstrap_servers="h:1", model_dir=tmp_path, sasl_username="svc", **values)  # type: ignore[arg-type]
    assert "s3cret-sasl" not in repr(settings) and pki.client_key_password not in repr(settings)
    # A whole-model error used to echo the raw input, passwords included, in str(ValidationError).
    with pytest.raises(ValidationError) as info:
        WorkerSettings(bootstrap_servers="h:1", model_dir=tmp_path, **values)  # type: ignore[arg-type]
    assert "needs sasl_username and sasl_password" in str(info.value)
    for shown in (str(info.value), repr(info.value), describe_validation_error(info.value)):
        assert "s3cret-sasl" not in shown and pki.client_key_password not in shown
    with pytest.raises(ValidationError) as info:
        WorkerSettings(bootstrap_servers="h:1", model_dir=tmp_path, sasl_password=["s3cret-sasl"])  # type: ignore[arg-type]
    assert "s3cret-sasl" not in str(info.value)
    # Secrets have no flag, so their message names only the variable.
    assert describe_validation_error(info.value).startswith("sasl_password (SCORE_WORKER_SASL_PASSWORD): ")


def test_other_commands_read_the_security_settings_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, pki: Pki
) -> None:
    monkeypatch.setenv("SCORE_WORKER_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("SCORE_WORKER_SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("SCORE_WORKER_SASL_USERNAME", "svc")
    monkeypatch.setenv("SCORE_WORKER_SASL_PASSWORD", "s3cret-sasl")
    monkeypatch.setenv("SCORE_WORKER_SSL_CAFILE", str(pki.ca))
    monkeypatch.setenv("SCORE_WORKER_MAX_WAIT_MS", "3")  # a worker setting: not theirs, and no error
    kwargs = security_from_environment().kafka_security_kwargs()
    assert kwargs["sasl_plain_password"] == "s3cret-sasl" and kwargs["sasl_mechanism"] == "SCRAM-SHA-512"
    assert isinstance(kwargs["ssl_context"], ssl.SSLContext)
    monkeypatch.setenv("SCORE_WORKER_SSL_CERTFILE", str(pki.client_cert))
    with pytest.raises(ValueError, match="invalid security settings") as info:
        security_from_environment()
    assert "--" not in str(info.value)  # these commands have no security flags: the message names none
    assert "s3cret-sasl" not in str(info.value)


def test_every_setting_is_in_one_group_and_the_engine_fields_are_the_engines_own() -> None:
    """`score-worker run --help` lists the settings by group: each field in exactly one, none left out.
    The engine's fields are declared once, in models/settings.py: the worker's are the same fields (same
    meaning, bounds and default), not copies that could drift apart."""
    from models import EngineSettings
    from worker.config import SETTINGS_GROUPS

    grouped = [name for _, group in SETTINGS_GROUPS for name in group.model_fields]
    assert sorted(grouped) == sorted(WorkerSettings.model_fields)
    assert len(grouped) == len(set(grouped))
    for name, field in EngineSettings.model_fields.items():
        mine = WorkerSettings.model_fields[name]
        assert (mine.annotation, mine.default, mine.description, mine.metadata) == (
            field.annotation, field.default, field.description, field.metadata,
        )  # fmt: skip


def test_the_other_commands_read_their_defaults_through_the_settings_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """submit, lag-exporter and produce-samples take SCORE_WORKER_* (and their own) variables through
    pydantic-settings, validated like the worker's: a bad one is one clear line and exit status 2."""
    monkeypatch.setenv("SCORE_WORKER_REQUESTS_TOPIC", "their.requests")
    monkeypatch.setenv("SCORE_WORKER_BOOTSTRAP_SERVERS", "127.0.0.1:9")
    import argparse

    from worker import lag_exporter, sample_producer, submit

    for module in (submit, lag_exporter, sample_producer):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        args = parser.parse_args(["--input", "-"] if module is submit else [])
        assert args.bootstrap_servers == "127.0.0.1:9"
        topic = args.default_topic if module is lag_exporter else getattr(args, "requests_topic", None)
        assert (topic or args.topic) == "their.requests"
    monkeypatch.setenv("SCORE_WORKER_MAX_RECORD_BYTES", "lots")
    with pytest.raises(SystemExit) as exit_submit:
        submit.add_arguments(argparse.ArgumentParser())
    assert "max_record_bytes (SCORE_WORKER_MAX_RECORD_BYTES)" in str(exit_submit.value.code)
    monkeypatch.delenv("SCORE_WORKER_MAX_RECORD_BYTES")
    monkeypatch.setenv("SCORE_SAMPLES_RATE", "-1")
    with pytest.raises(SystemExit) as exit_samples:
        sample_producer.add_arguments(argparse.ArgumentParser())
    assert "rate (SCORE_SAMPLES_RATE)" in str(exit_samples.value.code)
