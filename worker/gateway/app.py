"""The gateway's Starlette application: routes in each reference's shape, Bearer keys, body and call limits,
its own metrics, and the Kafka bridge started and stopped with the application."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from schemas import ErrorCode
from worker.environment import GatewaySettings
from worker.gateway import compare, openrlhf, rerank, sglang, vllm
from worker.gateway.bodies import parse_body, read_body, render
from worker.gateway.bridge import RETRY_AFTER_S, KafkaBridge
from worker.gateway.calls import Body, Call
from worker.gateway.errors import GatewayCode, GatewayError
from worker.gateway.metrics import GatewayMetrics
from worker.gateway.shapes import created

log = logging.getLogger(__name__)

Handler = Callable[[Body, Call], Awaitable[dict[str, Any]]]
TIMEOUT_HEADER = "x-request-timeout"  # seconds a caller will wait, at most the gateway's own timeout

# Route path, name in the metrics, handler.
SCORING_ROUTES: tuple[tuple[str, str, Handler], ...] = (
    ("/v1/score", "sglang_score", sglang.score),
    ("/classify", "classify", vllm.classify),
    ("/pooling", "pooling", vllm.pooling),
    ("/score", "score", vllm.score),
    ("/v1/rerank", "rerank", rerank.rerank),
    ("/v2/rerank", "rerank", rerank.rerank),
    ("/get_reward", "get_reward", openrlhf.get_reward),
    ("/v1/compare", "compare", compare.compare),
)


class Gateway:
    """Everything a call needs, built once at start-up."""

    def __init__(self, settings: GatewaySettings, kafka_options: dict[str, Any] | None = None) -> None:
        self.settings = settings
        self.metrics = GatewayMetrics()
        self.bridge = KafkaBridge(settings, self.metrics, kafka_options)
        self._keys = tuple(key.encode() for key in settings.api_keys())
        self._labels = tuple(label.strip() for label in settings.gateway_labels.split(",") if label.strip())
        # Calls being read, waiting on Kafka or answered: with the body cap, this bounds the gateway's memory.
        self.in_flight = 0
        self.metrics.in_flight.set_function(lambda: self.in_flight)  # read at scrape time: no lock per call

    def endpoint(self, route: str, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        """The HTTP endpoint of one scoring handler, counted in the metrics under `route`."""

        async def serve(request: Request) -> Response:
            started = time.perf_counter()
            if self.in_flight >= self.settings.gateway_max_calls:  # refused before its body is read
                response = error_response(self._too_many(), request.headers.get("accept"))
            else:
                self.in_flight += 1
                try:
                    response = await self._answer(request, handler)
                finally:
                    self.in_flight -= 1
            self.metrics.observe(route, response.status_code, time.perf_counter() - started)
            return response

        return serve

    async def _answer(self, request: Request, handler: Handler) -> Response:
        accept = request.headers.get("accept")
        try:
            self.authorize(request)
            timeout_s, begun = self._timeout(request), time.monotonic()
            raw = await self._read(request, timeout_s)
            body = parse_body(raw, request.headers.get("content-type"))
            remaining_s = timeout_s - (time.monotonic() - begun)
            call = Call(self.bridge, remaining_s, self.settings.gateway_max_items, self._labels)
            return render(await handler(body, call), accept)
        except GatewayError as error:
            return error_response(error, accept)
        except Exception:  # a fault of the gateway itself: answered, logged, never a dropped connection
            log.exception("a call to %s failed", request.url.path)
            failure = GatewayError(500, ErrorCode.INTERNAL_ERROR.value, "the gateway failed on this call")
            return error_response(failure, accept)

    async def _read(self, request: Request, timeout_s: float) -> bytes:
        """The body, within the call's deadline: a client that sends it too slowly would otherwise hold one
        of gateway_max_calls for as long as it liked (uvicorn has no timeout for a body)."""
        try:
            async with asyncio.timeout(timeout_s):
                return await read_body(request, self.settings.gateway_max_body_bytes)
        except TimeoutError:
            raise GatewayError(
                408,
                GatewayCode.READ_TIMEOUT,
                f"the body did not arrive within the call's deadline ({timeout_s:.3g} s)",
            ) from None

    def _too_many(self) -> GatewayError:
        return GatewayError(
            429, GatewayCode.TOO_MANY_CALLS,
            f"{self.in_flight} calls are already in flight (gateway_max_calls); retry later", RETRY_AFTER_S,
        )  # fmt: skip

    def authorize(self, request: Request) -> None:
        """Nothing to check without keys; else the Bearer key must be one of them (compared in constant
        time). The key itself is never logged nor echoed."""
        if not self._keys:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        token = given.strip().encode()
        # Every key is compared, so the time taken does not tell which one came close.
        matched = [hmac.compare_digest(token, key) for key in self._keys]
        if scheme.lower() != "bearer" or not any(matched):
            raise GatewayError(
                401, GatewayCode.UNAUTHORIZED, "a valid API key is required: Authorization: Bearer <key>"
            )

    def _timeout(self, request: Request) -> float:
        limit = self.settings.gateway_timeout_s
        asked = request.headers.get(TIMEOUT_HEADER)
        if asked is None:
            return limit
        try:
            seconds = float(asked)
        except ValueError:
            seconds = float("nan")
        if not seconds > 0:  # NaN too
            raise GatewayError(400, ErrorCode.INVALID_REQUEST.value, f"{TIMEOUT_HEADER} must be seconds > 0")
        return min(seconds, limit)

    async def health(self, request: Request) -> Response:
        """200 while a worker answers (an empty body, as vLLM and SGLang answer), else 503."""
        if self.bridge.answering:
            return Response(b"", 200)
        error = GatewayError(503, GatewayCode.NO_WORKER, "no worker has answered this gateway yet or lately")
        return error_response(error, request.headers.get("accept"))

    async def models(self, request: Request) -> Response:
        try:
            self.authorize(request)
        except GatewayError as error:
            return error_response(error, request.headers.get("accept"))
        cards = []
        if self.bridge.model:
            card = {
                "id": self.bridge.model,
                "object": "model",
                "created": created(),
                "owned_by": "score-worker",
            }
            cards.append({**card, "root": None, "parent": None, "max_model_len": None})
        return render({"object": "list", "data": cards}, request.headers.get("accept"))

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.exposition(), media_type=self.metrics.content_type)

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.bridge.start()
        try:
            yield
        finally:
            await self.bridge.stop()


def error_response(error: GatewayError, accept: str | None) -> Response:
    headers = None
    if error.retry_after_s is not None:
        headers = {"retry-after": str(max(1, round(error.retry_after_s)))}
    if error.status == 401:
        headers = {"www-authenticate": "Bearer"}
    return render(error.body(), accept, error.status, headers)


async def _not_found(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 404
    message = f"{request.method} {request.url.path} is not a route of this gateway"
    return error_response(GatewayError(status, GatewayCode.NOT_FOUND, message), request.headers.get("accept"))


Endpoint = Callable[[Request], Awaitable[Response]]


class ScoringDispatch:
    """The scoring routes served straight from the ASGI scope, past Starlette's router and its middleware
    layers (a fifth of the gateway's CPU for a small call, as profiled); any other path or method, and the
    lifespan, go to the Starlette application, which has the same routes and answers them the same way."""

    def __init__(self, app: ASGIApp, endpoints: dict[str, Endpoint]) -> None:
        self._app = app
        self._endpoints = endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # A root path (a proxy's prefix) is left to Starlette, which strips it before matching.
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            endpoint = self._endpoints.get(scope["path"])
            if endpoint is not None:  # it answers every call itself, errors included (Gateway._answer)
                response = await endpoint(Request(scope, receive))
                await response(scope, receive, send)
                return
        await self._app(scope, receive, send)


def build_app(gateway: Gateway) -> ScoringDispatch:
    """The application: scoring routes (POST), models (GET, behind the keys), health and metrics (GET, open
    to probes and scrapers)."""
    endpoints = {path: gateway.endpoint(name, handler) for path, name, handler in SCORING_ROUTES}
    routes = [Route(path, endpoint, methods=["POST"]) for path, endpoint in endpoints.items()]
    routes += [
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/metrics", gateway.prometheus, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes, lifespan=gateway.lifespan, exception_handlers={404: _not_found, 405: _not_found}
    )
    return ScoringDispatch(app, endpoints)
