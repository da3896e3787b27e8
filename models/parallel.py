"""A tensor-parallel group on one host: rank 0 is the engine the worker sees; the other ranks follow it.

Every rank loads its share of the model (models/tensor_parallel.py) into a Scorer of its own and runs every
engine call rank 0 runs, in the same order, on the same inputs: rank 0 sends each call (the batch it
planned, or the start-up check and warm-up) over a control channel before it runs it, and each follower
runs the same call on its Scorer. Their collectives then meet in step, and one consumer (rank 0's worker)
fetches, plans and publishes for the whole group.

Failure: a rank that dies breaks the others' next collective (gloo and NCCL see the closed connection); one
that hangs is noticed when its collective or the control channel times out (`tensor_parallel_timeout_s`).
Rank 0 then raises DeviceLostError from the engine (the worker stops without committing what it had not
answered), and watches its followers' processes: one that exits makes rank 0 stop. Followers exit when rank
0 goes quiet past the timeout (rank 0 sends a heartbeat while idle) or dies (the kernel's parent-death
signal). The supervisor above starts the group again.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import datetime
import importlib
import json
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from models.config import ScorerConfig
from models.engine import Scorer
from models.errors import DeviceLostError
from models.interface import BatchObserver, EngineWrapper, PendingScores
from models.loading import read_config
from models.ports import free_port
from models.prepare import PreparedRequest
from models.tensor_parallel import Shard, check_splittable
from schemas import ScoreResult

log = logging.getLogger(__name__)

T = TypeVar("T")
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
JOIN_TIMEOUT_S = 300.0  # longest rank 0 waits for its followers' processes to join the group


@dataclass(frozen=True)
class GroupSpec:
    """What every rank needs to join the group and load its share (JSON on the followers' command line)."""

    world: int
    port: int
    model_dir: str
    engine: dict[str, Any]  # the engine settings (EngineSettings' fields)
    # How the followers run, as the leader was started: its log level and torch's CPU threads per rank.
    log_level: str = "INFO"
    threads: int = 1

    @property
    def timeout_s(self) -> float:
        return float(self.engine.get("tensor_parallel_timeout_s", 60.0))

    def config(self, rank: int) -> ScorerConfig:
        """Rank `rank`'s engine: its own GPU of those the group was given (cuda:rank), or the CPU."""
        settings = dict(self.engine)
        device = str(settings.get("device", "auto"))
        cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        settings["device"] = f"cuda:{rank}" if cuda else "cpu"
        return ScorerConfig(**settings)


def join(spec: GroupSpec, rank: int) -> tuple[Shard, Any]:
    """Join the group: the shard of this rank, and the control channel's own gloo group."""
    cuda = spec.config(rank).device.startswith("cuda")
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    if cuda:
        torch.cuda.set_device(rank)
    # Joining waits for every rank's process to start (imports take seconds, more on a busy host): a bound of
    # its own, longer than the collectives' timeout, which is for ranks that are up.
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", spec.port, spec.world, is_master=rank == 0,
        timeout=datetime.timedelta(seconds=max(JOIN_TIMEOUT_S, spec.timeout_s)),
    )  # fmt: skip
    dist.init_process_group(
        "nccl" if cuda else "gloo", store=store, rank=rank, world_size=spec.world, timeout=timeout
    )
    control = dist.new_group(backend="gloo", timeout=timeout)
    return Shard(rank, spec.world, dist.group.WORLD), control


