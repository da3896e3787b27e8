"""Processes that end with the process that started them: a broker started for a test run or a trial is
killed when that run dies, even by SIGKILL, which skips every finalizer and exit handler.

Each such process gets a watchdog, this file run as a script: it waits on the process (a pidfd) and polls
its own parent, the starter; once reparented (the starter is gone) it kills the process and exits, and it
exits as soon as the process has. A watchdog rather than PR_SET_PDEATHSIG in the child: that signal
follows the starter's *thread*, and a broker started from a worker thread (asyncio.to_thread, a fixture
in a thread pool) would die with the thread. The script needs the standard library only."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

POLL_MS = 200  # how often a watchdog looks at its parent: the longest a process outlives its starter


def watch(process: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
    """A watchdog that kills `process` once this process is gone; `release` it after `process` ends."""
    # -P: the script's directory (worker/) must not shadow the standard library. Its own session: the
    # terminal's Ctrl-C is for the starter, which stops the process itself.
    command = [sys.executable, "-P", str(Path(__file__).resolve()), str(os.getpid()), str(process.pid)]
    return subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True
    )


def release(watchdog: subprocess.Popen[bytes] | None, timeout_s: float = 5.0) -> None:
    """Reap a watchdog whose process has ended (it exits at once then); killed if it lingers."""
    if watchdog is None:
        return
    try:
        watchdog.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        watchdog.kill()
        watchdog.wait(timeout=timeout_s)


def _guard(starter: int, child: int) -> int:
    """The watchdog's loop: 0 when the child ended, 1 when the starter went first and the child was
    killed."""
    try:
        handle = os.pidfd_open(child)
    except ProcessLookupError:  # already reaped
        return 0
    except OSError:  # a kernel before 5.3: poll the pid itself
        return _guard_by_pid(starter, child)
    waiter = select.poll()
    waiter.register(handle, select.POLLIN)  # readable once the child has exited
    while not waiter.poll(POLL_MS):
        if os.getppid() != starter:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(handle, signal.SIGKILL)
            return 1
    return 0


def _guard_by_pid(starter: int, child: int) -> int:
    while True:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return 0
        if os.getppid() != starter:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
            return 1
        time.sleep(POLL_MS / 1000)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(_guard(int(sys.argv[1]), int(sys.argv[2])))
