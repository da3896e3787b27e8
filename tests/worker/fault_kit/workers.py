"""Worker processes for fault tests: their environment, their log lines, start, kill, and their memory."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from worker_testkit import (
    Names,
    fast_values,
    settings_env,
)

from fault_kit.common import WORKER_BIN

# The longest a worker process may take to log what a test waits for (its start, an assignment). A liveness
# bound, not a measured figure: a start on a busy two-core host (5-7 s of CPU importing torch, the model's
# load and self-check, then a group join that waits for the other members to rejoin) took over 60 s in a
# parallel run; the figures the tests report are measured from the workers' own log times.
WAIT_S = 180.0


def worker_env(bootstrap: str, model_dir: Path, names: Names, **settings: Any) -> dict[str, str]:
    """The environment of a worker process: SCORE_WORKER_* settings with short group timeouts."""
    values = fast_values(
        bootstrap,
        model_dir,
        names,
        metrics_port=0,
        # Tansu makes a joining member wait about half the session timeout.
        session_timeout_ms=3000,
        heartbeat_interval_ms=500,
        commit_interval_ms=100,
        create_topics=False,
        self_check=False,
        log_format="json",
    )
    return settings_env({**values, **settings})


@dataclass(frozen=True)
class LogLine:
    """One line of a worker's JSON log."""

    at: float  # seconds since the epoch
    level: str
    message: str


def _parse_line(line: str) -> LogLine | None:
    try:
        entry = json.loads(line)
        when = datetime.strptime(entry["time"], "%Y-%m-%dT%H:%M:%S.%fZ")
    except (ValueError, KeyError, TypeError):
        return None
    at = (when - datetime(1970, 1, 1)).total_seconds()
    return LogLine(
        at, entry["level"], entry["message"] + ("\n" + entry["exception"] if "exception" in entry else "")
    )


class WorkerProcess:
    """One `score-worker run` process, its JSON log file, and the faults a test can inflict on it."""

    def __init__(self, name: str, env: dict[str, str], log_dir: Path, prefix: Sequence[str] = ()) -> None:
        """`prefix`: what the command runs under (`ip netns exec NS`: another host, tests/worker/netns.py)."""
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.started_at = time.time()
        with open(self.log_path, "wb") as out:
            self.popen = subprocess.Popen(
                [*prefix, str(WORKER_BIN), "run"], env=env, stdout=out, stderr=subprocess.STDOUT
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def running(self) -> bool:
        return self.popen.poll() is None

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 30) -> str:
        shown = [line[:400] for line in self.text().splitlines()[-lines:]]
        return f"--- {self.name} (pid {self.pid}) log tail:\n" + "\n".join(shown)

    def lines(self) -> list[LogLine]:
        return [line for raw in self.text().splitlines() if (line := _parse_line(raw)) is not None]

    def find(self, pattern: str, after: float = 0.0) -> LogLine | None:
        return next((ln for ln in self.lines() if ln.at >= after and re.search(pattern, ln.message)), None)

    async def wait_for(self, pattern: str, timeout_s: float = WAIT_S, after: float = 0.0) -> LogLine:
        deadline = time.monotonic() + timeout_s
        while (found := self.find(pattern, after)) is None:
            assert self.running(), f"{self.name} exited with {self.popen.returncode}\n{self.tail()}"
            assert time.monotonic() < deadline, f"{self.name} never logged {pattern!r}\n{self.tail()}"
            await asyncio.sleep(0.05)
        return found

    async def wait_assigned(self, timeout_s: float = WAIT_S, after: float = 0.0) -> LogLine:
        """The next assignment with at least one partition."""
        return await self.wait_for(r"assigned partitions: \[", timeout_s, after)

    def assigned(self) -> set[int]:
        """Partitions of the last assignment it logged."""
        last = [ln for ln in self.lines() if ln.message.startswith("assigned partitions")]
        return {int(p) for p in re.findall(r"\[(\d+)\]", last[-1].message)} if last else set()

    def kill(self) -> float:
        """SIGKILL; returns when it was sent (epoch seconds) once the process is gone."""
        at = time.time()
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=10)
        return at

    async def terminate(self, timeout_s: float = 60.0) -> tuple[int, float]:
        """SIGTERM; the exit code and the seconds from the signal to the exit."""
        started = time.monotonic()
        self.popen.send_signal(signal.SIGTERM)
        while self.popen.poll() is None:
            assert time.monotonic() - started < timeout_s, f"{self.name} ignored SIGTERM\n{self.tail()}"
            await asyncio.sleep(0.01)
        return self.popen.returncode, time.monotonic() - started

    def rss_kib(self) -> int | None:
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
        except OSError:
            return None
        found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
        return int(found.group(1)) if found else None

    def problems(self, start: float, end: float) -> list[LogLine]:
        """WARNING and ERROR lines logged between two moments."""
        return [ln for ln in self.lines() if start <= ln.at <= end and ln.level in ("WARNING", "ERROR")]

    def close(self) -> None:
        if self.running():
            self.popen.kill()
            self.popen.wait(timeout=10)


class RssSampler:
    """Samples a process's resident memory in the background."""

    def __init__(self, process: WorkerProcess, every_s: float = 0.05) -> None:
        self.process, self.every_s = process, every_s
        self.samples: list[int] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> RssSampler:
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        while (rss := self.process.rss_kib()) is not None:
            self.samples.append(rss)
            await asyncio.sleep(self.every_s)

    def stop(self) -> int:
        """The peak (KiB)."""
        if self._task is not None:
            self._task.cancel()
        return max(self.samples)


Spawn = Callable[..., WorkerProcess]  # (name, env, prefix=()) -> a started worker process
