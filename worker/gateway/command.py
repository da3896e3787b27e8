"""`score-worker gateway`: serve the HTTP routes on uvicorn until SIGTERM, then answer what is in flight."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from pydantic import ValidationError

from worker.config import (
    ENV_PREFIX,
    SECURITY_ENV_VARS,
    describe_validation_error,
    security_from_environment,
)
from worker.environment import GatewaySettings

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

# Flag -> settings field; every field is also read from SCORE_WORKER_<FIELD> (the flag wins).
FLAGS: dict[str, str] = {
    "--bootstrap-servers": "bootstrap_servers",
    "--requests-topic": "requests_topic",
    "--results-topic": "results_topic",
    "--reply-topic": "gateway_reply_topic",
    "--host": "gateway_host",
    "--port": "gateway_port",
    "--api-keys-file": "gateway_api_keys_file",
    "--max-body-bytes": "gateway_max_body_bytes",
    "--max-items": "gateway_max_items",
    "--max-calls": "gateway_max_calls",
    "--timeout": "gateway_timeout_s",
    "--probe-interval": "gateway_probe_interval_s",
    "--model-name": "gateway_model_name",
    "--labels": "gateway_labels",
    "--ssl-certfile": "gateway_ssl_certfile",
    "--ssl-keyfile": "gateway_ssl_keyfile",
}
# Every variable the command reads: its settings, the Kafka security settings, and the command line's own.
ENV_VARS = (*(f"{ENV_PREFIX}{field.upper()}" for field in GatewaySettings.model_fields), *SECURITY_ENV_VARS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting; API keys themselves come from the environment or a file, never a flag."""
    for flag, field in FLAGS.items():
        info = GatewaySettings.model_fields[field]
        default = "" if info.default is None else f", default {info.default}"
        parser.add_argument(
            flag, dest=field, default=None, metavar=field.split("_")[-1].upper(),
            help=f"{info.description} (env {ENV_PREFIX}{field.upper()}{default})",
        )  # fmt: skip


def build_settings(args: argparse.Namespace) -> GatewaySettings:
    given = {
        field: getattr(args, field) for field in FLAGS.values() if getattr(args, field, None) is not None
    }
    return GatewaySettings(**given)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT: uvicorn then stops accepting connections, answers the calls in flight
    (up to the call timeout), the Kafka client stops last, and uvicorn ends the process by the signal."""
    try:
        settings = build_settings(args)
        security = security_from_environment().kafka_security_kwargs()
    except ValidationError as error:
        lines = describe_validation_error(error, flags=False)
        print(f"score-worker gateway: invalid settings\n{lines}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as error:
        print(f"score-worker gateway: {error}", file=sys.stderr)
        return EXIT_USAGE
    if settings.bootstrap_servers is None:
        print(
            f"score-worker gateway: set --bootstrap-servers or {ENV_PREFIX}BOOTSTRAP_SERVERS", file=sys.stderr
        )
        return EXIT_USAGE
    import uvicorn

    from worker.gateway.app import Gateway, build_app

    gateway = Gateway(settings, security)
    server = uvicorn.Server(uvicorn_config(build_app(gateway), settings))
    log.info("gateway on %s:%d -> %s", settings.gateway_host, settings.gateway_port, settings.requests_topic)
    server.run()
    return EXIT_OK if server.started else EXIT_FAILURE


def uvicorn_config(app: object, settings: GatewaySettings) -> uvicorn.Config:
    """uvicorn's own options: its fastest event loop and HTTP parser where installed (uvloop, httptools),
    TLS from the settings, no access log (a line per call would cost more than the call), and as long for
    in-flight calls at shutdown as one call may take."""
    import uvicorn

    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=settings.gateway_host,
        port=settings.gateway_port,
        loop="auto",
        http="auto",
        lifespan="on",
        access_log=False,
        log_config=None,
        ssl_certfile=settings.gateway_ssl_certfile,
        ssl_keyfile=settings.gateway_ssl_keyfile,
        timeout_graceful_shutdown=int(settings.gateway_timeout_s) + 1,
    )
