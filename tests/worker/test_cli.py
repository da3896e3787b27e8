"""The score-worker command line: help, subcommand dispatch, unavailable commands, bad model directories."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from worker import cli


def test_help_lists_every_command() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "worker", "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    for command in ("run", "submit", "demo", "make-tiny-model"):
        assert command in proc.stdout


def test_run_flags_mirror_settings_but_not_secrets() -> None:
    parser = argparse.ArgumentParser()
    cli.add_run_arguments(parser)
    args = parser.parse_args(["--model", "/m", "--max-wait-ms", "3", "--no-create-topics"])
    assert (args.model_dir, args.max_wait_ms, args.create_topics) == ("/m", "3", False)
    assert args.group_id is None  # unset flags leave the environment and defaults in charge
    with pytest.raises(SystemExit):
        parser.parse_args(["--sasl-password", "x"])


def test_external_command_is_imported_only_when_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("fake_cmd")
    calls: list[argparse.Namespace] = []

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--count", type=int, default=1)

    def run(args: argparse.Namespace) -> int:
        calls.append(args)
        return 5

    fake.add_arguments = add_arguments  # type: ignore[attr-defined]
    fake.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_cmd", fake)
    monkeypatch.setitem(cli.EXTERNAL_COMMANDS, "submit", ("fake_cmd", "fake"))
    monkeypatch.setitem(cli.EXTERNAL_COMMANDS, "demo", ("no_such_module_anywhere", "missing"))
    assert cli.main(["--log-level", "warning", "submit", "--count", "3"]) == 5
    assert calls[0].count == 3
    # The missing "demo" module does not matter until demo itself is asked for.
    assert cli.main(["demo"]) == 1


def test_unloadable_model_dir_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text("{}")
    code = cli.main(
        ["run", "--model", str(tmp_path), "--bootstrap-servers", "127.0.0.1:1", "--device", "cpu"]
    )
    assert code == 2
    assert "cannot load the model" in capsys.readouterr().err


def test_json_logs_are_one_object_per_line_with_the_exception() -> None:
    import json
    import logging
    import sys
    import time

    from worker.cli import JsonLogFormatter

    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord(
            "worker.app", logging.ERROR, __file__, 1, "batch %d failed", (7,), sys.exc_info()
        )
    line = JsonLogFormatter().format(record)
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["level"] == "ERROR" and entry["logger"] == "worker.app"
    assert entry["message"] == "batch 7 failed"
    assert "ValueError: boom" in entry["exception"]
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    assert entry["time"].startswith(stamp) and entry["time"].endswith("Z")  # UTC whatever the local zone


def test_run_refuses_to_start_when_the_self_check_fails(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from models import attention

    original = attention.attend_causal

    def off_by_a_little(*args: object, **kwargs: object) -> torch.Tensor:
        return original(*args, **kwargs) * 1.05  # type: ignore[arg-type]

    monkeypatch.setattr(attention, "attend_causal", off_by_a_little)
    # The broker is never reached: the check runs right after loading, before the consumer starts.
    argv = [
        "run",
        "--model",
        str(tiny_llama_dir),
        "--bootstrap-servers",
        "127.0.0.1:9",
        "--metrics-port",
        "0",
    ]
    assert cli.main(argv) == cli.EXIT_USAGE
    assert "self-check failed" in capsys.readouterr().err


def test_run_help_lists_the_security_flags_and_never_a_secret_from_the_environment() -> None:
    secrets = {
        "SCORE_WORKER_SASL_PASSWORD": "s3cret-sasl-pw",
        "SCORE_WORKER_SSL_KEY_PASSWORD": "s3cret-key-pw",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "worker", "run", "--help"],
        capture_output=True, text=True, timeout=60, check=False, env={**os.environ, **secrets},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for flag in ("--ssl-certfile", "--ssl-keyfile", "--no-ssl-check-hostname", "--allow-pickle-weights"):
        assert flag in proc.stdout
    assert "--sasl-password" not in proc.stdout and "--ssl-key-password" not in proc.stdout
    assert not any(value in proc.stdout + proc.stderr for value in secrets.values())
    # The connection settings lead; the security ones follow the rest.
    assert proc.stdout.index("--bootstrap-servers") < proc.stdout.index("--security-protocol")


@pytest.fixture
def built_configs(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The ScorerConfig of every Scorer the CLI builds from here on (no model is loaded)."""
    import models

    built: list[models.ScorerConfig] = []

    class Recording:
        def __init__(self, model_dir: object, config: models.ScorerConfig) -> None:
            built.append(config)

    monkeypatch.setattr(models, "Scorer", Recording)
    return built


def test_every_engine_setting_reaches_the_scorer(tiny_llama_dir: Path, built_configs: list[Any]) -> None:
    """The engine settings given to the worker are the ones the Scorer is built with: none dropped."""
    from worker.config import WorkerSettings

    settings = WorkerSettings(
        bootstrap_servers="127.0.0.1:9",
        model_dir=tiny_llama_dir,
        self_check=False,
        warm_up=False,
        device="cpu",
        dtype="bfloat16",
        max_batch_tokens=1234,
        pooling="mean",
        deterministic=True,
        compile="off",
        cuda_graphs="off",
        graph_max_tokens=512,
        share_prefix_min_tokens=48,
        quantization="fp8",
        max_item_tokens=300,
        max_request_items=7,
        max_request_tokens=999,
        trust_remote_code=True,
        allow_pickle_weights=True,
    )
    cli._load_scorer(settings)
    (config,) = built_configs
    assert (config.device, config.dtype, config.max_batch_tokens, config.pooling) == (
        "cpu",
        "bfloat16",
        1234,
        "mean",
    )
    assert (config.deterministic, config.compile, config.cuda_graphs, config.graph_tokens) == (
        True,
        "off",
        "off",
        512,
    )
    assert (config.share_prefix_min_tokens, config.quantization) == (48, "fp8")
    assert (config.max_item_tokens, config.max_request_items, config.max_request_tokens) == (300, 7, 999)
    assert config.trust_remote_code and config.allow_pickle_weights
    # Every engine setting, those added later included: the engine's config holds the worker's value.
    from models import EngineSettings

    assert {name: getattr(config, name) for name in EngineSettings.model_fields} == settings.engine_settings()


def test_cuda_graphs_cover_the_whole_batch_budget_unless_told_otherwise(
    tiny_llama_dir: Path, built_configs: list[Any]
) -> None:
    from worker.config import WorkerSettings

    for given, expected in ((None, 16384), (4096, 4096)):
        settings = WorkerSettings(
            bootstrap_servers="127.0.0.1:9",
            model_dir=tiny_llama_dir,
            self_check=False,
            warm_up=False,
            max_batch_tokens=16384,
            graph_max_tokens=given,
        )
        cli._load_scorer(settings)
        assert built_configs[-1].graph_tokens == expected
