"""Decoding and tokenising request records in processes of their own, away from the model's interpreter.

The model thread launches hundreds of GPU kernels per batch, and every launch gives up Python's interpreter
lock and must take it back. Decoding, validating and tokenising a burst of fetched records on a thread of the
same process holds that lock for milliseconds at a time, so each launch waits and the GPU runs dry: on the
H200, batches that should take 45 ms took up to 0.75 s whenever about 2,000 records arrived at once. In
processes of their own that work takes no lock of the model's; the worker's process only reads back the
prepared requests (pickled, about a twentieth of the work).

A record that is not a plain valid request (a defect, a limit broken, a tokenizer error) comes back as None
and the worker prepares it on its own thread, so every error result is written by one code path. When the
processes fail (one killed, out of memory) the records of that call are prepared on the worker's thread
as well: nothing is lost, and the processes are started again for later calls.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import pickle
import signal
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from models.prepare import PreparedRequest, PromptBuilder
from schemas import decode_request

log = logging.getLogger(__name__)

# A prepared request and the seconds its decoding and tokenising took.
Ready = tuple[PreparedRequest, float]

# Records per call sent to one process: large enough that the round trip is a small share of the work,
# small enough that a burst spreads over every process.
MAX_CHUNK_RECORDS = 64
MIN_CHUNK_RECORDS = 8
# Processes when the model runs on a GPU (settings.intake_processes unset): one keeps up with the W2 stream
# many times over; a second spreads a burst of fetched records.
DEFAULT_GPU_INTAKE_PROCESSES = 2
# Restarts after failures before the worker keeps preparing on its own thread for good.
MAX_RESTARTS = 3
# How long one call may take before its processes count as hung: a fixed part and a part per record (a
# record holds at most a few megabytes of text, which a fast tokenizer reads in well under this).
CALL_TIMEOUT_S = 10.0
CALL_TIMEOUT_PER_RECORD_S = 0.05

_builder: PromptBuilder | None = None


def _start_process(builder: bytes) -> None:
    """Runs once in each intake process."""
    global _builder
    # Ctrl-C reaches the whole process group: only the worker decides when intake stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _builder = pickle.loads(builder)


def _started() -> bool:
    return _builder is not None


def prepare_values(values: Sequence[bytes]) -> list[Ready | None]:
    """In an intake process: each record value as a prepared request, or None where anything is amiss."""
    assert _builder is not None, "intake process not started"
    ready: list[Ready | None] = []
    for value in values:
        started = time.perf_counter()
        try:
            prepared = _builder.prepare(decode_request(value))
        except Exception:  # the worker's own path writes the error result, as for every other record
            ready.append(None)
            continue
        ready.append((prepared, time.perf_counter() - started))
    return ready


class IntakeProcesses:
    """A pool of processes that decode and tokenise records with a copy of the scorer's prompt builder.

    `start` launches them in the background; until they have answered once, and after failures beyond
    MAX_RESTARTS, `prepare` answers None for every record (the caller then prepares on its own thread).
    """

    def __init__(
        self,
        builder: PromptBuilder,
        processes: int,
        on_prepared: Callable[[int], None] = lambda count: None,
        on_restart: Callable[[], None] = lambda: None,
    ) -> None:
        if processes < 1:
            raise ValueError(f"processes must be at least 1, got {processes}")
        self.processes = processes
        self._on_prepared = on_prepared  # records prepared in the processes, per call
        self._on_restart = on_restart  # the processes failed and were stopped
        self._builder = pickle.dumps(builder, protocol=pickle.HIGHEST_PROTOCOL)
        self._executor: ProcessPoolExecutor | None = None
        self._warming: asyncio.Task[None] | None = None
        self._ready = False
        self._closed = False
        self.restarts = 0

    @property
    def ready(self) -> bool:
        """The processes are up and have answered: records sent now are prepared there."""
        return self._ready and not self._closed

    def start(self) -> None:
        """Launch the processes; returns at once (each takes seconds to import its libraries)."""
        if self._closed or self._warming is not None:
            return
        self._executor = ProcessPoolExecutor(
            self.processes,
            mp_context=multiprocessing.get_context("spawn"),  # never fork a process that holds CUDA
            initializer=_start_process,
            initargs=(self._builder,),
        )
        self._warming = asyncio.get_running_loop().create_task(self._warm(self._executor), name="intake-warm")

    async def _warm(self, executor: ProcessPoolExecutor) -> None:
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        try:
            # One call per process: the pool starts a process for each call that finds none idle.
            await asyncio.gather(*(loop.run_in_executor(executor, _started) for _ in range(self.processes)))
        except Exception as exc:
            self._failed(executor, exc)
            return
        if executor is self._executor and not self._closed:
            self._ready = True
            log.info(
                "%d intake processes ready in %.1f s: records are decoded and tokenised there",
                self.processes, time.monotonic() - started,
            )  # fmt: skip

    async def prepare(self, values: Sequence[bytes]) -> list[Ready | None]:
        """Prepared requests in the order of `values`; None for each record to prepare elsewhere."""
        executor = self._executor
        if not self.ready or executor is None or not values:
            return [None] * len(values)
        loop = asyncio.get_running_loop()
        size = max(MIN_CHUNK_RECORDS, min(MAX_CHUNK_RECORDS, -(-len(values) // self.processes)))
        calls: list[asyncio.Future[list[Ready | None]]] = []
        try:
            for i in range(0, len(values), size):  # submitting to a broken pool raises too
                calls.append(loop.run_in_executor(executor, prepare_values, list(values[i : i + size])))
            # A process that hangs (a tokenizer stuck on some input) must not stall fetching for good.
            async with asyncio.timeout(CALL_TIMEOUT_S + CALL_TIMEOUT_PER_RECORD_S * len(values)):
                parts = await asyncio.gather(*calls)
        except Exception as exc:  # TimeoutError included
            for call in calls:
                if not call.cancel() and not call.cancelled():
                    call.exception()  # retrieved: the pool's failure is logged once, below
            self._failed(executor, exc)
            return [None] * len(values)
        ready = [ready for part in parts for ready in part]
        self._on_prepared(sum(1 for done in ready if done is not None))
        return ready

    def _failed(self, executor: ProcessPoolExecutor, exc: BaseException) -> None:
        """Prepare on the worker's thread from now; start fresh processes unless that happened too often."""
        if executor is not self._executor or self._closed:
            return  # an older pool, already replaced
        self._ready = False
        self._warming = None
        self._executor = None
        _stop(executor)
        self._on_restart()
        broken = isinstance(exc, BrokenProcessPool)
        if self.restarts >= MAX_RESTARTS:
            log.error(
                "intake processes failed again (%r): records are prepared on the worker's own thread from "
                "now on (slower under load); restart the worker to try the processes again", exc,
            )  # fmt: skip
            self._closed = True
            return
        self.restarts += 1
        log.warning(
            "intake processes failed (%r%s): this call's records are prepared on the worker's thread; "
            "starting them again (%d of %d)",
            exc, ", a process died" if broken else "", self.restarts, MAX_RESTARTS,
        )  # fmt: skip
        self.start()

    def close(self) -> None:
        """Stop the processes (records in their hands are the caller's to prepare again)."""
        self._closed = True
        self._ready = False
        if self._warming is not None:
            self._warming.cancel()
        if self._executor is not None:
            _stop(self._executor)
            self._executor = None


def _stop(executor: ProcessPoolExecutor) -> None:
    """Shut a pool down without waiting, its processes terminated (one may hang on an input forever)."""
    # The pool keeps its processes in a private map (Python 3.14 adds terminate_workers for this).
    workers = list((getattr(executor, "_processes", None) or {}).values())
    executor.shutdown(wait=False, cancel_futures=True)
    for process in workers:
        if process.is_alive():
            process.kill()  # holds nothing worth a clean exit; a stopped process ignores a terminate


def process_count(setting: int | None, device: str) -> int:
    """Intake processes for `settings.intake_processes` and the model's device: unset means some on a GPU,
    none on the CPU (where the model's own threads want the cores and hold no lock while they compute)."""
    if setting is not None:
        return setting
    return DEFAULT_GPU_INTAKE_PROCESSES if device.startswith("cuda") else 0
