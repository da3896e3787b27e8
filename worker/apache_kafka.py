"""Apache Kafka from its jars, without Docker: one combined-mode KRaft node or a cluster of several.

The test suite, the benchmarks and `./dev.sh kafka` (worker/kafka_command.py) start brokers through this
module. The jars come from the Maven project `deploy/kafka/pom.xml`, resolved once per Kafka version into a
cache outside the repository (`$SCORE_WORKER_KAFKA_CACHE`, default `~/.cache/score-worker/kafka`); a later
start resolves nothing. A broker is `java -cp <jars> kafka.Kafka server.properties` after
`kafka.tools.StorageTool format`, each node in a directory of its own holding its configuration, its data
and its log (`server.log`).

Needs Java 17 or newer (`$JAVA_HOME/bin/java` or `java` on PATH) and, for the first resolution of a
version, Maven (`mvn`). Without them `KafkaUnavailable` says what is missing.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import logging
import re
import shutil
import signal
import struct
import subprocess
import tempfile
import time
import uuid
import weakref
import xml.etree.ElementTree as ElementTree
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from worker import kafka_classes
from worker.broker import EmbeddedBroker, free_port, metadata_brokers
from worker.environment import KafkaEnvironment
from worker.errors import BrokerError
from worker.lifetime import release, watch

log = logging.getLogger(__name__)

MIN_JAVA = 17
_POM_NAMESPACE = {"m": "http://maven.apache.org/POM/4.0.0"}


class KafkaUnavailable(BrokerError):
    """Apache Kafka cannot be run here: no Java, no Maven for a first resolution, or no pom."""


def repository_pom(environment: KafkaEnvironment | None = None) -> Path:
    """The Maven project naming the Kafka versions: $SCORE_WORKER_KAFKA_POM or the repository's own."""
    configured = (environment or KafkaEnvironment()).kafka_pom
    pom = configured or Path(__file__).resolve().parent.parent / "deploy/kafka/pom.xml"
    if not pom.is_file():
        raise KafkaUnavailable(
            f"no Maven project for Apache Kafka at {pom}: run from a clone of the repository or set "
            "SCORE_WORKER_KAFKA_POM"
        )
    return pom


def pom_versions(pom: Path | None = None) -> dict[str, str]:
    """The pom's Kafka versions: {"newest": kafka.version, "compose": kafka.compose.version}."""
    root = ElementTree.parse(pom or repository_pom()).getroot()
    properties = root.find("m:properties", _POM_NAMESPACE)
    if properties is None:
        raise KafkaUnavailable("the Kafka pom has no <properties>")

    def value(name: str) -> str:
        element = properties.find(f"m:{name}", _POM_NAMESPACE)
        if element is None or not (element.text or "").strip():
            raise KafkaUnavailable(f"the Kafka pom names no {name}")
        return (element.text or "").strip()

    return {"newest": value("kafka.version"), "compose": value("kafka.compose.version")}


def find_java(environment: KafkaEnvironment | None = None) -> str:
    """A Java launcher of at least MIN_JAVA: $JAVA_HOME's, else the one on PATH."""
    home = (environment or KafkaEnvironment()).java_home
    candidates = [str(home / "bin" / "java")] if home else []
    on_path = shutil.which("java")
    if on_path:
        candidates.append(on_path)
    found = []
    for java in candidates:
        version = java_version(java)
        if version is not None and version >= MIN_JAVA:
            return java
        found.append(f"{java} (version {version})")
    raise KafkaUnavailable(
        f"Apache Kafka needs Java {MIN_JAVA} or newer; found {', '.join(found) or 'no java'} "
        "(Debian: apt-get install default-jre-headless, or set JAVA_HOME)"
    )


def java_version(java: str) -> int | None:
    """The feature release of a Java launcher (17 for "17.0.15", 8 for "1.8.0"), None if it does not run."""
    try:
        done = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r'version "(\d+)(?:\.(\d+))?', done.stderr + done.stdout)
    if not match:
        return None
    major = int(match[1])
    return int(match[2] or 0) if major == 1 else major


def _logging_profile(version: str) -> str:
    """The pom profile adding the slf4j binding this Kafka logs through (log4j2 from 4.0, reload4j before)."""
    return "log4j2" if int(version.split(".")[0]) >= 4 else "reload4j"


