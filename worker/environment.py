"""What a score-worker process takes from its environment besides WorkerSettings: how it logs, how many
threads torch's CPU kernels get, where Apache Kafka's pom, jars and Java are. Read once, with the same
library and rules as the settings (worker/config.py); the code below the command line is handed the
values."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from worker.config import ENV_PREFIX, ClientEnvironment, TopicName, WorkerSettings, existing_file


class ProcessEnvironment(BaseSettings):
    """Every command's logging, and the thread count the worker's model takes unless its settings say."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="ignore")

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="log verbosity, the --log-level flag's default"
    )
    log_format: Literal["text", "json"] = Field(
        "text", description="text lines or one JSON object per line, the --log-format flag's default"
    )
    log_tag: str = Field("", description="which of a host's worker processes logs (set by the supervisor)")
    # As torch reads it: a positive count, else torch's own choice (OpenMP also takes lists like "4,2").
    omp_num_threads: str = Field("", validation_alias="OMP_NUM_THREADS")

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _any_case(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        return value.upper() if value.lower() in ("debug", "info", "warning", "error") else value.lower()

    @property
    def omp_threads(self) -> int | None:
        """OMP_NUM_THREADS where it sets one positive count, else None."""
        text = self.omp_num_threads.strip()
        return int(text) if text.isdigit() and int(text) > 0 else None


class KafkaEnvironment(BaseSettings):
    """Where Apache Kafka's Maven project and its resolved jars are, and which Java runs it
    (worker/apache_kafka)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="ignore")

    kafka_pom: Path | None = Field(None, description="the Maven project naming the Kafka versions")
    kafka_cache: Path | None = Field(
        None, description="where resolved jars are kept (default ~/.cache/score-worker/kafka)"
    )
    xdg_cache_home: Path | None = Field(None, validation_alias="XDG_CACHE_HOME")
    java_home: Path | None = Field(None, validation_alias="JAVA_HOME")

    @field_validator("kafka_pom", "kafka_cache", "xdg_cache_home", "java_home", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        return None if value == "" else value

    @property
    def cache_root(self) -> Path:
        if self.kafka_cache is not None:
            return self.kafka_cache
        return (self.xdg_cache_home or Path.home() / ".cache") / "score-worker" / "kafka"


class GatewaySettings(ClientEnvironment):
    """`score-worker gateway`: where the HTTP front door listens, who may call it, and its bounds. The Kafka
    side (bootstrap servers, topics, record size, codec) is the client's (ClientEnvironment); TLS and SASL
    towards the brokers are KafkaSecurity's, read by the command like every other client command."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, frozen=True, extra="ignore", hide_input_in_errors=True
    )

    gateway_host: str = Field("0.0.0.0", min_length=1, description="address the gateway listens on")
    gateway_port: int = Field(8080, ge=0, le=65535, description="HTTP port (0: any free port)")
    gateway_reply_topic: TopicName | None = Field(
        None,
        description="the topic this gateway reads its results from (default <results_topic>.gw-<host>-<pid>, "
        "which the workers' default reply_topic_pattern allows); one per gateway process",
    )
    gateway_api_keys: SecretStr | None = Field(
        None, description="comma-separated Bearer API keys a call must present (environment only)"
    )
    gateway_api_keys_file: Path | None = Field(
        None, description="file of Bearer API keys, one per line (# starts a comment)"
    )
    gateway_max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1, description="largest request body accepted (413 above it)"
    )
    gateway_max_items: int = Field(4096, ge=1, description="most items (inputs, documents) in one call (413)")
    gateway_max_calls: int = Field(
        1024,
        ge=1,
        description="most calls in flight at once (read, waiting on Kafka, answered); more get 429",
    )
    gateway_timeout_s: float = Field(
        60.0, gt=0, description="longest a call waits for its result (504 after); a client may ask for less"
    )
    gateway_probe_interval_s: float = Field(
        5.0, gt=0, description="how often, while no result arrives, the gateway asks whether a worker answers"
    )
    gateway_model_name: str = Field(
        "", description="the model name /v1/models and answers show (default: the name the workers report)"
    )
    gateway_labels: str = Field(
        "", description="comma-separated label names by class index for /classify (default LABEL_<index>)"
    )
    gateway_ssl_certfile: Path | None = Field(None, description="TLS certificate (PEM) of the HTTP side")
    gateway_ssl_keyfile: Path | None = Field(None, description="private key (PEM) of gateway_ssl_certfile")

    @field_validator("gateway_api_keys_file", "gateway_ssl_certfile", "gateway_ssl_keyfile", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        return None if value == "" else value

    _check_file = field_validator("gateway_api_keys_file", "gateway_ssl_certfile", "gateway_ssl_keyfile")(
        existing_file
    )

    def api_keys(self) -> frozenset[str]:
        """Every key a call may present: the variable's and the file's; empty means no key is asked for."""
        keys = set()
        if self.gateway_api_keys is not None:
            keys |= {key.strip() for key in self.gateway_api_keys.get_secret_value().split(",")}
        if self.gateway_api_keys_file is not None:
            lines = self.gateway_api_keys_file.read_text(encoding="utf-8").splitlines()
            keys |= {line.strip() for line in lines if not line.lstrip().startswith("#")}
        return frozenset(key for key in keys if key)


# SCORE_WORKER_* names that are no WorkerSettings field: the ones above, the dev script's and the tests'.
OTHER_VARIABLES = frozenset(
    {name.upper() for name in ProcessEnvironment.model_fields if name != "omp_num_threads"}
    | {name.upper() for name in GatewaySettings.model_fields if name.startswith("gateway_")}
    | {name.upper() for name in KafkaEnvironment.model_fields if name.startswith("kafka_")}
    | {"VENV", "TEST_BOOTSTRAP", "TEST_BROKER", "TEST_PROCESSES", "TEST_KAFKA_VERSION"}
)


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """SCORE_WORKER_* variables (of `environ`, default this process's) that name no setting."""
    known = {name.upper() for name in WorkerSettings.model_fields} | OTHER_VARIABLES
    given = os.environ if environ is None else environ
    return sorted(
        name for name in given if name.startswith(ENV_PREFIX) and name[len(ENV_PREFIX) :] not in known
    )
