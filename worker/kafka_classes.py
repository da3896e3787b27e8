"""Class data sharing for Apache Kafka's JVMs: the classes a node loads, parsed and verified once, into an
archive the JVM maps at its start (JDK 13's dynamic archives).

Each node and each storage format the suite starts is a JVM: on two cores a node took 1.6 s of CPU to listen
with the archive against 2.6-2.9 s without, and was up 0.9 s sooner (Java 17, Kafka 4.4), a format 0.45 s
against 0.8 s. The archive is recorded once per version and Java (by a node started and stopped for it:
worker/apache_kafka.py's `class_archive`), kept beside the jars and named after what it depends on: a Java
or jars it does not match get another name, and a JVM ignores an archive it cannot use.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from worker.errors import BrokerError

log = logging.getLogger(__name__)

_ARCHIVES: dict[tuple[Path, str], Path | None] = {}  # (jars, java) -> archive (None: none could be made)


def archive(libs: Path, java: str, record: Callable[[Path], None]) -> Path | None:
    """The archive of the jars in `libs` on `java`; where it does not exist yet, record(scratch) writes it
    (a JVM run with -XX:ArchiveClassesAtExit=scratch), then it takes its place. None when it could not be
    made: the nodes start without one."""
    if (libs, java) in _ARCHIVES:
        return _ARCHIVES[libs, java]
    launcher = Path(os.path.realpath(java))
    stamp = libs.parent / "resolved"
    identity = f"{launcher}:{launcher.stat().st_mtime_ns}:{stamp.read_text() if stamp.exists() else ''}"
    found = libs.parent / f"classes-{hashlib.sha256(identity.encode()).hexdigest()[:16]}.jsa"
    try:
        _record(found, record)
    except (OSError, BrokerError) as error:  # a cache this user cannot write (an image's), a node that failed
        log.warning("no class archive for the jars in %s (%s); the nodes start without one", libs, error)
    _ARCHIVES[libs, java] = found if found.exists() else None
    return _ARCHIVES[libs, java]


def _record(target: Path, record: Callable[[Path], None]) -> None:
    with open(target.parent / ".archive.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel test processes: one records, the others wait for it
        if target.exists():
            return
        scratch = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
        started = time.monotonic()
        try:
            record(scratch)
            if scratch.exists() and scratch.stat().st_size > 0:
                scratch.rename(target)
                log.info("class archive %s recorded in %.0f s", target, time.monotonic() - started)
        finally:
            scratch.unlink(missing_ok=True)