def resolve_jars(version: str, pom: Path | None = None, environment: KafkaEnvironment | None = None) -> Path:
    """The directory of the jars of Kafka `version`, resolved with Maven on first use and cached.

    The cache entry records the pom's digest: a changed pom resolves again. Concurrent callers (parallel
    test processes) wait on a file lock rather than resolving twice.
    """
    environment = environment or KafkaEnvironment()
    pom = pom or repository_pom(environment)
    digest = hashlib.sha256(pom.read_bytes()).hexdigest()[:16]
    entry = environment.cache_root / version
    libs, stamp = entry / "libs", entry / "resolved"
    entry.mkdir(parents=True, exist_ok=True)
    with open(entry / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists() and stamp.read_text().strip() == digest and any(libs.glob("kafka_*.jar")):
            return libs
        mvn = shutil.which("mvn")
        if mvn is None:
            raise KafkaUnavailable(
                f"Kafka {version}'s jars are not in {entry} and resolving them needs Maven "
                "(Debian: apt-get install maven)"
            )
        scratch = Path(tempfile.mkdtemp(prefix="libs-", dir=entry))
        command = [
            mvn, "-q", "-B", "-f", str(pom), f"-P{_logging_profile(version)}", f"-Dkafka.version={version}",
            "dependency:copy-dependencies", "-DincludeScope=runtime", f"-DoutputDirectory={scratch}",
        ]  # fmt: skip
        log.info("resolving Apache Kafka %s's jars into %s (Maven)", version, libs)
        started = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            shutil.rmtree(scratch, ignore_errors=True)
            raise KafkaUnavailable(
                f"Maven could not resolve Apache Kafka {version} ({' '.join(command)}): "
                f"{(done.stdout + done.stderr)[-2000:]}"
            )
        shutil.rmtree(libs, ignore_errors=True)
        scratch.rename(libs)
        stamp.write_text(digest + "\n")
        log.info(
            "resolved Kafka %s: %d jars in %.0f s",
            version,
            len(list(libs.glob("*.jar"))),
            time.monotonic() - started,
        )
        return libs


def class_archive(
    version: str, java: str, libs: Path, environment: KafkaEnvironment | None = None
) -> Path | None:
    """The class archive of Kafka `version` on `java` (worker/kafka_classes.py), recorded on first use by
    a node started and stopped for it; None when it could not be made (the nodes start without one)."""

    def record(scratch: Path) -> None:
        recorder = ApacheKafka(
            version=version, environment=environment, archive=False,
            jvm=(*QUICK_START_JVM, f"-XX:ArchiveClassesAtExit={scratch}"),
        )  # fmt: skip
        try:
            recorder.start()
            scratch.unlink(missing_ok=True)  # the storage format's (read-only): the node's replaces it
        finally:
            recorder.stop()  # SIGTERM: the JVM writes the archive as it exits

    return kafka_classes.archive(libs, java, record)


def random_cluster_id() -> str:
    """A KRaft cluster id: 16 random bytes, URL-safe base64 without padding, not starting with '-'."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


@dataclass
class KafkaNode:
    """One combined-mode (broker and controller) node of an ApacheKafka cluster."""

    node_id: int
    host: str
    port: int
    controller_port: int
    directory: Path
    advertised: tuple[str, int]  # what clients are told to use: the listener, or a proxy in front of it
    wrapper: list[str] = field(default_factory=list)  # e.g. ["ip", "netns", "exec", "ns1"]
    process: subprocess.Popen[bytes] | None = None
    finalizer: weakref.finalize[..., KafkaNode] | None = None

    @property
    def address(self) -> str:
        return f"{self.advertised[0]}:{self.advertised[1]}"

    @property
    def log_path(self) -> Path:
        return self.directory / "server.log"

    @property
    def config_path(self) -> Path:
        return self.directory / "server.properties"

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.exists():
            return f"(node {self.node_id}: no log)"
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return f"node {self.node_id} log {self.log_path}:\n" + "\n".join(text)


def _kill(process: subprocess.Popen[bytes], watchdog: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait(timeout=30)
    release(watchdog)


# The JVM options of a node. A broker of this module starts often and carries a test's or a trial's
# traffic: QUICK_START_JVM stops the JIT at its first tier (C1; the optimising compiler's threads cost a
# short-lived broker more CPU than they save) and takes the serial collector (one thread for a heap of at
# most 512 MiB). A three-node cluster formatted, started and left idle for 20 s took 12.6 s of CPU with them
# against 20.5 s with SERVER_JVM, and was ready in 5.8 s against 8.6 s (2 cores, Java 17, Kafka 4.4).
# SERVER_JVM is what kafka-run-class.sh gives a broker: the benchmarks that time traffic through one use it.
QUICK_START_JVM: tuple[str, ...] = ("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC")
SERVER_JVM: tuple[str, ...] = ("-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20")


class ApacheKafka:
    """A KRaft cluster of `nodes` combined-mode nodes of Apache Kafka `version`, on free loopback ports.

    Every node is broker and controller (the quorum is all nodes). Replication follows the cluster's
    size: with three or more nodes the internal topics and new topics get replication factor 3 and
    `min.insync.replicas` 2, as a production cluster would; with one node, 1 and 1.

    `hosts` gives each node its listen address (default 127.0.0.1 for all), `ports` its client port (default
    a free one), `advertised` the address clients are told (default the listener; a proxy in front of it for
    fault tests) and `wrappers` a command prefix (a network namespace, for tests that cut one node off).
    `environment`: where the pom, the jars and Java are (read from the environment when not given).
    `config` adds or overrides server properties on every node; `jvm` gives the JVM's options
    (QUICK_START_JVM or SERVER_JVM, above). The cluster's directory (`work_dir`, a
    temp directory by default) holds one directory per node with its configuration, data and `server.log`;
    stop() removes a temp directory unless asked to keep it.
    """

    def __init__(
        self,
        nodes: int = 1,
        version: str | None = None,
        work_dir: Path | None = None,
        hosts: Sequence[str] | None = None,
        ports: Sequence[int] | None = None,
        advertised: Sequence[tuple[str, int]] | None = None,
        wrappers: Sequence[Sequence[str]] | None = None,
        config: dict[str, str] | None = None,
        start_timeout_s: float = 120.0,
        heap: str = "512m",
        environment: KafkaEnvironment | None = None,
        jvm: Sequence[str] = QUICK_START_JVM,
        archive: bool = True,
    ):
        if nodes < 1:
            raise ValueError("a cluster needs at least one node")
        if hosts is not None and len(hosts) != nodes:
            raise ValueError(f"{len(hosts)} hosts for {nodes} nodes")
        for name, given in (("ports", ports), ("advertised", advertised), ("wrappers", wrappers)):
            if given is not None and len(given) != nodes:
                raise ValueError(f"{len(given)} {name} for {nodes} nodes")
        self._environment = environment or KafkaEnvironment()
        self.version = version or pom_versions(repository_pom(self._environment))["newest"]
        self.size = nodes
        self._hosts = list(hosts or ["127.0.0.1"] * nodes)
        self._ports = list(ports) if ports else None
        self._advertised = list(advertised) if advertised else None
        self._wrappers = [list(w) for w in wrappers] if wrappers else [[] for _ in range(nodes)]
        self._config = dict(config or {})
        self._start_timeout_s = start_timeout_s
        self._heap = heap
        self._jvm = tuple(jvm)
        self._work_dir = work_dir
        self._made_work_dir: Path | None = None
        self.nodes: dict[int, KafkaNode] = {}
        self._java: str | None = None
        self._libs: Path | None = None
        self._archive = archive  # map the version's class archive (class_archive), recording it if new
        self._class_flags: tuple[str, ...] = ()

    # ----------------------------------------------------------------------------------------------- info
    @property
    def directory(self) -> Path:
        directory = self._work_dir or self._made_work_dir
        if directory is None:
            raise BrokerError("the cluster has not been started")
        return directory

    @property
    def bootstrap_servers(self) -> str:
        if not self.nodes:
            raise BrokerError("Apache Kafka is not running; call start() first")
        return ",".join(node.address for node in self.nodes.values())

    @property
    def listen_port(self) -> int:
        """The port the first node listens on (its advertised address may be a proxy's)."""
        if not self.nodes:
            raise BrokerError("Apache Kafka is not running; call start() first")
        return next(iter(self.nodes.values())).port

    def describe(self) -> str:
        return f"Apache Kafka {self.version} ({self.size} node{'s' if self.size > 1 else ''}, KRaft)"

    def node_at(self, host: str, port: int) -> KafkaNode:
        """The node clients reach at (host, port), its advertised address."""
        for node in self.nodes.values():
            if node.advertised == (host, port):
                return node
        raise KeyError(f"no node listens on {host}:{port}")

    def log_tails(self, lines: int = 30) -> str:
        return "\n".join(node.log_tail(lines) for node in self.nodes.values())

    # -------------------------------------------------------------------------------------------- control
    def start(self) -> ApacheKafka:
        """Format every node's storage, start them all, and return once each serves metadata that lists
        every node."""
        if self.nodes:
            return self
        self._java = find_java(self._environment)
        self._libs = resolve_jars(self.version, environment=self._environment)
        if self._archive:
            found = class_archive(self.version, self._java, self._libs, self._environment)
            # The JVM's own warnings (an archive it cannot use among them) to stderr, not a tool's stdout.
            self._class_flags = () if found is None else (
                f"-XX:SharedArchiveFile={found}", "-Xlog:disable", "-Xlog:all=warning:stderr",
            )  # fmt: skip
        if self._work_dir is None:
            self._made_work_dir = Path(tempfile.mkdtemp(prefix=f"score-worker-kafka-{self.version}-"))
        self.directory.mkdir(parents=True, exist_ok=True)
        cluster_id = random_cluster_id()
        for index in range(self.size):
            node_id = index + 1
            host, port = self._hosts[index], self._ports[index] if self._ports else free_port()
            self.nodes[node_id] = KafkaNode(
                node_id=node_id,
                host=host,
                port=port,
                controller_port=free_port(),
                directory=self.directory / f"node-{node_id}",
                advertised=self._advertised[index] if self._advertised else (host, port),
                wrapper=self._wrappers[index],
            )
        try:
            for node in self.nodes.values():
                node.directory.mkdir(parents=True, exist_ok=True)
                self._write_config(node)
                self._format(node, cluster_id)
            for node in self.nodes.values():
                self._launch(node)
            self.wait_ready()
        except BaseException:
            self.stop(keep_files=True)
            raise
        log.info("%s on %s, files in %s", self.describe(), self.bootstrap_servers, self.directory)
        return self

    def _server_properties(self, node: KafkaNode) -> dict[str, str]:
        replicas = min(self.size, 3)
        min_isr = 2 if replicas >= 3 else 1
        voters = ",".join(f"{n.node_id}@{n.host}:{n.controller_port}" for n in self.nodes.values())
        properties = {
            "process.roles": "broker,controller",
            "node.id": str(node.node_id),
            "controller.quorum.voters": voters,
            "listeners": f"PLAINTEXT://{node.host}:{node.port},CONTROLLER://{node.host}:{node.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{node.address}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(node.directory / "data"),
            "default.replication.factor": str(replicas),
            "min.insync.replicas": str(min_isr),
            "offsets.topic.replication.factor": str(replicas),
            "transaction.state.log.replication.factor": str(replicas),
            "transaction.state.log.min.isr": str(min_isr),
            # A short-lived test cluster: no wait before the first rebalance of a new group, and fewer
            # partitions of the internal topics (created on first use; 50 each would slow every start).
            "group.initial.rebalance.delay.ms": "0",
            "offsets.topic.num.partitions": "8",
            "transaction.state.log.num.partitions": "8",
            # Lets a member ask for a short session (the tests use 1.5 s, so that a killed worker's
            # partitions move within seconds); Kafka's default floor is 6 s.
            "group.min.session.timeout.ms": "500",
        }
        if int(self.version.split(".")[0]) >= 4:
            properties["share.coordinator.state.topic.replication.factor"] = str(replicas)
            properties["share.coordinator.state.topic.min.isr"] = str(min_isr)
        properties.update(self._config)
        return properties

    def _write_config(self, node: KafkaNode) -> None:
        lines = [f"{key}={value}" for key, value in self._server_properties(node).items()]
        node.config_path.write_text("\n".join(lines) + "\n")
        # Both logging configurations: Kafka 4 reads the log4j2 one, Kafka 3 (reload4j) the other.
        (node.directory / "log4j2.properties").write_text(
            "status = warn\n"
            "appender.out.type = Console\nappender.out.name = out\n"
            "appender.out.layout.type = PatternLayout\nappender.out.layout.pattern = [%d] %p %m (%c)%n\n"
            "rootLogger.level = INFO\nrootLogger.appenderRef.out.ref = out\n"
        )
        (node.directory / "log4j.properties").write_text(
            "log4j.rootLogger=INFO, out\n"
            "log4j.appender.out=org.apache.log4j.ConsoleAppender\n"
            "log4j.appender.out.layout=org.apache.log4j.PatternLayout\n"
            "log4j.appender.out.layout.ConversionPattern=[%d] %p %m (%c)%n\n"
        )

    def _java_command(self, node: KafkaNode, main_class: str, *arguments: str) -> list[str]:
        assert self._java is not None and self._libs is not None
        return [
            *node.wrapper, self._java, "-Xms128m", f"-Xmx{self._heap}", *self._jvm, *self._class_flags,
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={node.directory / 'log4j2.properties'}",
            f"-Dlog4j.configuration=file:{node.directory / 'log4j.properties'}",
            "-cp", f"{self._libs}/*", main_class, *arguments,
        ]  # fmt: skip

    def _format(self, node: KafkaNode, cluster_id: str) -> None:
        command = self._java_command(
            node, "kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(node.config_path)
        )
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise BrokerError(f"formatting node {node.node_id}'s storage failed: {done.stdout}{done.stderr}")

    def _launch(self, node: KafkaNode) -> None:
        if node.finalizer is not None:
            node.finalizer()  # the previous run's process, ended, and its watchdog
        command = self._java_command(node, "kafka.Kafka", str(node.config_path))
        with open(node.log_path, "ab") as log_file:
            node.process = subprocess.Popen(
                command, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
            )
        # Killed on stop(), when the node is collected, and, by its watchdog, when this process dies
        # without a word (SIGKILL, a CI timeout): a node in its own session outlives it otherwise.
        node.finalizer = weakref.finalize(node, _kill, node.process, watch(node.process))

    def wait_ready(self, timeout_s: float | None = None, nodes: Sequence[int] | None = None) -> None:
        """Return once each running node (or those named) answers metadata listing every running node."""
        deadline = time.monotonic() + (timeout_s or self._start_timeout_s)
        last: object = None
        while True:
            running = [node for node in self.nodes.values() if node.running()]
            asked = [self.nodes[i] for i in nodes] if nodes else running
            for node in asked:
                if not node.running():
                    code = node.process.returncode if node.process else None
                    raise BrokerError(f"Kafka node {node.node_id} exited with code {code}: {node.log_tail()}")
            expected = {node.advertised for node in running}
            try:
                if all(set(metadata_brokers(n.host, n.port)) >= expected for n in asked):
                    return
            except (OSError, struct.error, BrokerError) as error:
                last = error
            else:
                last = "not every node is registered yet"
            if time.monotonic() > deadline:
                raise BrokerError(
                    f"{self.describe()} not ready within {timeout_s or self._start_timeout_s:.0f} s "
                    f"(last: {last}):\n{self.log_tails()}"
                )
            time.sleep(0.2)

    def tool_command(self, tool: str, *arguments: str) -> list[str]:
        """The command line of one of Kafka's own tools (`kafka-consumer-groups`, `kafka-console-producer`,
        `kafka-console-consumer`, `kafka-topics`) run from this cluster's jars, as its bin/ script would."""
        if self._java is None or self._libs is None:
            raise BrokerError("the cluster has not been started")
        major = int(self.version.split(".")[0])
        classes = {
            "kafka-consumer-groups": "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand",
            "kafka-console-consumer": "org.apache.kafka.tools.consumer.ConsoleConsumer",
            "kafka-console-producer": "org.apache.kafka.tools.ConsoleProducer"
            if major >= 4
            else "kafka.tools.ConsoleProducer",
            "kafka-topics": "org.apache.kafka.tools.TopicCommand"
            if major >= 4
            else "kafka.admin.TopicCommand",
        }
        if tool not in classes:
            raise ValueError(f"unknown Kafka tool {tool!r}; one of {', '.join(classes)}")
        config = self.directory / "tools-log4j2.properties"
        if not config.exists():  # the tools log warnings to stderr, as Kafka's own tools-log4j does
            config.write_text(
                "status = warn\nappender.err.type = Console\nappender.err.name = err\n"
                "appender.err.target = SYSTEM_ERR\nappender.err.layout.type = PatternLayout\n"
                "appender.err.layout.pattern = [%d] %p %m (%c)%n\n"
                "rootLogger.level = WARN\nrootLogger.appenderRef.err.ref = err\n"
            )
            (self.directory / "tools-log4j.properties").write_text(
                "log4j.rootLogger=WARN, err\nlog4j.appender.err=org.apache.log4j.ConsoleAppender\n"
                "log4j.appender.err.Target=System.err\nlog4j.appender.err.layout=org.apache.log4j.PatternLayout\n"
                "log4j.appender.err.layout.ConversionPattern=[%d] %p %m (%c)%n\n"
            )
        return [
            self._java, "-Xmx256m", "-XX:TieredStopAtLevel=1", *self._class_flags, "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={config}",
            f"-Dlog4j.configuration=file:{self.directory / 'tools-log4j.properties'}",
            "-cp", f"{self._libs}/*", classes[tool], *arguments,
        ]  # fmt: skip

    def run_tool(
        self, tool: str, *arguments: str, input_text: str | None = None, timeout_s: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        """Run one of Kafka's tools to completion (see tool_command); raises BrokerError when it fails."""
        command = self.tool_command(tool, *arguments)
        done = subprocess.run(command, input=input_text, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise BrokerError(
                f"{tool} {' '.join(arguments)} exited with {done.returncode}: {done.stderr[-3000:]}"
            )
        return done

    def kill(self, node_id: int) -> None:
        """SIGKILL one node: a crash, no controlled shutdown."""
        node = self.nodes[node_id]
        if node.process is not None and node.process.poll() is None:
            node.process.kill()
            node.process.wait(timeout=30)

    def terminate(self, node_id: int, timeout_s: float = 60.0) -> None:
        """SIGTERM one node and wait for its controlled shutdown (killed if it takes over `timeout_s`)."""
        node = self.nodes[node_id]
        if node.process is None or node.process.poll() is not None:
            return
        node.process.send_signal(signal.SIGTERM)
        try:
            node.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("Kafka node %d did not stop within %.0f s; killed", node_id, timeout_s)
            self.kill(node_id)

    def restart(self, node_id: int, wait: bool = True) -> None:
        """Start a stopped or killed node again on its ports and storage."""
        node = self.nodes[node_id]
        if node.running():
            raise BrokerError(f"node {node_id} is running")
        self._launch(node)
        if wait:
            self.wait_ready(nodes=[node_id])

    def stop(self, keep_files: bool = False) -> None:
        """Stop every node (SIGTERM, then SIGKILL after 20 s); the temp directory goes unless `keep_files`."""
        for node in self.nodes.values():
            if node.running():
                assert node.process is not None
                node.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for node in self.nodes.values():
            if node.process is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    node.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            if node.finalizer is not None:
                node.finalizer()  # kills it if still running
        if self._made_work_dir is not None and not keep_files:
            shutil.rmtree(self._made_work_dir, ignore_errors=True)
            self._made_work_dir = None
        self.nodes = {}

    def __enter__(self) -> ApacheKafka:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop(keep_files=exc is not None)


LOCAL_BROKERS = ("embedded", "kafka")


def start_local_broker(kind: str) -> EmbeddedBroker | ApacheKafka:
    """A started broker on this machine for a benchmark or a trial: "embedded" (Tansu, in memory) or
    "kafka" (Apache Kafka, the pom's newest, one node, on a server's JVM options: it carries the traffic a
    benchmark times). Both stop with stop() and are context managers."""
    if kind == "embedded":
        return EmbeddedBroker().start()
    if kind == "kafka":
        return ApacheKafka(nodes=1, jvm=SERVER_JVM).start()
    raise ValueError(f"unknown broker {kind!r}; one of {', '.join(LOCAL_BROKERS)}")
