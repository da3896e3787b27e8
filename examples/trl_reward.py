"""A reward function for TRL's GRPOTrainer, scored by score-worker over Kafka.

    from trl import GRPOConfig, GRPOTrainer
    from trl_reward import reward_fn

    trainer = GRPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=reward_fn,
                          args=GRPOConfig(...), train_dataset=dataset)

The cluster comes from the variables `score-worker submit` reads: SCORE_WORKER_BOOTSTRAP_SERVERS, and
SCORE_WORKER_REQUESTS_TOPIC, SCORE_WORKER_RESULTS_TOPIC and the SCORE_WORKER_SECURITY_* ones where not the
defaults. TRL calls the function once per generation batch; the completions of one prompt go to the worker
as one request (the prompt read once), and a conversational dataset's prompts go as chat messages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from worker.rewards import BlockingScoreClient, Prompt, Response

RewardFunction = Callable[..., list[float]]


def make_reward_fn(
    client: BlockingScoreClient, fields: Mapping[str, Any] | None = None, name: str = "score_worker"
) -> RewardFunction:
    """A reward function on `client`; `fields` go into every request (e.g. {"truncate": "query_left"}).
    TRL logs each reward function's rewards under its __name__."""

    def reward_fn(prompts: Sequence[Prompt], completions: Sequence[Response], **kwargs: Any) -> list[float]:
        # kwargs: the dataset's other columns and TRL's trainer_state, log_extra, log_metric; a reward model
        # reads the prompt and the completion alone.
        return client.rewards(prompts, completions, fields)

    reward_fn.__name__ = name
    return reward_fn


_shared: dict[str, BlockingScoreClient] = {}


def reward_fn(prompts: Sequence[Prompt], completions: Sequence[Response], **kwargs: Any) -> list[float]:
    """The reward function on the cluster the environment names (its client made on the first call)."""
    if "client" not in _shared:
        _shared["client"] = BlockingScoreClient.from_environment()
    return _shared["client"].rewards(prompts, completions)


def close() -> None:
    """Stop the Kafka client of reward_fn, if one was made (at the end of training)."""
    if "client" in _shared:
        _shared.pop("client").close()