class Channel:
    """Rank 0's calls to the followers, in order (a gloo broadcast of each call's pickled arguments).

    While no call is under way rank 0 sends a heartbeat every quarter of the timeout, so that a follower
    waiting for the next call tells a quiet leader from a lost one."""

    def __init__(self, group: Any, timeout_s: float) -> None:
        self._group = group
        self._interval_s = timeout_s / 4
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._busy = 0
        self.failure: BaseException | None = None

    def send(self, message: tuple[Any, ...]) -> None:
        with self._lock:
            self._broadcast(message)

    @contextlib.contextmanager
    def call(self, message: tuple[Any, ...]) -> Any:
        """Send a call and keep the heartbeat off until rank 0 has run it too (the followers are in it)."""
        with self._lock:
            self._busy += 1
            try:
                self._broadcast(message)
            except BaseException:
                self._busy -= 1
                raise
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1
                self._last = time.monotonic()

    def _broadcast(self, message: tuple[Any, ...]) -> None:
        if self.failure is not None:
            raise DeviceLostError(f"the tensor-parallel group is broken: {self.failure}")
        try:
            dist.broadcast_object_list([message], src=0, group=self._group)
        except Exception as exc:
            self.failure = exc
            raise DeviceLostError(f"a follower of the tensor-parallel group is lost: {exc}") from exc
        self._last = time.monotonic()

    def heartbeat(self, stop: threading.Event) -> None:
        while not stop.wait(self._interval_s / 4):
            with self._lock:
                if self._busy or self.failure is not None or time.monotonic() - self._last < self._interval_s:
                    continue
                with contextlib.suppress(DeviceLostError):
                    self._broadcast(("ping",))

    @staticmethod
    def receive(group: Any) -> tuple[Any, ...]:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        return tuple(box[0])


def _function_name(function: Callable[..., Any]) -> str:
    return f"{function.__module__}:{function.__qualname__}"


def _function(name: str) -> Callable[..., Any]:
    module, _, qualname = name.partition(":")
    target: Any = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target  # type: ignore[no-any-return]


class Follower(Protocol):
    """A follower's process as rank 0 watches and stops it (subprocess.Popen's own methods)."""

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


class LeaderEngine(EngineWrapper):
    """Rank 0's Scorer, as the worker's engine: every model call is first sent to the followers."""

    engine: Scorer

    def __init__(
        self,
        scorer: Scorer,
        channel: Channel,
        followers: Sequence[Follower],
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        """`on_lost`: what to do when a follower exits (default: SIGTERM to this process, which stops the
        worker: it drains what it can, and a model call fails with DeviceLostError, uncommitted)."""
        super().__init__(scorer)
        self._channel = channel
        self._followers = list(followers)
        self._on_lost = on_lost or (lambda: os.kill(os.getpid(), signal.SIGTERM))
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="tp-watch", daemon=True)
        heartbeat = threading.Thread(
            target=channel.heartbeat, args=(self._stop,), name="tp-heartbeat", daemon=True
        )
        for thread in (heartbeat, self._watcher):
            thread.start()

    @property
    def scorer(self) -> Scorer:
        return self.engine

    def launch(
        self, prepared: Sequence[PreparedRequest | ScoreResult], on_batch: BatchObserver | None = None
    ) -> PendingScores:
        with self._channel.call(("launch", list(prepared))):
            return self.engine.launch(prepared, on_batch)

    def finish(self, pending: PendingScores) -> list[ScoreResult]:
        with self._channel.call(("finish",)):
            return self.engine.finish(pending)

    def run_everywhere(self, function: Callable[[Scorer], T]) -> T:
        """`function(scorer)` on every rank in step (the self-check, the warm-up); rank 0's result."""
        with self._channel.call(("run", _function_name(function))):
            return function(self.engine)

    def _watch(self) -> None:
        """A follower that exits breaks the group: every later call raises DeviceLostError, and `on_lost`."""
        while not self._stop.wait(0.2):
            for rank, process in enumerate(self._followers, start=1):
                code = process.poll()
                if code is not None:
                    self._channel.failure = RuntimeError(f"rank {rank} exited with code {code}")
                    log.error(
                        "rank %d of the tensor-parallel group exited with code %d: stopping", rank, code
                    )
                    self._on_lost()
                    return

    def close(self) -> None:
        """Tell the followers to exit, and wait for them (at most the timeout)."""
        self._stop.set()
        # The watch ends within its poll interval; waited for, so that it does not read a follower's exit
        # status while this thread does (a forked follower's status is read once, from a pipe).
        if self._watcher is not threading.current_thread():
            self._watcher.join(timeout=1.0)
        with contextlib.suppress(Exception):
            self._channel.send(("exit",))
        deadline = time.monotonic() + self._channel._interval_s * 4
        for process in self._followers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            if process.poll() is None:
                process.kill()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def follow(scorer: Scorer, control: Any) -> None:
    """A follower's life: run every call rank 0 sends, in order, until it says exit."""
    pending: collections.deque[PendingScores] = collections.deque()
    while True:
        message = Channel.receive(control)
        kind = message[0]
        if kind == "launch":
            pending.append(scorer.launch(message[1]))
        elif kind == "finish":
            scorer.finish(pending.popleft())
        elif kind == "run":
            _function(message[1])(scorer)
        elif kind == "exit":
            return
        elif kind != "ping":
            raise RuntimeError(f"unknown call {kind!r} from rank 0")


