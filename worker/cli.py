"""The `score-worker` command: run a worker, submit requests, run the demo, write a tiny model."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

from pydantic import SecretStr, ValidationError

from worker.config import ENV_PREFIX, WorkerSettings, describe_validation_error, flag_for

if TYPE_CHECKING:
    from models import Scorer
    from worker.app import ScoreWorker

log = logging.getLogger("worker")

# Subcommands implemented elsewhere: module with add_arguments(parser) and run(args) -> int. Imported only
# when chosen, so `score-worker run` does not pay for them and works while they are absent.
EXTERNAL_COMMANDS: dict[str, tuple[str, str]] = {
    "submit": ("worker.submit", "submit scoring requests and print their results"),
    "demo": ("worker.demo", "embedded broker + tiny model + one worker + sample requests"),
    "make-tiny-model": ("models.tiny", "write a tiny random-weight model for tests and demos"),
    "broker": ("worker.broker", "run the embedded Kafka-protocol broker (Tansu) for local trials"),
}

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def configure_logging(level: str) -> None:
    """Concise logs once per process; the Kafka client's INFO chatter is held back to warnings."""
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)-7s %(name)s: %(message)s", stream=sys.stderr
    )
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, logging.getLogger().level))


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per WorkerSettings field (secrets excepted: those come from the environment only)."""
    for name, field in WorkerSettings.model_fields.items():
        if field.annotation in (SecretStr, SecretStr | None):
            continue
        env = f"{ENV_PREFIX}{name.upper()}"
        default = "" if field.is_required() else f", default {field.default}"
        help_text = f"{field.description} (env {env}{default})"
        flags = [flag_for(name)] + (["--model-dir"] if name == "model_dir" else [])
        if field.annotation is bool:
            parser.add_argument(
                *flags, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            parser.add_argument(
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
    # A signal during the (slow) model load must not kill the process half-way: note it, exit cleanly after.
    early_stop: list[int] = []
    previous = _install_handlers(lambda signum, _frame: early_stop.append(signum))
    try:
        scorer = _load_scorer(settings)
    finally:
        _restore_handlers(previous)
    if scorer is None:
        return EXIT_USAGE
    if early_stop:
        log.info("signal %d during start-up: exiting", early_stop[0])
        return EXIT_OK
    from worker.app import ScoreWorker
    from worker.errors import WorkerError

    worker = ScoreWorker(settings, scorer)
    try:
        asyncio.run(_serve(worker))
    except WorkerError as error:
        log.error("%s", error)
        return EXIT_FAILURE
    except Exception:  # a broker that cannot be reached, refused credentials, ...: say so, exit non-zero
        log.exception("the worker failed")
        return EXIT_FAILURE
    return EXIT_OK


def _load_scorer(settings: WorkerSettings) -> Scorer | None:
    from models import ModelLoadError, Scorer, ScorerConfig

    config = ScorerConfig(
        device=settings.device, dtype=settings.dtype, max_batch_tokens=settings.max_batch_tokens
    )
    try:
        scorer = Scorer(settings.model_dir, config)
    except (ModelLoadError, ValueError) as error:
        print(f"score-worker run: cannot load the model in {settings.model_dir}: {error}", file=sys.stderr)
        return None
    log.info("loaded model %s from %s", scorer.model_name, settings.model_dir)
    return scorer


async def _serve(worker: ScoreWorker) -> None:
    loop = asyncio.get_running_loop()
    signals_seen: list[int] = []

    def on_signal(signum: int) -> None:
        signals_seen.append(signum)
        if len(signals_seen) == 1:
            worker.stop()
            return
        # A second signal means "now": exit without publishing; uncommitted requests are redelivered.
        log.warning("second signal: exiting without finishing in-flight requests")
        os._exit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        await worker.run()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)


Handler = Callable[[int, FrameType | None], Any] | int | None


def _install_handlers(handler: Callable[[int, FrameType | None], Any]) -> dict[int, Handler]:
    previous: dict[int, Handler] = {}
    for signum in (signal.SIGTERM, signal.SIGINT):
        previous[signum] = signal.signal(signum, handler)
    return previous


def _restore_handlers(previous: dict[int, Handler]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def _chosen_command(argv: Sequence[str]) -> str | None:
    """The subcommand named on the command line, found before parsing so only its module is imported."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--log-level")
    _, rest = pre.parse_known_args(argv)
    return next((arg for arg in rest if not arg.startswith("-")), None)


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="score-worker", description=__doc__)
    parser.add_argument(
        "--log-level",
        default=os.environ.get(f"{ENV_PREFIX}LOG_LEVEL", "INFO"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
        help=f"log verbosity (env {ENV_PREFIX}LOG_LEVEL, default INFO)",
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
        print(f"score-worker: this command is not available: {error}", file=sys.stderr)
        return EXIT_FAILURE
    args = parser.parse_args(args_list)
    configure_logging(args.log_level)
    return int(args.handler(args))
