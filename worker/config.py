"""Worker settings: one frozen, validated object built at start-up from flags and SCORE_WORKER_* variables."""

from __future__ import annotations

import re
import socket
import ssl
from pathlib import Path
from typing import Annotated, Any, Literal, Self, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from models.settings import EngineSettings
from schemas import DLQ_TOPIC, REQUESTS_TOPIC, RESULTS_TOPIC
from worker.codecs import DEFAULT_COMPRESSION, Compression, missing_codecs

ENV_PREFIX = "SCORE_WORKER_"
SettingsT = TypeVar("SettingsT", bound=BaseSettings)

# Kafka's own rule for topic names (a longer name or another character is refused by the broker).
_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")


def is_topic_name(name: str) -> bool:
    """Whether Kafka takes `name` as a topic: 1 to 249 letters, digits, '.', '_' or '-', not . or .."""
    return _TOPIC_NAME.fullmatch(name) is not None and name not in {".", ".."}


def _topic_name(value: str) -> str:
    if not is_topic_name(value):
        raise ValueError(f"{value!r} is not a valid Kafka topic name (letters, digits, '.', '_', '-')")
    return value


def existing_file(value: Path | None) -> Path | None:
    """A settings validator: a path that is set must name a file."""
    if value is not None and not value.is_file():
        raise ValueError(f"file {str(value)!r} does not exist")
    return value


# A setting that names a topic: checked against Kafka's rule wherever it is read.
TopicName = Annotated[str, AfterValidator(_topic_name)]


_HOST_PORT = re.compile(r"^[^\s,:]+:\d{1,5}$")
_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")

# Flag names that differ from the field name (the issue asks for `--model DIR`).
FLAG_NAMES: dict[str, str] = {"model_dir": "--model"}


def flag_for(field: str) -> str:
    """The command-line flag that sets a settings field."""
    return FLAG_NAMES.get(field, "--" + field.replace("_", "-"))