def _prctl(option: int, argument: int | bytes) -> None:
    """Linux's prctl on this process (its main thread, for the name); nothing where there is none."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(option, argument, 0, 0, 0)


def _name_process(name: str) -> None:
    """The name `ps` and /proc/PID/comm show: a follower is told from the other Python processes at once."""
    _prctl(_PR_SET_NAME, name.encode()[:15])


def _die_with_parent() -> None:
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def start_group(
    model_dir: str | Path, config: ScorerConfig, on_lost: Callable[[], None] | None = None
) -> LeaderEngine:
    """Start the followers (ranks 1..world-1, processes of this one), join as rank 0 and load the share of
    each rank; the leader's engine once all have loaded.

    On the CPU the followers are forked from a template process (`_ForkedFollower`), which, as
    multiprocessing's spawn and forkserver methods do, imports the program's main module again: a script
    that starts a group keeps its own work under `if __name__ == "__main__":` (the worker's commands do)."""
    hooks = {name: value for name, value in _hooks(config).items() if value is not None}
    if hooks:
        raise ValueError(f"{', '.join(hooks)} cannot reach the other ranks of a tensor-parallel group")
    # A model the split refuses is refused before any process starts or any rank joins.
    check_splittable(
        Path(model_dir), read_config(Path(model_dir), config.trust_remote_code), config.trust_remote_code,
        config.tensor_parallel,
    )  # fmt: skip
    spec = GroupSpec(
        config.tensor_parallel, free_port(), str(model_dir),
        {name: getattr(config, name) for name in type(config).model_fields if name in _ENGINE_FIELDS},
        log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()),
    )  # fmt: skip
    spec = replace(spec, threads=_follower_threads(spec))
    start: Callable[[GroupSpec, int], Follower] = (
        _ForkedFollower if spec.config(0).device == "cpu" else _follower_process
    )
    followers = [start(spec, rank) for rank in range(1, spec.world)]
    try:
        shard, control = join(spec, 0)
        scorer = Scorer(model_dir, spec.config(0), shard=shard)
        return LeaderEngine(scorer, Channel(control, spec.timeout_s), followers, on_lost)
    except BaseException:
        for process in followers:
            process.kill()
        if dist.is_initialized():  # joined, then failed to load: the next group must be able to join
            dist.destroy_process_group()
        raise


def _follower_process(spec: GroupSpec, rank: int) -> subprocess.Popen[bytes]:
    """A follower in an interpreter of its own (`python -m models.parallel`): what a group on GPUs takes,
    since a process forked from one that may have touched CUDA cannot use it."""
    # OMP_NUM_THREADS too: the libraries a follower loads size their own pools from it.
    environment = {**os.environ, "OMP_NUM_THREADS": str(spec.threads)}
    spec_json = json.dumps(asdict(spec))
    command = [sys.executable, "-m", "models.parallel", "--rank", str(rank), "--spec", spec_json]
    return subprocess.Popen(command, env=environment, preexec_fn=_die_with_parent)


