"""The RL trainer recipes of examples/, run against a real broker and a worker with a tiny reward model: TRL's
GRPOTrainer training a step with the reward function of examples/trl_reward.py, and verl's custom reward
functions loaded from their file and called as verl's reward managers call them; every reward checked
against the same request sent over Kafka through ScoreClient."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from conftest import serving
from gateway_kit import assert_alike, one
from worker_testkit import LiveWorker, own_cluster_security

from models import write_tiny_model
from schemas import ErrorCode
from worker.config import ENV_PREFIX, KafkaSecurity
from worker.rewards import BlockingScoreClient, RewardError, group_by_prompt

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PROMPT = "Question: what is two plus two?\nAnswer:"
RESPONSES = [" 4", " It is four.", " 5"]


@pytest.fixture(scope="module")
def worker(kafka_bootstrap: str, tiny_llama_dir: Path) -> Iterator[LiveWorker]:
    yield from serving(kafka_bootstrap, tiny_llama_dir)


@pytest.fixture
def cluster_env(worker: LiveWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SCORE_WORKER_* variables a trainer's process would be given to reach the worker."""
    values = {
        "bootstrap_servers": worker.bootstrap,
        "requests_topic": worker.names.requests,
        "results_topic": worker.names.results,
        **own_cluster_security(worker.bootstrap),
    }
    for name, value in values.items():
        monkeypatch.setenv(f"{ENV_PREFIX}{name.upper()}", str(value))


@pytest.fixture
def client(worker: LiveWorker) -> Iterator[BlockingScoreClient]:
    security = KafkaSecurity(**own_cluster_security(worker.bootstrap)).kafka_security_kwargs()
    with BlockingScoreClient(
        worker.bootstrap, requests_topic=worker.names.requests, results_topic=worker.names.results,
        kafka_options=security,
    ) as blocking:  # fmt: skip
        yield blocking


@pytest.fixture
def examples() -> Iterator[dict[str, ModuleType]]:
    """The example modules a test loads, their Kafka clients closed when it ends."""
    loaded: dict[str, ModuleType] = {}
    yield loaded
    for module in loaded.values():
        module.close()


