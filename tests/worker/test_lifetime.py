"""Brokers die with the run that started them: a test process killed outright (SIGKILL: a CI timeout, a
killed pytest) leaves no broker behind, where a node in its own session would otherwise run on for as long
as the machine does (worker/lifetime.py)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from brokers import java_or_not_here

from worker.lifetime import POLL_MS, release, watch

ROOT = Path(__file__).resolve().parent.parent.parent
# The watchdog looks at its parent every POLL_MS; a start of Python and a kill on a loaded CI machine, then
# the kernel's reaping, come on top. Seconds, as the promise says, not a tuned figure.
GONE_WITHIN_S = 10.0


def _gone(pid: int) -> bool:
    """No such process, or a zombie (an init that does not reap, as in some containers)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.05)
    return _gone(pid)


def _starter(script: str, ready_timeout_s: float) -> tuple[subprocess.Popen[str], int, list[str]]:
    """A Python process that runs `script` (which prints the pid it started, and any directory it made,
    then waits); that pid and those directories."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    starter = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE, text=True, env=environment
    )
    assert starter.stdout is not None
    deadline = time.monotonic() + ready_timeout_s
    line = ""
    while not line and time.monotonic() < deadline and starter.poll() is None:
        line = starter.stdout.readline().strip()
    if not line.split(" ")[0].isdigit():
        starter.kill()
        pytest.fail(f"the starter printed no pid (exit {starter.wait()}): {line!r}")
    pid, *made = line.split(" ")
    return starter, int(pid), made


def _kill_starter_and_expect_gone(starter: subprocess.Popen[str], pid: int, made: list[str]) -> None:
    assert not _gone(pid), "the broker is not running while its starter lives"
    os.kill(starter.pid, signal.SIGKILL)
    starter.wait(timeout=30)
    try:
        assert _wait_gone(pid, GONE_WITHIN_S), f"process {pid} outlived its starter by {GONE_WITHIN_S} s"
    finally:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)
        for directory in made:  # the starter's own clean-up never ran
            shutil.rmtree(directory, ignore_errors=True)


def test_a_process_outlives_its_killed_starter_by_no_more_than_the_watchdogs_poll() -> None:
    script = """
        import subprocess, sys, time
        from worker.lifetime import watch
        child = subprocess.Popen(["sleep", "300"], start_new_session=True)
        watch(child)
        print(child.pid, flush=True)
        time.sleep(300)
    """
    starter, pid, made = _starter(script, 30)
    started = time.monotonic()
    _kill_starter_and_expect_gone(starter, pid, made)
    assert time.monotonic() - started < GONE_WITHIN_S
    assert POLL_MS <= 1000, "a watchdog that polls less often breaks the promise of seconds"


def test_a_watchdog_ends_with_its_process_and_leaves_it_alone_while_the_starter_lives() -> None:
    child = subprocess.Popen(["sleep", "1"])
    watchdog = watch(child)
    assert child.wait(timeout=30) == 0  # not killed: it ran its second
    started = time.monotonic()
    release(watchdog)
    assert watchdog.returncode == 0 and time.monotonic() - started < GONE_WITHIN_S


def test_the_embedded_broker_dies_with_its_killed_starter() -> None:
    script = """
        import time
        from worker.broker import EmbeddedBroker
        broker = EmbeddedBroker().start()
        print(broker._process.pid, broker.log_path.parent, flush=True)
        time.sleep(300)
    """
    starter, pid, made = _starter(script, 60)
    _kill_starter_and_expect_gone(starter, pid, made)


@pytest.mark.slow
def test_an_apache_kafka_node_dies_with_its_killed_starter() -> None:
    java_or_not_here()
    script = """
        import time
        from worker.apache_kafka import ApacheKafka
        cluster = ApacheKafka(nodes=1).start()
        print(cluster.nodes[1].process.pid, cluster.directory, flush=True)
        time.sleep(300)
    """
    starter, pid, made = _starter(script, 180)
    _kill_starter_and_expect_gone(starter, pid, made)