class KafkaSecurity(BaseSettings):
    """How every Kafka client of the project reaches the brokers: TLS and SASL, from SCORE_WORKER_* variables.

    The worker's settings extend it; `submit`, `produce-samples` and `lag-exporter` read it alone. Secrets are
    SecretStr (masked in reprs) and validation errors never echo their input.
    """

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, hide_input_in_errors=True)

    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        default="PLAINTEXT", description="how to reach the brokers"
    )
    ssl_cafile: Path | None = Field(
        default=None,
        description="CA bundle (PEM) that the brokers' certificates must chain to (system CAs if unset)",
    )
    ssl_certfile: Path | None = Field(
        default=None, description="client certificate (PEM) for brokers that require one; needs ssl_keyfile"
    )
    ssl_keyfile: Path | None = Field(default=None, description="private key (PEM) of ssl_certfile")
    ssl_key_password: SecretStr | None = Field(
        default=None, description="password of an encrypted ssl_keyfile (environment only)"
    )
    ssl_check_hostname: bool = Field(
        default=True,
        description="check that the broker's certificate names the host dialled; turn off knowingly",
    )
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = Field(
        default="PLAIN", description="SASL mechanism"
    )
    sasl_username: str | None = Field(default=None, description="SASL user name")
    sasl_password: SecretStr | None = Field(default=None, description="SASL password (environment only)")

    _check_file = field_validator("ssl_cafile", "ssl_certfile", "ssl_keyfile")(existing_file)

    @model_validator(mode="after")
    def _check_security(self) -> KafkaSecurity:
        tls = self.security_protocol in ("SSL", "SASL_SSL")
        sasl = self.security_protocol.startswith("SASL")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError(
                "ssl_certfile and ssl_keyfile go together: set both (the client certificate and its private "
                "key) or neither"
            )
        # Settings that would be silently ignored leave the connection less protected than its owner thinks.
        unused = [name for name in _TLS_FIELDS if not tls and self._is_set(name)]
        unused += [name for name in _SASL_FIELDS if not sasl and self._is_set(name)]
        if unused:
            raise ValueError(
                f"{', '.join(unused)} set but security_protocol is {self.security_protocol}, which does not "
                f"use them; set {ENV_PREFIX}SECURITY_PROTOCOL to SSL, SASL_PLAINTEXT or SASL_SSL"
            )
        if sasl and (self.sasl_username is None or not self.sasl_password):
            raise ValueError(
                f"security_protocol {self.security_protocol} needs sasl_username and sasl_password "
                f"(set {ENV_PREFIX}SASL_USERNAME and {ENV_PREFIX}SASL_PASSWORD)"
            )
        if tls:
            self.ssl_context()  # a CA, certificate or key that cannot be used fails here, at start-up
        return self

    def _is_set(self, name: str) -> bool:
        default = type(self).model_fields[name].default
        return bool(getattr(self, name) != default)

    def ssl_context(self) -> ssl.SSLContext:
        """The TLS context of SSL and SASL_SSL: the CA, the client certificate when given, hostname checks."""
        cafile = str(self.ssl_cafile) if self.ssl_cafile else None
        try:
            context = ssl.create_default_context(cafile=cafile)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"cannot read CA certificates from ssl_cafile {cafile!r}: {exc}") from None
        context.check_hostname = self.ssl_check_hostname
        if self.ssl_certfile is not None and self.ssl_keyfile is not None:
            self._load_client_certificate(context, self.ssl_certfile, self.ssl_keyfile)
        return context

    def _load_client_certificate(self, context: ssl.SSLContext, certfile: Path, keyfile: Path) -> None:
        def no_password() -> str:
            # Without a callback OpenSSL would prompt on the terminal, which hangs a service.
            raise ValueError(
                f"the private key {str(keyfile)!r} is encrypted: set {ENV_PREFIX}SSL_KEY_PASSWORD"
            )

        password = self.ssl_key_password.get_secret_value() if self.ssl_key_password else no_password
        try:
            context.load_cert_chain(certfile, keyfile, password=password)
        except (ssl.SSLError, OSError) as exc:
            # OpenSSL's reasons here are terse ("PEM lib"); the usual causes are worth naming.
            raise ValueError(
                f"cannot load the client certificate {str(certfile)!r} with the key {str(keyfile)!r} "
                f"({exc}): a wrong ssl_key_password, a key that does not belong to the certificate, or a "
                "file that is not PEM"
            ) from None

    def kafka_security_kwargs(self) -> dict[str, Any]:
        """aiokafka's security arguments (protocol, TLS context, SASL credentials), alike for every client."""
        kwargs: dict[str, Any] = {"security_protocol": self.security_protocol}
        if self.security_protocol in ("SSL", "SASL_SSL"):
            kwargs["ssl_context"] = self.ssl_context()
        if self.security_protocol.startswith("SASL"):
            kwargs["sasl_mechanism"] = self.sasl_mechanism
            kwargs["sasl_plain_username"] = self.sasl_username
            kwargs["sasl_plain_password"] = (
                self.sasl_password.get_secret_value() if self.sasl_password else None
            )
        return kwargs


# The variables KafkaSecurity reads: every command that connects to Kafka honours them.
SECURITY_ENV_VARS = tuple(f"{ENV_PREFIX}{name.upper()}" for name in KafkaSecurity.model_fields)
_TLS_FIELDS = ("ssl_cafile", "ssl_certfile", "ssl_keyfile", "ssl_key_password", "ssl_check_hostname")
_SASL_FIELDS = ("sasl_mechanism", "sasl_username", "sasl_password")


