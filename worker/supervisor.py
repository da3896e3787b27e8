"""The host worker: one `score-worker run` process per GPU, kept running by a supervisor.

Each process is a member of the consumer group of its own, with a static membership id made of the host's
(or the pod's) name and its GPU, so that a restart within the session timeout keeps its partitions without
a rebalance. The supervisor restarts a process that dies (after a backoff that doubles, and only so many
times in a window: past that limit it stops them all and exits non-zero, so that whatever runs the host
sees the failure instead of a worker that flaps), forwards SIGTERM so that every process drains within its
drain bound, and serves one /metrics (every process's series with a `gpu` label), /healthz and /readyz for
the host. The processes listen on the loopback only, on ports the supervisor chooses.

Why not torchrun's elastic agent: it runs its local workers as one SPMD job, so when one fails it stops and
restarts all of them (eight GPUs would drain and rejoin the group because one failed); it needs a rendezvous
the workers have no use for, and it serves no endpoint for the host. The processes here are independent
members of a consumer group, and Kafka is already their coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from worker.config import ENV_PREFIX, WorkerSettings
from worker.health import HealthServer
from worker.metrics import PREFIX

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
BACKOFF_CAP_S = 60.0
# A worker process stopping during start-up exits once its model is loaded; beyond its drain bound this much
# more is allowed before it is killed (what was not committed is delivered again to the group).
STOP_GRACE_S = 30.0
_SCRAPE_TIMEOUT_S = 2.0
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Slot:
    """One worker process of the host: the GPUs it is given and the name it goes by."""

    label: str  # the `gpu` label of its series: the GPU's index on this host, or cpuN for a CPU process
    gpus: tuple[str, ...]  # its CUDA_VISIBLE_DEVICES entries (none for a CPU process)

    @property
    def suffix(self) -> str:
        """What its worker id and static membership id end with."""
        return self.label if self.label.startswith("cpu") else f"gpu{self.label}"


def visible_gpus(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries (indices or UUIDs)."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [entry.strip() for entry in listed.split(",") if entry.strip()]
    try:
        import torch
    except ImportError:
        return []
    return [str(index) for index in range(torch.cuda.device_count())]


def plan_slots(choice: str, device: str, visible: Sequence[str], tensor_parallel: int = 1) -> list[Slot]:
    """The worker processes of a `gpus` setting ('all', a count, or a list of this host's GPU indices): one
    per GPU, or per `tensor_parallel` consecutive GPUs (a group's rank 0, which starts the others)."""
    if device == "cpu":
        if not choice.isdigit():
            raise ValueError("with device cpu, gpus is a count of CPU worker processes")
        return [Slot(f"cpu{index}", ()) for index in range(int(choice))]
    indices = _chosen_gpus(choice, device, visible)
    if len(indices) % tensor_parallel:
        raise ValueError(f"{len(indices)} GPUs do not form groups of tensor_parallel {tensor_parallel}")
    groups = [indices[start : start + tensor_parallel] for start in range(0, len(indices), tensor_parallel)]
    return [
        Slot("-".join(str(index) for index in group), tuple(visible[index] for index in group))
        for group in groups
    ]


def _chosen_gpus(choice: str, device: str, visible: Sequence[str]) -> list[int]:
    if device.startswith("cuda:"):
        raise ValueError(f"device {device} names one GPU; with gpus, leave device at auto or cuda")
    if not visible:
        raise ValueError(
            "no GPU is visible here (driver or CUDA_VISIBLE_DEVICES); for CPU worker processes set device "
            "to cpu and gpus to a count"
        )
    if choice == "all":
        return list(range(len(visible)))
    if choice.isdigit():
        if int(choice) > len(visible):
            raise ValueError(f"{choice} GPUs asked for, {len(visible)} visible")
        return list(range(int(choice)))
    indices = [int(entry) for entry in choice.split(",") if entry]
    beyond = [index for index in indices if index >= len(visible)]
    if beyond:
        raise ValueError(f"GPU {beyond[0]} asked for, {len(visible)} visible (0 to {len(visible) - 1})")
    return indices


class Restarts:
    """When a process may be restarted: after a backoff that doubles with each restart in the window, and
    not at all once `limit` restarts fall in the window."""

    def __init__(
        self, limit: int, window_s: float, backoff_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._limit, self._window_s, self._backoff_s, self._clock = limit, window_s, backoff_s, clock
        self._times: list[float] = []

    def next_delay(self) -> float | None:
        """Count a restart now and return the wait before it; None when the limit is reached."""
        now = self._clock()
        self._times = [at for at in self._times if at > now - self._window_s]
        if len(self._times) >= self._limit:
            return None
        delay = min(BACKOFF_CAP_S, self._backoff_s * 2.0 ** len(self._times))
        self._times.append(now)
        return delay


def metrics_listener() -> socket.socket:
    """A loopback socket on a port the system picks, listening: a worker process's /metrics, /healthz and
    /readyz, which the supervisor scrapes and asks."""
    return socket.create_server(("127.0.0.1", 0), backlog=64)


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM it (so that it drains) if the supervisor dies without a word."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Child:
    """One worker process and what the supervisor knows of it."""

    slot: Slot
    restarts: Restarts
    port: int = 0
    listener: int | None = None  # the descriptor of its metrics socket, in both processes (pass_fds)
    process: asyncio.subprocess.Process | None = None
    restarted: int = 0
    ready: dict[str, Any] = field(default_factory=dict)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None


class Supervisor:
    """Starts a process per slot, keeps each running, stops them all on `stop()`; `run()` returns the exit
    code of the host worker."""

    def __init__(
        self,
        settings: WorkerSettings,
        slots: Sequence[Slot],
        command: Sequence[str],
        environment: Callable[[Child], dict[str, str]],
    ) -> None:
        self._settings = settings
        self._command = list(command)
        self._environment = environment
        backoff_s = settings.restart_backoff_ms / 1000
        self.children = [
            Child(slot, Restarts(settings.restart_limit, settings.restart_window_s, backoff_s))
            for slot in slots
        ]
        self._stopping = asyncio.Event()
        self._signals = 0
        self._code = EXIT_OK
        self._registry = CollectorRegistry(auto_describe=True)
        host = settings.worker_id
        self._up = Gauge(
            f"{PREFIX}_host_process_up", "1 while the worker process of a GPU runs", ["worker", "gpu"],
            registry=self._registry,
        )  # fmt: skip
        self._restarts = Counter(f"{PREFIX}_host_process_restarts", "worker processes restarted by the host",
                                 ["worker", "gpu"], registry=self._registry)  # fmt: skip
        self._scrape_errors = Counter(
            f"{PREFIX}_host_scrape_errors", "scrapes of a worker process's /metrics that got no answer",
            ["worker", "gpu"], registry=self._registry,
        )  # fmt: skip
        for child in self.children:
            for metric in (self._up, self._restarts, self._scrape_errors):
                metric.labels(host, child.slot.label)
        self.health: HealthServer | None = None
        if settings.metrics_port:
            self.health = HealthServer(
                settings.metrics_host, settings.metrics_port, self.exposition, self.checks, self.details
            )

    def stop(self) -> None:
        """Ask every process to drain and the host worker to exit (the first call); a second call passes the
        signal on again, which makes the processes exit at once."""
        self._signals += 1
        if self._signals > 1:
            log.warning("second stop: the worker processes exit without finishing in-flight requests")
            self._signal_all(signal.SIGTERM)
        self._stopping.set()

    async def run(self) -> int:
        if self.health is not None:
            await self.health.start()
        log.info(
            "host worker %s: %d worker processes (%s)",
            self._settings.worker_id, len(self.children), ", ".join(c.slot.suffix for c in self.children),
        )  # fmt: skip
        keepers = [asyncio.create_task(self._keep(child), name=child.slot.suffix) for child in self.children]
        try:
            await self._stopping.wait()
            self._signal_all(signal.SIGTERM)
            bound_s = self._settings.drain_timeout_ms / 1000 + STOP_GRACE_S
            _, pending = await asyncio.wait(keepers, timeout=bound_s)
            if pending:
                log.error("worker processes still running %.0f s after SIGTERM: killing them", bound_s)
                self._signal_all(signal.SIGKILL)
                await asyncio.wait(pending, timeout=10)
            for task in keepers:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    log.error("supervising %s failed: %r", task.get_name(), task.exception())
                    self._code = self._code or EXIT_FAILURE
        finally:
            for task in keepers:
                task.cancel()
            self._signal_all(signal.SIGKILL)
            if self.health is not None:
                await self.health.stop()
        log.info("host worker %s exits with %d", self._settings.worker_id, self._code)
        return self._code

    async def _keep(self, child: Child) -> None:
        """Run one slot's process until the host stops; restart it when it dies."""
        labels = (self._settings.worker_id, child.slot.label)
        while not self._stopping.is_set():
            # The process's metrics socket, bound and listening here and inherited: a port picked free and
            # bound by the process later could be taken in between (another program's bind or outgoing
            # connection), and the process would exit on its first try.
            listener = metrics_listener() if self._settings.metrics_port else None
            child.port = 0 if listener is None else int(listener.getsockname()[1])
            child.listener = None if listener is None else listener.fileno()
            try:
                child.process = await asyncio.create_subprocess_exec(
                    *self._command, env=self._environment(child), preexec_fn=_die_with_parent,
                    start_new_session=True,  # a terminal's Ctrl-C reaches the supervisor only, which drains
                    pass_fds=() if listener is None else (listener.fileno(),),
                )  # fmt: skip
            finally:
                if listener is not None:
                    listener.close()  # the process holds its own copy
            self._up.labels(*labels).set(1)
            log.info("started worker process %s (pid %d)", child.slot.suffix, child.process.pid)
            code = await child.process.wait()
            self._up.labels(*labels).set(0)
            child.ready = {}
            if self._stopping.is_set():
                # SIGTERM before the process set up its handler (still importing) ends it by the signal:
                # it was asked to stop, had taken nothing yet, and stopped
                if code not in (0, -signal.SIGTERM):
                    log.warning("worker process %s exited with %d while stopping", child.slot.suffix, code)
                    self._code = self._code or EXIT_FAILURE
                return
            if code == EXIT_USAGE:  # its settings or its model are wrong: a restart would fail the same way
                log.error(
                    "worker process %s cannot start (exit code 2): stopping the host", child.slot.suffix
                )
                self._give_up(EXIT_USAGE)
                return
            delay = child.restarts.next_delay()
            if delay is None:
                log.error(
                    "worker process %s exited with %d after %d restarts in %.0f s: stopping the host",
                    child.slot.suffix, code, self._settings.restart_limit, self._settings.restart_window_s,
                )  # fmt: skip
                self._give_up(EXIT_FAILURE)
                return
            log.warning(
                "worker process %s exited with %d: restarting it in %.1f s", child.slot.suffix, code, delay
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)
            if self._stopping.is_set():
                return
            child.restarted += 1
            self._restarts.labels(*labels).inc()

    def _give_up(self, code: int) -> None:
        self._code = self._code or code
        self._stopping.set()

    def _signal_all(self, signum: int) -> None:
        for child in self.children:
            if child.running and child.process is not None:
                with contextlib.suppress(ProcessLookupError):
                    child.process.send_signal(signum)

    # -- the host's endpoints ----------------------------------------------------------------------------

    async def exposition(self) -> bytes:
        """The supervisor's own series and every running process's, each of those with its `gpu` label."""
        running = [child for child in self.children if child.running and child.port]
        answers = await asyncio.gather(*(_get(child.port, "/metrics") for child in running))
        parts: list[tuple[str, str]] = []
        for child, answer in zip(running, answers, strict=True):
            if answer is None or answer[0] != 200:
                self._scrape_errors.labels(self._settings.worker_id, child.slot.label).inc()
                continue
            parts.append((child.slot.label, answer[1].decode("utf-8", "replace")))
        return generate_latest(_Families(merge_expositions(parts, self._registry.collect())))

    async def checks(self) -> dict[str, bool]:
        """Ready when every process is: one check per process (a restarting one is not ready)."""
        answers = await asyncio.gather(
            *(
                _get(child.port, "/readyz") if child.running and child.port else _nothing()
                for child in self.children
            )
        )
        for child, answer in zip(self.children, answers, strict=True):
            child.ready = _readiness(answer)
        return {child.slot.suffix: bool(child.ready.get("ready")) for child in self.children}

    def details(self) -> dict[str, Any]:
        """What /readyz shows beside its checks: each process's pid, restarts and own readiness."""
        return {
            "processes": {
                child.slot.suffix: {
                    "pid": child.process.pid if child.running and child.process is not None else None,
                    "restarts": child.restarted,
                    **child.ready,
                }
                for child in self.children
            }
        }


class _Families:
    """A registry-like object for generate_latest: merged families, collected once."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def merge_expositions(parts: Iterable[tuple[str, str]], own: Iterable[Metric] = ()) -> list[Metric]:
    """Families of several processes' text expositions as one: each sample gains `gpu=<label>`."""
    families: dict[str, Metric] = {family.name: family for family in own}
    for label, text in parts:
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            for sample in family.samples:
                merged.add_sample(
                    sample.name,
                    {**sample.labels, "gpu": label},
                    sample.value,
                    sample.timestamp,
                    sample.exemplar,
                )
    return list(families.values())


def _readiness(answer: tuple[int, bytes] | None) -> dict[str, Any]:
    import json

    if answer is None:
        return {"ready": False, "answer": "none"}
    try:
        body = json.loads(answer[1])
    except ValueError:
        return {"ready": False, "answer": f"HTTP {answer[0]}, not JSON"}
    return body if isinstance(body, dict) else {"ready": False}


async def _nothing() -> None:
    return None


async def _get(port: int, path: str) -> tuple[int, bytes] | None:
    """GET http://127.0.0.1:port/path: (status, body), or None when nothing answers in time."""
    try:
        async with asyncio.timeout(_SCRAPE_TIMEOUT_S):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
                await writer.drain()
                raw = await reader.read()
            finally:
                writer.close()
    except (OSError, TimeoutError):
        return None
    head, _, body = raw.partition(b"\r\n\r\n")
    try:
        return int(head.split(b" ", 2)[1]), body
    except (IndexError, ValueError):
        return None


def child_environment(
    settings: WorkerSettings, given: Mapping[str, str], count: int, environ: Mapping[str, str] = os.environ
) -> Callable[[Child], dict[str, str]]:
    """The environment of each worker process: the host's, the settings given on its command line (as
    SCORE_WORKER_* variables), and what makes the process one GPU's worker."""

    def environment(child: Child) -> dict[str, str]:
        env = {**environ, **given}
        slot, member = child.slot, settings.group_instance_id or settings.worker_id
        env.update({
            f"{ENV_PREFIX}GPUS": "",
            f"{ENV_PREFIX}WORKER_ID": f"{settings.worker_id}-{slot.suffix}",
            f"{ENV_PREFIX}GROUP_INSTANCE_ID": f"{member}-{slot.suffix}",
            f"{ENV_PREFIX}METRICS_HOST": "127.0.0.1",
            f"{ENV_PREFIX}METRICS_PORT": str(child.port),
            f"{ENV_PREFIX}LOG_TAG": slot.suffix,
        })  # fmt: skip
        if child.listener is not None:
            env[f"{ENV_PREFIX}METRICS_FD"] = str(child.listener)
        if slot.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(slot.gpus)
            # One GPU: cuda:0 of the one visible; a tensor-parallel group's rank r takes cuda:r.
            env[f"{ENV_PREFIX}DEVICE"] = "cuda:0" if len(slot.gpus) == 1 else "cuda"
        else:
            env[f"{ENV_PREFIX}DEVICE"] = "cpu"
            if not settings.torch_threads and "OMP_NUM_THREADS" not in environ:  # the cores, shared out
                processes = count * settings.tensor_parallel
                env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // processes))
        return env

    return environment


def flags_as_environment(values: Mapping[str, Any]) -> dict[str, str]:
    """Settings given as flags, as the SCORE_WORKER_* variables a worker process reads."""

    def text(value: Any) -> str:
        return ("true" if value else "false") if isinstance(value, bool) else str(value)

    return {f"{ENV_PREFIX}{name.upper()}": text(value) for name, value in values.items() if value is not None}


def worker_command(log_level: str, log_format: str) -> list[str]:
    return [sys.executable, "-m", "worker", "--log-level", log_level, "--log-format", log_format, "run"]


async def serve_host(supervisor: Supervisor) -> int:
    """Run the supervisor; SIGTERM/SIGINT stop it (a second passes on at once)."""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, supervisor.stop)
    try:
        return await supervisor.run()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
