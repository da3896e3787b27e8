"""Rewards for RL trainers that call a blocking function: responses grouped by prompt into requests, sent
through one ScoreClient kept on an event loop of its own thread, one number per response back."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from schemas import ScoreRequest, ScoreResult
from worker.client import ScoreClient, new_request_id
from worker.config import ClientEnvironment, security_from_environment

# A prompt as trainers pass it: text, a conversation of {role, content} messages (TRL's conversational
# datasets), or None where the trainer hands over the response alone; a response: text, or the assistant's
# messages.
Prompt = str | Sequence[Mapping[str, Any]] | None
Response = str | Sequence[Mapping[str, Any]]


class RewardError(RuntimeError):
    """A response could not be given a reward: the trainer stops here rather than learn from a made-up one."""


@dataclass(frozen=True)
class RewardBatch:
    """The requests of one call (one per distinct prompt) and where each response's score lies in them."""

    requests: tuple[ScoreRequest, ...]
    places: tuple[tuple[int, int], ...]  # (request, item) of each response, in the caller's order


def group_by_prompt(
    prompts: Sequence[Prompt], responses: Sequence[Response], fields: Mapping[str, Any] | None = None
) -> RewardBatch:
    """One request per distinct prompt, its responses the items: the group of completions GRPO samples for a
    prompt travels together, in one record that carries the prompt once. A text prompt is the
    query (None: the response is scored alone); a conversation goes as `messages`, each response the
    assistant's reply after it. `fields`: more request fields for every request (truncate,
    label_token_ids, apply_softmax, adapter, ...)."""
    if len(prompts) != len(responses):
        raise ValueError(
            f"{len(prompts)} prompts but {len(responses)} responses: send one prompt per response"
        )
    groups: dict[str, tuple[int, Prompt, list[str]]] = {}
    places = []
    for prompt, response in zip(prompts, responses, strict=True):
        key = json.dumps(
            prompt if prompt is None or isinstance(prompt, str) else list(prompt), sort_keys=True
        )
        index, _, items = groups.setdefault(key, (len(groups), prompt, []))
        places.append((index, len(items)))
        items.append(_response_text(response))
    requests = []
    for _, prompt, items in groups.values():
        if prompt is None:
            shape: dict[str, Any] = {}
        elif isinstance(prompt, str):
            shape = {"query": prompt}
        else:
            shape = {"messages": tuple(dict(message) for message in prompt)}
        requests.append(
            ScoreRequest(request_id=new_request_id(), items=tuple(items), **shape, **dict(fields or {}))
        )
    return RewardBatch(tuple(requests), tuple(places))


def _response_text(response: Response) -> str:
    if isinstance(response, str):
        return response
    texts = [message.get("content") for message in response]
    if not all(isinstance(text, str) for text in texts):
        raise ValueError("a response given as messages must have text contents (the assistant's reply)")
    return "".join(str(text) for text in texts)


def rewards_of(batch: RewardBatch, results: Sequence[ScoreResult]) -> list[float]:
    """Each response's reward: its item's first score (the model's one label, or with label_token_ids the
    first label's). An error result raises RewardError with its code and message."""
    for result in results:
        if result.error is not None:
            raise RewardError(
                f"score-worker refused a reward request ({result.error.code.value}): {result.error.message}"
            )
    rewards = []
    for request_index, item_index in batch.places:
        row = results[request_index].scores[item_index]
        if not row:
            raise RewardError("the model gave no score for a response; a reward is one number")
        rewards.append(float(row[0]))
    return rewards


class BlockingScoreClient:
    """A ScoreClient on an event loop of its own daemon thread, started on the first call and reused, for
    callers that block (a trainer's reward function is called from its training loop). Safe to call from
    several threads: calls are coroutines on the one loop."""

    def __init__(
        self, bootstrap_servers: str | Sequence[str], timeout: float = 120.0, **options: Any
    ) -> None:
        self._bootstrap, self._timeout, self._options = bootstrap_servers, timeout, options
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: ScoreClient | None = None

    @classmethod
    def from_environment(cls, timeout: float = 120.0) -> BlockingScoreClient:
        """Bootstrap servers, topics and security from the SCORE_WORKER_* variables the commands read."""
        environment = ClientEnvironment()
        if not environment.bootstrap_servers:
            raise RewardError("SCORE_WORKER_BOOTSTRAP_SERVERS is not set: name the Kafka cluster to score on")
        return cls(
            environment.bootstrap_servers, timeout,
            requests_topic=environment.requests_topic, results_topic=environment.results_topic,
            max_message_bytes=environment.max_record_bytes, compression=environment.requests_compression,
            kafka_options=security_from_environment().kafka_security_kwargs(),
        )  # fmt: skip

    def score(self, requests: Iterable[ScoreRequest]) -> list[ScoreResult]:
        loop, client = self._started()
        future = asyncio.run_coroutine_threadsafe(client.score(list(requests), timeout=self._timeout), loop)
        return future.result()

    def rewards(
        self,
        prompts: Sequence[Prompt],
        responses: Sequence[Response],
        fields: Mapping[str, Any] | None = None,
    ) -> list[float]:
        """One reward per response, scored after its prompt (see group_by_prompt)."""
        batch = group_by_prompt(prompts, responses, fields)
        return rewards_of(batch, self.score(batch.requests))

    def _started(self) -> tuple[asyncio.AbstractEventLoop, ScoreClient]:
        with self._lock:
            if self._loop is None or self._client is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="score-rewards", daemon=True).start()
                client = ScoreClient(self._bootstrap, client_id="score-rewards", **self._options)
                try:
                    asyncio.run_coroutine_threadsafe(client.start(), loop).result()
                except BaseException:
                    loop.call_soon_threadsafe(loop.stop)
                    raise
                self._loop, self._client = loop, client
            return self._loop, self._client

    def close(self) -> None:
        """Stop the client and its loop; a later call starts them again."""
        with self._lock:
            loop, client, self._loop, self._client = self._loop, self._client, None, None
        if loop is None or client is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(client.stop(), loop).result(timeout=30)
        finally:
            loop.call_soon_threadsafe(loop.stop)

    def __enter__(self) -> BlockingScoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