class KafkaSettings(BaseModel):
    """Where the worker reads and writes, and how it takes part in its consumer group."""

    bootstrap_servers: str = Field(description="Kafka bootstrap servers, HOST:PORT[,HOST:PORT...]")
    requests_topic: TopicName = Field(REQUESTS_TOPIC, description="topic the requests are read from")
    results_topic: TopicName = Field(RESULTS_TOPIC, description="topic the results are written to")
    dlq_topic: TopicName = Field(DLQ_TOPIC, description="dead-letter topic for undecodable requests")
    reply_topic_pattern: str = Field(
        re.escape(RESULTS_TOPIC) + r"\..+",
        description="reply topics a request may name in its kafka_replyTopic header (a regular expression "
        "the whole name must match); others get REPLY_TOPIC_NOT_ALLOWED on the results topic; '' allows none",
    )
    group_id: str = Field("score-worker", min_length=1, description="consumer group of the workers")
    client_id: str = Field("score-worker", min_length=1, description="Kafka client id (shows in broker logs)")
    group_instance_id: str | None = Field(
        None,
        min_length=1,
        max_length=249,
        description="static group membership: a restart within the session timeout keeps the partitions "
        "without a rebalance (unique per worker)",
    )
    auto_offset_reset: Literal["earliest", "latest"] = Field(
        "earliest", description="where a new consumer group starts"
    )
    session_timeout_ms: int = Field(10_000, gt=0, description="consumer group session timeout")
    heartbeat_interval_ms: int = Field(3_000, gt=0, description="consumer heartbeat interval")
    max_poll_interval_ms: int = Field(300_000, gt=0, description="longest gap between polls")
    commit_interval_ms: int = Field(1_000, gt=0, description="how often finished offsets are committed")
    # Kafka answers a fetch as soon as a record arrives; some brokers do not (Tansu looks again part-way
    # through the wait: a record produced during a 100 ms wait is read about 25 ms later, at most about
    # 50), so a long wait delays requests that arrive during it (aiokafka's default is 500).
    fetch_max_wait_ms: int = Field(
        100, ge=0, le=10_000, description="longest the broker may hold a fetch that finds no new records"
    )
    create_topics: bool = Field(True, description="create missing topics at start-up")
    topic_partitions: int = Field(4, gt=0, description="partitions of topics this worker creates")
    topic_replication_factor: int = Field(1, gt=0, description="replication factor of created topics")

    @field_validator("bootstrap_servers")
    @classmethod
    def _check_bootstrap(cls, value: str) -> str:
        servers = [s.strip() for s in value.split(",") if s.strip()]
        bad = [s for s in servers if not _HOST_PORT.match(s)]
        if not servers or bad:
            raise ValueError(f"expected HOST:PORT[,HOST:PORT...], got {value!r}")
        return ",".join(servers)

    @field_validator("reply_topic_pattern")
    @classmethod
    def _check_reply_pattern(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as error:
            raise ValueError(f"{value!r} is not a regular expression: {error}") from None
        return value

    @model_validator(mode="after")
    def _check_group(self) -> Self:
        if self.heartbeat_interval_ms >= self.session_timeout_ms:
            raise ValueError(
                f"heartbeat_interval_ms ({self.heartbeat_interval_ms}) must be lower than "
                f"session_timeout_ms ({self.session_timeout_ms}); a third of it is usual"
            )
        topics = [self.requests_topic, self.results_topic, self.dlq_topic]
        if len(set(topics)) != len(topics):
            raise ValueError(f"requests, results and DLQ topics must differ, got {topics}")
        return self


class DeliverySettings(BaseModel):
    """How answers are published and acknowledged: records, codecs, producers, transactions."""

    publish_timeout_ms: int = Field(
        120_000,
        gt=0,
        description="how long a result that the broker does not acknowledge is retried before the worker "
        "stops (uncommitted, so it is redelivered)",
    )
    # A batch's results are handed to the producer in one go, so lingering for more only delays them
    # (by the whole linger at one request in flight); Kafka's Java producer lingers 5 ms to batch callers
    # that send one record at a time.
    publish_linger_ms: int = Field(
        0, ge=0, le=1000, description="how long the producer holds results to send more of them together"
    )
    results_compression: Compression = Field(
        DEFAULT_COMPRESSION,
        description="compression codec of the result and dead-letter batches the worker writes (readers "
        "need nothing to choose: every Kafka client reads every codec)",
    )
    idempotence: Literal["auto", "on", "off"] = Field(
        "auto",
        description="idempotent producer for results and dead letters (no duplicate from a producer's own "
        "retry after a lost acknowledgement, order kept across a leader change); auto: on where the broker "
        "grants producer ids (Apache Kafka), off where it does not (the embedded broker), said in the log",
    )
    delivery: Literal["at-least-once", "exactly-once"] = Field(
        "at-least-once",
        description="at-least-once: results published, then offsets committed (a worker's crash can answer "
        "a request twice); exactly-once: results, dead letters and the consumed offsets written in one "
        "Kafka transaction per requests partition, so readers with isolation.level=read_committed see each "
        "answer once (needs a broker with transactions: Apache Kafka, not the embedded broker)",
    )
    transactional_id_prefix: str | None = Field(
        None,
        description="exactly-once: transactional ids are <prefix>.<topic>.<partition>, one per requests "
        "partition (a new owner of a partition fences the old one); default score-worker.<group_id>. "
        "Groups reading the same topic need different prefixes",
    )
    transaction_timeout_ms: int = Field(
        60_000,
        ge=1000,
        description="exactly-once: the broker aborts a transaction left open this long (a worker that died "
        "mid-transaction); a new owner of the partition aborts it at once",
    )
    # The floor leaves room for the largest error result and dead-letter reason (256-character request ids,
    # 1000-byte messages, 249-character topics): those must always fit, or one record stops the worker.
    max_record_bytes: int = Field(
        1_048_576, ge=4096, description="largest result record; larger results become RESULT_TOO_LARGE"
    )
    undecodable_skip_after_ms: int = Field(
        0,
        ge=0,
        description="a partition whose records cannot be read (a codec library missing, a corrupt batch) "
        "stops at the first such offset and is retried with backoff; after this long still unreadable, its "
        "batch is skipped: the offset range goes to the dead-letter topic (UNDECODABLE_RECORDS) and reading "
        "goes on after it. 0: never skip, hold the partition until it reads",
    )

    @field_validator("results_compression")
    @classmethod
    def _check_compression(cls, value: str) -> str:
        if value in missing_codecs():
            raise ValueError(
                f"{value} needs the cramjam package, which this installation lacks: install score-worker "
                "with its declared dependencies, or choose gzip or none"
            )
        return value

    @model_validator(mode="after")
    def _check_delivery(self) -> Self:
        if self.delivery == "exactly-once" and self.idempotence == "off":
            raise ValueError(
                "exactly-once delivery needs an idempotent producer; leave idempotence on or auto"
            )
        return self

    @property
    def exactly_once(self) -> bool:
        return self.delivery == "exactly-once"


class BatchingSettings(BaseModel):
    """How fetched requests become model batches, and how many may wait (the token budget itself is the
    engine's max_batch_tokens)."""

    max_batch_requests: int = Field(64, gt=0, description="most requests in one model batch")
    # While the model runs, arriving requests fill the next batch whatever this is; it only decides whether
    # a request that finds the model idle waits for company. Waiting there adds its whole length to the
    # latency of a lone request and gains little: what arrives during the forward joins the next batch.
    max_wait_ms: int = Field(
        0,
        ge=0,
        le=60_000,
        description="how long a request that finds the model idle waits for more to batch with; 0 starts it "
        "at once (requests arriving while the model runs fill the next batch either way)",
    )
    model_queue_depth: int = Field(
        2,
        ge=1,
        le=8,
        description="model batches handed to the model thread at once: the running one and closed batches "
        "queued behind it, which then start as it ends instead of after an event-loop turn; 1 hands each "
        "batch over only once the last one has ended",
    )
    intake_processes: int | None = Field(
        None,
        ge=0,
        le=64,
        description="processes that decode and tokenise fetched requests while the model runs, so that work "
        "does not hold the interpreter lock the model thread's kernel launches need; 0: on the worker's own "
        "thread; default 2 when the model runs on a GPU, 0 on the CPU (where the model's threads want the "
        "cores)",
    )
    max_inflight_requests: int = Field(
        1024, gt=0, description="fetched but unpublished requests above which fetching pauses"
    )
    gc_freeze: bool = Field(
        True,
        description="at start, move the objects alive then (the model, its libraries) out of the garbage "
        "collector's scans: each full collection otherwise pauses every thread for a tenth of a second",
    )
    torch_threads: int = Field(
        0,
        ge=0,
        description="CPU threads torch may use; 0: OMP_NUM_THREADS where set, else every CPU this "
        "process may run on (CUDA: 2)",
    )


class LimitSettings(BaseModel):
    """Time bounds: every wait the worker can get stuck in has one, and requests may expire."""

    default_ttl_ms: int = Field(
        0,
        ge=0,
        description="time-to-live of requests that set no deadline, from their record timestamp; 0: none",
    )
    # Time bounds: every wait the worker can get stuck in has one.
    watchdog_ms: int = Field(
        120_000,
        ge=0,
        description="a model call running longer than this (and watchdog_multiple times its expected time) "
        "stops the worker uncommitted; 0 turns the watchdog off",
    )
    watchdog_multiple: float = Field(
        20.0,
        ge=1.0,
        description="how many times its expected time (from recent batches) a model call may run",
    )
    drain_timeout_ms: int = Field(
        30_000, gt=0, description="longest a stop (SIGTERM) waits for in-flight requests before exiting"
    )
    revocation_timeout_ms: int = Field(
        30_000, gt=0, description="longest a rebalance waits for in-flight requests of revoked partitions"
    )
    commit_timeout_ms: int = Field(10_000, gt=0, description="longest one offset commit may take")


class ModelSettings(BaseModel):
    """The model a worker serves and its start-up checks; how the engine runs it is EngineSettings."""

    model_dir: Path = Field(description="local HuggingFace model directory")
    self_check: bool = Field(
        True,
        description="score a fixed input packed and through HF's own forward at start-up; refuse to start "
        "when they disagree",
    )
    warm_up: bool = Field(
        True,
        description="before joining the group, score one small batch of each kind the compiled layers "
        "compile a graph for (and, on a GPU, one at the full token budget), so no request waits for a "
        "compilation",
    )

    @field_validator("model_dir")
    @classmethod
    def _check_model_dir(cls, value: Path) -> Path:
        if not value.is_dir():
            raise ValueError(
                f"directory {str(value)!r} does not exist; pass a local HuggingFace model directory"
            )
        return value


class ObservabilitySettings(BaseModel):
    """How the worker is seen: its name, /metrics, /healthz and /readyz."""

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
    metrics_fd: int | None = Field(
        None, ge=0, description="a listening socket this process inherited, served in place of binding "
        "metrics_host:metrics_port (the host's supervisor hands one to each worker process, bound before the "
        "process starts, so no other program can take its port in between)",
    )  # fmt: skip
    broker_probe_interval_ms: int = Field(
        5_000, ge=100, le=300_000, description="how often readiness asks the brokers for metadata"
    )


_GPU_LIST = re.compile(r"^\d+(,\d+)*,?$")  # a list; "3," is GPU 3 alone


class HostSettings(BaseModel):
    """How many worker processes one host runs: one per GPU under a supervisor, or one (the default)."""

    gpus: str = Field(
        "",
        description="'' runs one worker process on `device`; 'all', a count or a list such as '0,2,3' "
        "runs one worker process per GPU ('3,' is GPU 3 alone; with device cpu, a count of CPU processes) "
        "under a supervisor that restarts them and serves one /metrics, /healthz and /readyz for the host",
    )
    restart_limit: int = Field(
        5, ge=0, description="restarts of one worker process within restart_window_s after which the host "
        "worker stops them all and exits non-zero",
    )  # fmt: skip
    restart_window_s: float = Field(600.0, gt=0, description="the window restart_limit counts restarts in")
    restart_backoff_ms: int = Field(
        1_000, ge=0, description="wait before the first restart of a worker process; doubles with each "
        "restart in the window, up to 60 s",
    )  # fmt: skip

    @field_validator("gpus")
    @classmethod
    def _check_gpus(cls, value: str) -> str:
        value = value.replace(" ", "")
        if value in ("", "all"):
            return value
        if value.isdigit():
            if int(value) == 0:
                raise ValueError("a count of 0 GPUs runs nothing; leave gpus empty for one process")
            return value
        if not _GPU_LIST.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a GPU choice: use '', 'all', a count (4) or a list (0,2,3; one GPU: 3,)"
            )
        listed = [index for index in value.split(",") if index]
        if len(set(map(int, listed))) != len(listed):
            raise ValueError(f"{value!r} names a GPU twice")
        return value


