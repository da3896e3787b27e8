"""verl custom reward functions, scored by score-worker over Kafka. In verl's configuration:

    reward.custom_reward_function.path=examples/verl_reward.py
    reward.custom_reward_function.name=compute_score

(verl 0.9; earlier releases name them custom_reward_function.path and custom_reward_function.name).

`compute_score` is verl's per-response signature (its naive reward manager calls it, from several threads
at once: the calls share one Kafka client and are batched on the way). `compute_score_batch` is the form of
verl's batch reward manager (reward_model.reward_manager=batch): one call per training batch.

verl hands over the decoded response alone. A reward model reads the prompt too, so it is taken from the
dataset's extra_info: its "prompt", else its "question" (the key verl's own data preprocessing writes);
without either the response is scored alone. The cluster comes from SCORE_WORKER_BOOTSTRAP_SERVERS and the
other variables `score-worker submit` reads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from worker.rewards import BlockingScoreClient

_shared: dict[str, BlockingScoreClient] = {}


def client() -> BlockingScoreClient:
    """The one client of this process, made from the environment on the first call."""
    if "client" not in _shared:
        _shared["client"] = BlockingScoreClient.from_environment()
    return _shared["client"]


def prompt_of(extra_info: Mapping[str, Any] | None) -> str | None:
    for key in ("prompt", "question"):
        value = (extra_info or {}).get(key)
        if isinstance(value, str):
            return value
    return None


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> float:  # fmt: skip
    """One response's reward. ground_truth and data_source are not read (a reward model judges the text);
    kwargs: verl's reward_kwargs and reward-router arguments, not used."""
    (reward,) = client().rewards([prompt_of(extra_info)], [solution_str])
    return reward


def compute_score_batch(
    data_sources: Sequence[str], solution_strs: Sequence[str], ground_truths: Sequence[Any],
    extra_infos: Sequence[Mapping[str, Any] | None], **kwargs: Any,
) -> list[float]:  # fmt: skip
    """A batch's rewards, in its order."""
    return client().rewards([prompt_of(info) for info in extra_infos], list(solution_strs))


def close() -> None:
    """Stop this process's Kafka client, if one was made."""
    if "client" in _shared:
        _shared.pop("client").close()
