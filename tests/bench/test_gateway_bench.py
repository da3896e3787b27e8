"""bench/gateway.py: its smoke run on the CPU (embedded broker, a real worker, the stub, the gateway and the
driver in processes of their own), and its verdict failing a run whose timed calls were answered wrong."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from scripts import ROOT, run_script

pytest.importorskip("aiokafka", reason="the gateway and ScoreClient need aiokafka")
pytest.importorskip("uvicorn", reason="the gateway needs the gateway extra")
sys.path.insert(0, str(ROOT))

from bench.gateway import compare_forwards, stub_score, verdict


def report(**changes: Any) -> dict[str, Any]:
    fine = {"calls": 10, "wrong_count": 0, "wrong": []}
    through = {"client": dict(fine), "gateway": {**fine, "statuses": {"200": 10}}}
    base = {"one_in_flight": {"check": {"ok": True}}, "throughput": through}
    for path, value in changes.items():
        node = base
        *parents, last = path.split(".")
        for parent in parents:
            node = node[parent]
        node[last] = value
    return base


def test_the_verdict_fails_calls_answered_wrong_or_not_at_all() -> None:
    assert verdict(report()) == []
    assert verdict(report(**{"one_in_flight.check": {"ok": False}}))
    assert verdict(report(**{"throughput.gateway.wrong_count": 1}))
    assert verdict(report(**{"throughput.client.calls": 0}))
    assert verdict(report(**{"throughput.gateway.statuses": {"200": 9, "503": 1}}))


def test_scores_through_both_paths_must_be_equal() -> None:
    assert compare_forwards([[[0.25]]], [[[0.25]]])["ok"]
    assert not compare_forwards([[[0.25]]], [[[0.25 + 2**-40]]])["ok"]
    assert not compare_forwards([[[0.25]]], [None])["ok"]
    assert stub_score([1, 2, 3]) == 6 / 9973


@pytest.mark.slow
def test_gateway_benchmark_quick_run_checks_what_it_timed(tmp_path: Path) -> None:
    """A few seconds of each phase: every call answered and checked, the figures and goals reported."""
    proc = run_script(["bench/gateway.py", "--quick", "--connections", "16"], tmp_path, 600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "gateway-quick.json").read_text())
    assert result["verdict"] == "ok"
    assert result["one_in_flight"]["check"]["ok"] and result["one_in_flight"]["check"]["calls"] == 40
    assert result["throughput"]["gateway"]["calls"] > 0 and result["throughput"]["client"]["calls"] > 0
    assert set(result["goals"]) == {"extra_p50_ms", "gateway_calls_per_s"}