class WorkerSettings(
    KafkaSettings,
    DeliverySettings,
    BatchingSettings,
    LimitSettings,
    ModelSettings,
    EngineSettings,
    ObservabilitySettings,
    HostSettings,
    KafkaSecurity,
):
    """Everything `score-worker run` needs, in groups (SETTINGS_GROUPS), built once and immutable. Each
    field is read from SCORE_WORKER_<NAME> or the flag of its name; the engine's fields are EngineSettings'
    own (models/config.py), embedded here, not copied."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="forbid")

    @property
    def engine(self) -> EngineSettings:
        """The engine's settings alone (what ScorerConfig.of takes)."""
        return EngineSettings(**self.engine_settings())

    def transactional_id(self, tp_topic: str, partition: int) -> str:
        """The transactional id of the producer that answers one requests partition."""
        prefix = self.transactional_id_prefix or f"score-worker.{self.group_id}"
        return f"{prefix}.{tp_topic}.{partition}"

    def kafka_client_kwargs(self) -> dict[str, Any]:
        """Connection arguments shared by aiokafka's consumer, producer and admin client."""
        return {
            "bootstrap_servers": self.bootstrap_servers,
            "client_id": self.client_id,
            **self.kafka_security_kwargs(),
        }


# The groups of WorkerSettings, in the order `score-worker run --help` shows them.
SETTINGS_GROUPS: tuple[tuple[str, type[BaseModel]], ...] = (
    ("Kafka", KafkaSettings),
    ("delivery", DeliverySettings),
    ("batching", BatchingSettings),
    ("limits and time bounds", LimitSettings),
    ("model", ModelSettings),
    ("engine", EngineSettings),
    ("observability", ObservabilitySettings),
    ("host: processes and GPUs", HostSettings),
    ("security (TLS and SASL)", KafkaSecurity),
)


