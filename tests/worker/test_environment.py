"""The process environment beyond WorkerSettings (worker/environment.py): logging, torch's threads, where
Apache Kafka's pom, jars and Java are; each read once and handed down to the code that uses it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from worker.cli import build_parser
from worker.config import read_environment
from worker.environment import KafkaEnvironment, ProcessEnvironment, unknown_variables


def test_logging_variables_any_case_and_their_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCORE_WORKER_LOG_LEVEL", "debug")
    monkeypatch.setenv("SCORE_WORKER_LOG_FORMAT", "JSON")
    monkeypatch.setenv("SCORE_WORKER_LOG_TAG", "gpu1")
    environment = ProcessEnvironment()
    assert (environment.log_level, environment.log_format, environment.log_tag) == ("DEBUG", "json", "gpu1")
    monkeypatch.setenv("SCORE_WORKER_LOG_LEVEL", "loud")
    with pytest.raises(SystemExit, match="SCORE_WORKER_LOG_LEVEL"):
        read_environment(ProcessEnvironment, "run")


def test_the_command_line_takes_its_logging_defaults_from_the_environment_read_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SCORE_WORKER_LOG_LEVEL", "warning")
    monkeypatch.setenv("SCORE_WORKER_LOG_TAG", "host-a")
    args = build_parser(["broker"]).parse_args(["broker"])
    assert args.log_level == "WARNING" and args.log_format == "text"
    assert isinstance(args.environment, ProcessEnvironment) and args.environment.log_tag == "host-a"
    flagged = build_parser(["broker"]).parse_args(["--log-level", "error", "broker"])
    assert flagged.log_level == "ERROR"


@pytest.mark.parametrize(("value", "threads"), [("3", 3), (" 2 ", 2), ("0", None), ("4,2", None), ("", None)])
def test_omp_num_threads_counts_only_as_one_positive_number(
    value: str, threads: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert ProcessEnvironment().omp_threads == threads


def test_kafka_paths_from_their_variables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("SCORE_WORKER_KAFKA_POM", "SCORE_WORKER_KAFKA_CACHE", "XDG_CACHE_HOME", "JAVA_HOME"):
        monkeypatch.delenv(name, raising=False)
    assert KafkaEnvironment().cache_root == Path.home() / ".cache" / "score-worker" / "kafka"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("JAVA_HOME", "")  # set but empty: as if unset
    environment = KafkaEnvironment()
    assert environment.cache_root == tmp_path / "xdg" / "score-worker" / "kafka"
    assert environment.java_home is None and environment.kafka_pom is None
    monkeypatch.setenv("SCORE_WORKER_KAFKA_CACHE", str(tmp_path / "jars"))
    monkeypatch.setenv("SCORE_WORKER_KAFKA_POM", str(tmp_path / "pom.xml"))
    environment = KafkaEnvironment()
    assert environment.cache_root == tmp_path / "jars" and environment.kafka_pom == tmp_path / "pom.xml"


def test_a_missing_pom_named_by_its_variable_is_refused(tmp_path: Path) -> None:
    from worker.apache_kafka import KafkaUnavailable, repository_pom

    with pytest.raises(KafkaUnavailable, match="SCORE_WORKER_KAFKA_POM"):
        repository_pom(KafkaEnvironment(kafka_pom=tmp_path / "none.xml"))


def test_the_variables_of_the_environment_layer_are_known_to_the_worker() -> None:
    environ = {f"SCORE_WORKER_{name}": "x" for name in ("KAFKA_CACHE", "KAFKA_POM", "LOG_TAG", "LOG_LEVEL")}
    assert unknown_variables(environ | {"SCORE_WORKER_KAFKA_CASH": "x"}) == ["SCORE_WORKER_KAFKA_CASH"]


def test_tensor_parallel_followers_on_the_cpu_get_the_leaders_threads_at_most_their_share_of_the_cores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from models.parallel import GroupSpec, _follower_threads

    spec = GroupSpec(2, 0, str(tmp_path), {"device": "cpu"})
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)
    assert _follower_threads(spec) == max(1, len(os.sched_getaffinity(0)) // 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert _follower_threads(spec) == 1
