"""Worker settings: one frozen, validated object built at start-up from flags and SCORE_WORKER_* variables."""

from __future__ import annotations

import re
import socket
import ssl
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "SCORE_WORKER_"

# Kafka's own rule for topic names (a longer name or another character is refused by the broker).
_TOPIC_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_HOST_PORT = re.compile(r"^[^\s,:]+:\d{1,5}$")
_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")

# Flag names that differ from the field name (the issue asks for `--model DIR`).
FLAG_NAMES: dict[str, str] = {"model_dir": "--model"}


def flag_for(field: str) -> str:
    """The command-line flag that sets a settings field."""
    return FLAG_NAMES.get(field, "--" + field.replace("_", "-"))


class WorkerSettings(BaseSettings):
    """Everything `score-worker run` needs; immutable once built."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="forbid")

    bootstrap_servers: str = Field(description="Kafka bootstrap servers, HOST:PORT[,HOST:PORT...]")
    model_dir: Path = Field(description="local HuggingFace model directory")
    requests_topic: str = Field("score.requests", description="topic the requests are read from")
    results_topic: str = Field("score.results", description="topic the results are written to")
    dlq_topic: str = Field("score.requests.dlq", description="dead-letter topic for undecodable requests")
    group_id: str = Field("score-worker", min_length=1, description="consumer group of the workers")
    client_id: str = Field("score-worker", min_length=1, description="Kafka client id (shows in broker logs)")
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field("auto", description="model dtype")
    pooling: Literal["auto", "last", "last_token", "cls", "mean"] = Field(
        "auto", description="how an item's tokens become its pooled state; auto: what the model's head pools"
    )
    self_check: bool = Field(
        True,
        description="score a fixed input packed and through HF's own forward at start-up; refuse to start "
        "when they disagree",
    )
    deterministic: bool = Field(
        False,
        description="bit-identical results whatever shares a request's batch (each item runs alone: slower)",
    )
    trust_remote_code: bool = Field(
        False, description="load a model directory that ships its own code (runs that code: opt in knowingly)"
    )
    max_batch_tokens: int = Field(8192, gt=0, description="token budget of one model batch")
    max_batch_requests: int = Field(64, gt=0, description="most requests in one model batch")
    max_wait_ms: int = Field(5, ge=0, le=60_000, description="longest wait after a batch's first request")
    max_inflight_requests: int = Field(
        1024, gt=0, description="fetched but unpublished requests above which fetching pauses"
    )
    auto_offset_reset: Literal["earliest", "latest"] = Field(
        "earliest", description="where a new consumer group starts"
    )
    session_timeout_ms: int = Field(10_000, gt=0, description="consumer group session timeout")
    heartbeat_interval_ms: int = Field(3_000, gt=0, description="consumer heartbeat interval")
    max_poll_interval_ms: int = Field(300_000, gt=0, description="longest gap between polls")
    commit_interval_ms: int = Field(1_000, gt=0, description="how often finished offsets are committed")
    # Kafka answers a fetch as soon as a record arrives; some brokers (Tansu) hold an empty fetch for the
    # whole wait, so a long wait delays requests that arrive during it (aiokafka's default is 500).
    fetch_max_wait_ms: int = Field(
        100, ge=0, le=10_000, description="longest the broker may hold a fetch that finds no new records"
    )
    # The floor leaves room for the largest error result and dead-letter reason (256-character request ids,
    # 1000-byte messages, 249-character topics): those must always fit, or one record stops the worker.
    max_record_bytes: int = Field(
        1_048_576, ge=4096, description="largest result record; larger results become RESULT_TOO_LARGE"
    )
    create_topics: bool = Field(True, description="create missing topics at start-up")
    topic_partitions: int = Field(4, gt=0, description="partitions of topics this worker creates")
    topic_replication_factor: int = Field(1, gt=0, description="replication factor of created topics")
    worker_id: str = Field(
        default_factory=socket.gethostname,
        min_length=1,
        max_length=128,
        description="this worker's name in metrics and logs (default: the host name)",
    )
    metrics_port: int = Field(
        9464, ge=0, le=65535, description="port of /metrics, /healthz and /readyz; 0 turns them off"
    )
    metrics_host: str = Field("0.0.0.0", min_length=1, description="address the metrics port listens on")
    broker_probe_interval_ms: int = Field(
        5_000, ge=100, le=300_000, description="how often readiness asks the brokers for metadata"
    )
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="how to reach the brokers"
    )
    ssl_cafile: Path | None = Field(None, description="CA bundle for SSL / SASL_SSL (system CAs if unset)")
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = Field(
        "PLAIN", description="SASL mechanism"
    )
    sasl_username: str | None = Field(None, description="SASL user name")
    # A secret string: never printed in logs, reprs or validation errors.
    sasl_password: SecretStr | None = Field(None, description="SASL password (environment only)")

    @field_validator("bootstrap_servers")
    @classmethod
    def _check_bootstrap(cls, value: str) -> str:
        servers = [s.strip() for s in value.split(",") if s.strip()]
        bad = [s for s in servers if not _HOST_PORT.match(s)]
        if not servers or bad:
            raise ValueError(f"expected HOST:PORT[,HOST:PORT...], got {value!r}")
        return ",".join(servers)

    @field_validator("model_dir")
    @classmethod
    def _check_model_dir(cls, value: Path) -> Path:
        if not value.is_dir():
            raise ValueError(
                f"directory {str(value)!r} does not exist; pass a local HuggingFace model directory"
            )
        return value

    @field_validator("requests_topic", "results_topic", "dlq_topic")
    @classmethod
    def _check_topic(cls, value: str) -> str:
        if not _TOPIC_NAME.match(value) or value in {".", ".."}:
            raise ValueError(f"{value!r} is not a valid Kafka topic name (letters, digits, '.', '_', '-')")
        return value

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not _DEVICE.match(value):
            raise ValueError(f"{value!r} is not a device; use auto, cpu, cuda or cuda:N")
        return value

    @model_validator(mode="after")
    def _check_together(self) -> WorkerSettings:
        if self.heartbeat_interval_ms >= self.session_timeout_ms:
            raise ValueError(
                f"heartbeat_interval_ms ({self.heartbeat_interval_ms}) must be lower than "
                f"session_timeout_ms ({self.session_timeout_ms}); a third of it is usual"
            )
        topics = [self.requests_topic, self.results_topic, self.dlq_topic]
        if len(set(topics)) != len(topics):
            raise ValueError(f"requests, results and DLQ topics must differ, got {topics}")
        if self.security_protocol.startswith("SASL") and (
            self.sasl_username is None or not self.sasl_password
        ):
            raise ValueError(
                f"security_protocol {self.security_protocol} needs sasl_username and sasl_password "
                f"(set {ENV_PREFIX}SASL_USERNAME and {ENV_PREFIX}SASL_PASSWORD)"
            )
        return self

    def kafka_client_kwargs(self) -> dict[str, Any]:
        """Connection arguments shared by aiokafka's consumer, producer and admin client."""
        kwargs: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers,
            "client_id": self.client_id,
            "security_protocol": self.security_protocol,
        }
        if self.security_protocol in ("SSL", "SASL_SSL"):
            cafile = str(self.ssl_cafile) if self.ssl_cafile else None
            kwargs["ssl_context"] = ssl.create_default_context(cafile=cafile)
        if self.security_protocol.startswith("SASL"):
            kwargs["sasl_mechanism"] = self.sasl_mechanism
            kwargs["sasl_plain_username"] = self.sasl_username
            kwargs["sasl_plain_password"] = (
                self.sasl_password.get_secret_value() if self.sasl_password else None
            )
        return kwargs


def describe_validation_error(error: ValidationError) -> str:
    """One line per invalid field, naming the flag and the environment variable that set it."""
    lines = []
    for item in error.errors():
        field = str(item["loc"][0]) if item["loc"] else ""
        message = str(item["msg"]).removeprefix("Value error, ")
        if item["type"] == "missing":
            message = "required"
        if field:
            where = f"{flag_for(field)} / {ENV_PREFIX}{field.upper()}"
            lines.append(f"{field} ({where}): {message}")
        else:
            lines.append(message)
    return "\n".join(lines)