class ClientEnvironment(BaseSettings):
    """What the commands besides `run` (submit, lag-exporter, produce-samples) take from SCORE_WORKER_*
    variables as the defaults of their flags: the names and rules a worker reads, read by the same library.
    Each command reads it once, when its flags are defined (read_environment)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="ignore")

    bootstrap_servers: str | None = Field(None, description="Kafka bootstrap servers, HOST:PORT[,...]")
    requests_topic: TopicName = Field(REQUESTS_TOPIC, description="topic the requests are sent to")
    results_topic: TopicName = Field(RESULTS_TOPIC, description="topic the results are read from")
    max_record_bytes: int = Field(1_048_576, ge=1, description="largest request record to send")
    requests_compression: Compression = Field(DEFAULT_COMPRESSION, description="codec of request batches")


def read_environment(settings: type[SettingsT], command: str) -> SettingsT:
    """`settings` read from the environment; a variable that breaks its rule exits with one line per
    variable (status 2), before anything runs."""
    try:
        return settings()
    except ValidationError as error:
        prefix = str(settings.model_config.get("env_prefix", ""))
        lines = describe_validation_error(error, flags=False, prefix=prefix)
        who = " ".join(filter(None, ("score-worker", command)))
        raise SystemExit(f"{who}: invalid environment\n{lines}") from None


def environment_variables(settings: type[BaseSettings]) -> tuple[str, ...]:
    """The variables `settings` reads, by name."""
    prefix = str(settings.model_config.get("env_prefix", ""))
    return tuple(f"{prefix}{name.upper()}" for name in settings.model_fields)


def is_secret(field: str) -> bool:
    """Whether a settings field is a secret: environment only, never a flag, never printed."""
    info = WorkerSettings.model_fields.get(field)
    return info is not None and info.annotation in (SecretStr, SecretStr | None)


def security_from_environment() -> KafkaSecurity:
    """The security settings alone, from SCORE_WORKER_* variables, for the commands other than `run`.

    Raises ValueError with one line per bad setting (naming its variable; these commands have no such flags).
    """
    try:
        return KafkaSecurity()
    except ValidationError as error:
        lines = describe_validation_error(error, flags=False)
        raise ValueError(f"invalid security settings\n{lines}") from None


def describe_validation_error(error: ValidationError, flags: bool = True, prefix: str = ENV_PREFIX) -> str:
    """One line per invalid field, naming the flag and the environment variable that set it."""
    lines = []
    for item in error.errors():
        field = str(item["loc"][0]) if item["loc"] else ""
        message = str(item["msg"]).removeprefix("Value error, ")
        if item["type"] == "missing":
            message = "required"
        if field:
            env = f"{prefix}{field.upper()}"
            where = env if is_secret(field) or not flags else f"{flag_for(field)} / {env}"
            lines.append(f"{field} ({where}): {message}")
        else:
            lines.append(message)
    return "\n".join(lines)