class _ForkedFollower:
    """A follower forked from a template process that has imported the engine once (multiprocessing's fork
    server, started with the first group and kept for later ones): on the CPU a new interpreter's imports
    cost a follower more than its share of a small model, and every restart of the group pays them again.
    Answers as the subprocess.Popen of `_follower_process` does, for the leader's watch and close."""

    _context: multiprocessing.context.ForkServerContext | None = None

    def __init__(self, spec: GroupSpec, rank: int) -> None:
        if _ForkedFollower._context is None:
            context = multiprocessing.get_context("forkserver")
            # The template imports the engine and nothing of this process's own program (not `__main__`);
            # it touches no device, starts no thread pool.
            context.set_forkserver_preload([__name__])
            _ForkedFollower._context = context
        self._process = _ForkedFollower._context.Process(
            target=_forked_main, args=(rank, json.dumps(asdict(spec))), name=f"tp-rank-{rank}", daemon=False
        )
        self._process.start()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def send_signal(self, number: int) -> None:
        if self._process.pid is not None and self._process.exitcode is None:
            os.kill(self._process.pid, number)

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"rank of pid {self._process.pid}", timeout or 0.0)
        return self._process.exitcode

    def kill(self) -> None:
        with contextlib.suppress(ValueError):  # already reaped
            self._process.kill()


def _forked_main(rank: int, spec_json: str) -> None:
    """A forked follower's life, as `python -m models.parallel` runs it; it dies with the template, which
    leaves when the process that started it does."""
    _die_with_parent()
    _exit(main(["--rank", str(rank), "--spec", spec_json]))


def _exit(code: int) -> None:
    """Leave at once: a follower has nothing left to write once its logs are out, and the interpreter's
    teardown after a gloo group takes seconds (3 s a follower on two CPU cores), which every close and restart
    of the group would wait for."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _follower_threads(spec: GroupSpec) -> int:
    """torch's CPU threads for each follower: the leader's own (the worker sets them from its settings);
    on the CPU at most an equal share of the cores, since the ranks compute at once."""
    threads = torch.get_num_threads()
    if spec.config(0).device == "cpu":
        threads = min(threads, len(os.sched_getaffinity(0)) // spec.world)
    return max(1, threads)


def _hooks(config: ScorerConfig) -> dict[str, Any]:
    """The code-only fields of a ScorerConfig (injected kernels, recorders): rank 0 keeps them."""
    return {name: getattr(config, name) for name in type(config).model_fields if name not in _ENGINE_FIELDS}


def _engine_fields() -> frozenset[str]:
    from models.settings import EngineSettings

    return frozenset(EngineSettings.model_fields) | {"last_layer_pooled_rows", "attention"}


_ENGINE_FIELDS = _engine_fields()


def main(argv: Sequence[str] | None = None) -> int:
    """A follower: `python -m models.parallel --rank R --spec JSON`."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--spec", required=True)
    args = parser.parse_args(argv)
    spec = GroupSpec(**json.loads(args.spec))
    logging.basicConfig(
        level=spec.log_level,
        format=f"%(asctime)s %(levelname)-7s [rank {args.rank}] %(name)s: %(message)s",
    )
    _name_process(f"tp-rank-{args.rank}")
    # Where the interpreter was forked rather than started with it (`_ForkedFollower`): for the libraries
    # that size their pools from it when they first run.
    os.environ["OMP_NUM_THREADS"] = str(spec.threads)
    config = spec.config(args.rank)
    torch.set_num_threads(spec.threads)
    shard, control = join(spec, args.rank)
    try:
        follow(Scorer(spec.model_dir, config, shard=shard), control)
    except Exception:
        log.exception("rank %d stops", args.rank)
        return 1
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    _exit(main())
