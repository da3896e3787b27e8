"""Shared test fixtures: tiny random-weight models generated once per test session (no downloads)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# Without a GPU, Triton kernels (models/triton_attention.py) run in Triton's interpreter on CPU tensors.
# Triton reads the choice when it is imported, which importing `models` does: so it is made here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Runs under another ATEN_CPU_CAPABILITY (the suite's numerical tests run also with "default" and "avx2",
# which change the kernels' summation orders as another CPU would): inductor's caches key its generated C++
# without that setting, so a kernel written for this CPU's vector ISA would be found in the cache and built
# with the other ISA's flags, and fail to compile. Each capability keeps a cache of its own.
if os.environ.get("ATEN_CPU_CAPABILITY"):
    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR",
        str(Path(tempfile.gettempdir()) / f"torchinductor_{os.getuid()}_{os.environ['ATEN_CPU_CAPABILITY']}"),
    )

from models import write_tiny_model

# The tiers of the suite, one marker each, set here from what a test uses (pyproject.toml lists them):
# - unit: no broker and no worker process; `fast` is the unit tests not marked slow, the edit loop's tier
#   (`./dev.sh test -m fast`);
# - integration: a real broker, a worker in the process or beside it;
# - faults: something breaks on purpose: processes killed, brokers stopped or cut off, poison records;
# - gpu: needs a CUDA device.
_BROKER_FIXTURES = frozenset({"kafka_bootstrap", "broker_pool", "own_broker", "live_worker", "spawn"})
_FAULT_MODULES = frozenset(
    {
        "test_faults",
        "test_faults_inputs",
        "test_faults_restarts",
        "test_broker_failures",
        "test_broker_outage",
        "test_exactly_once",
        "test_graceful_shutdown",
        "test_gpu_faults",
        "test_hosts",
        "test_lifetime",
        "test_supervisor",
    }
)


def tier(item: pytest.Item) -> str:
    """The tier of one test (see above)."""
    module = item.nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
    if item.get_closest_marker("gpu"):
        return "gpu"
    if module in _FAULT_MODULES:
        return "faults"
    if _BROKER_FIXTURES & set(getattr(item, "fixturenames", ())):
        return "integration"
    return "unit"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        name = tier(item)
        item.add_marker(name)
        if name == "unit" and not item.get_closest_marker("slow"):
            item.add_marker("fast")
    items[:] = longest_files_first(items)


def longest_files_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """The files of fault tests first, then those of slow tests, then the rest, each file's tests in their
    order: in several processes (each file whole in one) the longest files start at once instead of
    leaving one process running them at the end."""
    rank: dict[str, tuple[int, int]] = {}
    for index, item in enumerate(items):
        path = item.nodeid.split("::")[0]
        weight = 0 if item.get_closest_marker("faults") else 1 if item.get_closest_marker("slow") else 2
        first = rank.get(path, (weight, index))
        rank[path] = (min(first[0], weight), first[1])
    return sorted(items, key=lambda item: rank[item.nodeid.split("::")[0]])


COMPOSE_TIER_SCOPE = "the files run on the compose file's Kafka"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's file scheduling (`--dist loadfile`), except that the files with tests on the compose
    file's Kafka version (the "kafka-compose" broker tier) go to one process as one unit: each process
    starts a broker of each version it meets, and this one's tests are a few minutes of a long run, so one
    JVM for them instead of one per process saves its start and its idle CPU in the others."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ComposeTierTogether(LoadFileScheduling):
        compose_files: frozenset[str] = frozenset()

        def schedule(self) -> None:
            if self.collection is None and self.registered_collections:
                first = next(iter(self.registered_collections.values()))
                self.compose_files = frozenset(
                    nodeid.split("::", 1)[0] for nodeid in first if "kafka-compose" in nodeid
                )
            super().schedule()

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return COMPOSE_TIER_SCOPE if path in self.compose_files else path

    return ComposeTierTogether(config, log)


@pytest.fixture(scope="session", autouse=True)
def hf_linear_attention_in_torch() -> Iterator[None]:
    """HF's own forward of the hybrid models, the tests' reference, runs HF's torch functions (float32
    arithmetic on any device and transformers version, whether or not flash-linear-attention is installed)."""
    from models.linear_attention import hf_torch_functions

    with hf_torch_functions(load=True):  # before any model is built: their modules imported here
        yield


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LlamaForSequenceClassification (1 label) with its tokenizer."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=0, num_labels=1)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3ForSequenceClassification (head_dim != hidden/heads, q/k norms) with its tokenizer."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", seed=1, num_labels=1)