def load_by_path(name: str) -> ModuleType:
    """An example module loaded from its file, as verl loads a custom reward function (and as a user's
    training script imports a file beside it): under a name of its own, not as a package module."""
    spec = importlib.util.spec_from_file_location(f"custom_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def assert_rewards_alike(worker: LiveWorker, prompt: str | None, responses: list[str], rewards: Any) -> None:
    """Rewards against the direct scores of the same prompt and responses (one request; the bound of two
    forward passes, tests/tolerances.py)."""
    query = {} if prompt is None else {"query": prompt}
    request, expected = one(worker, items=tuple(responses), **query)
    assert all(isinstance(reward, float) for reward in rewards)
    assert_alike(worker, request, expected, [[reward] for reward in rewards])


def test_trl_grpo_trainer_trains_a_step_on_the_workers_rewards(
    worker: LiveWorker, client: BlockingScoreClient, tmp_path: Path
) -> None:
    """TRL's own GRPOTrainer calls the reward function (a tiny random policy generates the completions); what
    it was handed and what it returned are recorded on the way and checked against the worker directly."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    trl_reward = load_by_path("trl_reward")
    reward_fn = trl_reward.make_reward_fn(client)
    calls: list[tuple[list[str], list[str], list[float]]] = []

    def recorded(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        rewards: list[float] = reward_fn(prompts, completions, **kwargs)
        calls.append((prompts, completions, rewards))
        return rewards

    recorded.__name__ = reward_fn.__name__
    policy = write_tiny_model(tmp_path / "policy", "llama", seed=4, judge=True)
    config = GRPOConfig(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, num_generations=2,
        max_completion_length=4, max_steps=1, report_to=[], use_cpu=True, save_strategy="no", bf16=False,
        logging_steps=1,
    )  # fmt: skip
    prompts = Dataset.from_dict({"prompt": [PROMPT, "Name a colour:"]})
    trainer = GRPOTrainer(model=str(policy), reward_funcs=recorded, args=config, train_dataset=prompts)
    trainer.train()
    assert calls, "GRPOTrainer never called the reward function"
    for prompts_seen, completions, rewards in calls:
        assert len(rewards) == len(completions) == len(prompts_seen)
        for prompt in set(prompts_seen):
            mine = [index for index, seen in enumerate(prompts_seen) if seen == prompt]
            group = [completions[index] for index in mine]
            assert_rewards_alike(worker, prompt, group, [rewards[index] for index in mine])
    logged = [entry for entry in trainer.state.log_history if "rewards/score_worker/mean" in entry]
    assert logged, trainer.state.log_history


def test_trl_reward_fn_from_the_environment_with_conversations(
    worker: LiveWorker, cluster_env: None, examples: dict[str, ModuleType]
) -> None:
    """The module's own reward_fn (its client from SCORE_WORKER_* variables) on TRL's conversational form:
    prompts as message lists, completions as the assistant's messages."""
    trl_reward = examples["trl"] = load_by_path("trl_reward")
    conversation = [{"role": "user", "content": "What is two plus two?"}]
    completions = [[{"role": "assistant", "content": text}] for text in RESPONSES]
    rewards = trl_reward.reward_fn(prompts=[conversation] * 3, completions=completions, trainer_state=None)
    request, expected = one(worker, messages=tuple(conversation), items=tuple(RESPONSES))
    assert_alike(worker, request, expected, [[reward] for reward in rewards])
    text_rewards = trl_reward.reward_fn(prompts=[PROMPT] * 3, completions=RESPONSES)
    assert_rewards_alike(worker, PROMPT, RESPONSES, text_rewards)


def test_verl_compute_score_as_its_naive_reward_manager_calls_it(
    worker: LiveWorker, cluster_env: None, examples: dict[str, ModuleType]
) -> None:
    """verl's naive reward manager calls compute_score by keyword, one response a call, from executor
    threads at once; the prompt comes from the dataset's extra_info."""
    verl_reward = examples["verl"] = load_by_path("verl_reward")

    def call(index: int, text: str) -> float:
        reward: float = verl_reward.compute_score(
            data_source="openai/gsm8k", solution_str=text, ground_truth="4",
            extra_info={"question": PROMPT, "index": index, "num_turns": None},
        )  # fmt: skip
        return reward

    async def rollout() -> list[float]:
        loop = asyncio.get_running_loop()
        calls = [loop.run_in_executor(None, call, index, text) for index, text in enumerate(RESPONSES)]
        return list(await asyncio.gather(*calls))

    rewards = asyncio.run(rollout())
    for text, reward in zip(RESPONSES, rewards, strict=True):
        assert_rewards_alike(worker, PROMPT, [text], [reward])


def test_verl_compute_score_batch_as_its_batch_reward_manager_calls_it(
    worker: LiveWorker, cluster_env: None, examples: dict[str, ModuleType]
) -> None:
    verl_reward = examples["verl"] = load_by_path("verl_reward")
    extra_infos = [{"question": PROMPT}, {"prompt": "Name a colour:"}, None]
    rewards = verl_reward.compute_score_batch(
        data_sources=["a", "b", "c"], solution_strs=RESPONSES, ground_truths=[None, None, None],
        extra_infos=extra_infos,
    )  # fmt: skip
    assert len(rewards) == 3
    assert_rewards_alike(worker, PROMPT, [RESPONSES[0]], rewards[:1])
    assert_rewards_alike(worker, "Name a colour:", [RESPONSES[1]], rewards[1:2])
    assert_rewards_alike(worker, None, [RESPONSES[2]], rewards[2:])


def test_responses_of_one_prompt_travel_in_one_request() -> None:
    batch = group_by_prompt([PROMPT, "other", PROMPT, None], ["a", "b", "c", "d"])
    assert [request.items for request in batch.requests] == [("a", "c"), ("b",), ("d",)]
    assert [request.query for request in batch.requests] == [PROMPT, "other", None]
    assert batch.places == ((0, 0), (1, 0), (0, 1), (2, 0))
    with pytest.raises(ValueError, match="one prompt per response"):
        group_by_prompt([PROMPT], ["a", "b"])


def test_a_refused_request_stops_the_trainer_with_its_code(client: BlockingScoreClient) -> None:
    """No made-up reward: an error result raises, naming its stable code."""
    with pytest.raises(RewardError, match=ErrorCode.LABEL_IDS_NOT_SUPPORTED.value):
        client.rewards([PROMPT], [" 4"], {"label_token_ids": (1, 2)})  # a classifier has no label tokens
