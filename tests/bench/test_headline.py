"""bench/headline.py's own rules, without a model: a phase past its budget is cut and the run goes on, a
phase whose check failed is wrong (and fails the run), one that raised is an error, the report and its
Markdown rows are rewritten whole after each phase, and --compare flags only moves beyond the noise."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from bench import headline
from bench.headline_kit import Context, check, compare, figure, markdown_rows, ratio, spread


def _ctx(tmp_path: Path) -> Context:
    return Context(device="cpu", quick=True, workdir=tmp_path)


def _slow(ctx: Context) -> dict[str, Any]:
    try:
        time.sleep(30)
    except Exception:  # as the engine answers a failed batch: by scoring it again, in halves
        time.sleep(30)
    return {"figures": {}, "checks": {"never": check(True)}}


def _wrong(ctx: Context) -> dict[str, Any]:
    return {"figures": {"rate": figure(5.0, "tokens/s", [5.0, 4.0])}, "checks": {"vs float32": check(False)}}


def _raises(ctx: Context) -> dict[str, Any]:
    raise RuntimeError("no such kernel")


def _fine(ctx: Context) -> dict[str, Any]:
    return {"figures": {"rate": figure(5.0, "tokens/s", [5.0, 4.0])}, "checks": {"vs float32": check(True)}}


def test_a_phase_past_its_budget_is_cut_and_a_failed_check_makes_it_wrong(tmp_path: Path) -> None:
    """The cut gets through a phase's own handlers of errors; a failed check, or none, is wrong."""
    started = time.monotonic()
    cut = headline.run_phase(headline.Phase("slow", "slow", 0.3, _slow), _ctx(tmp_path), 0.3)
    assert cut["status"] == "cut" and time.monotonic() - started < 10
    wrong = headline.run_phase(headline.Phase("wrong", "wrong", 5, _wrong), _ctx(tmp_path), 5)
    assert wrong["status"] == "wrong" and wrong["failed_checks"] == ["vs float32"]
    error = headline.run_phase(headline.Phase("raises", "raises", 5, _raises), _ctx(tmp_path), 5)
    assert error["status"] == "error" and "no such kernel" in error["error"]
    fine = headline.run_phase(headline.Phase("fine", "fine", 5, _fine), _ctx(tmp_path), 5)
    assert fine["status"] == "ok"
    report = {"phases": {"slow": cut, "wrong": wrong, "raises": error, "fine": fine}}
    # Cut phases are missing figures, not wrong ones: the verdict names the wrong and the raised only.
    assert [f.split(":")[0] for f in headline.verdict(report)] == ["wrong", "raises"]
    assert headline.verdict({"phases": {"slow": cut, "fine": fine}}) == "ok"


def _sleeps(seconds: float) -> Any:
    def run(ctx: Context) -> dict[str, Any]:
        time.sleep(seconds)
        return _fine(ctx)

    return run


def test_a_phase_may_overrun_its_budget_by_half_while_the_run_has_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slower host's phase that needs a little more than its budget finishes (the first, most important
    phases are not the ones a slow host loses); one that needs far more is cut at OVERRUN times it."""
    monkeypatch.setattr(headline, "report_header", lambda args: {"environment": {"date_utc": "2026-12-07"}})
    budget = 1.0  # seconds of the quick run, whose budgets are QUICK_SCALE times the table's
    phases = (
        headline.Phase("over", "a little over", budget / headline.QUICK_SCALE, _sleeps(1.25 * budget)),
        headline.Phase("hangs", "far over", budget / headline.QUICK_SCALE, _sleeps(30)),
    )
    monkeypatch.setattr(headline, "PHASES", phases)
    target = tmp_path / "h.json"
    started = time.monotonic()
    assert headline.main(["--quick", "--json", str(target)]) == 0
    report = json.loads(target.read_text())
    assert report["phases"]["over"]["status"] == "ok"
    assert report["phases"]["hangs"]["status"] == "cut"
    assert report["phases"]["hangs"]["seconds"] < headline.OVERRUN * budget + 1
    assert time.monotonic() - started < 20


def test_the_run_writes_its_report_after_every_phase_and_exits_1_on_a_wrong_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written: list[list[str]] = []
    target = tmp_path / "h.json"

    def record(path: Path, text: str) -> None:
        path.write_text(text)
        if path == target:
            written.append(list(json.loads(text)["phases"]))

    monkeypatch.setattr(headline, "write_atomic", record)
    monkeypatch.setattr(headline, "report_header", lambda args: {"environment": {"date_utc": "2026-12-07"}})
    phases = (
        headline.Phase("fine", "a fine phase", 5, _fine),
        headline.Phase("wrong", "a wrong phase", 5, _wrong),
        headline.Phase("also", "another fine phase", 5, _fine),
    )
    monkeypatch.setattr(headline, "PHASES", phases)
    assert headline.main(["--quick", "--json", str(target)]) == 1
    assert written[:3] == [["fine"], ["fine", "wrong"], ["fine", "wrong", "also"]]
    rows = (tmp_path / "h.md").read_text()
    assert "| a fine phase: rate | **5 tokens/s**" in rows and "| a wrong phase | **wrong**" in rows


def test_compare_flags_only_moves_beyond_the_noise() -> None:
    def report(rate: float, latency: float, noise: float) -> dict[str, Any]:
        figures = {
            "rate": figure(rate, "tokens/s", [rate, rate * (1 - noise)]),
            "latency": figure(latency, "ms", higher_is_better=False, noise=noise),
        }
        return {"phases": {"w1": {"figures": figures}}}

    old = report(100.0, 10.0, 0.02)  # 2% spread: moves beyond 4% are flagged
    lines, flagged = compare(report(97.0, 10.3, 0.01), old)
    assert flagged == 0
    lines, flagged = compare(report(90.0, 9.0, 0.01), old)
    assert flagged == 2
    assert any("rate" in line and "WORSE" in line for line in lines)
    assert any("latency" in line and "better" in line for line in lines)  # lower latency is better


def test_figures_carry_their_spread_and_ratios_add_their_noise() -> None:
    assert spread([10.0]) is None
    assert spread([9.0, 10.0, 11.0]) == pytest.approx(0.2)
    both = ratio([10.0, 9.0], [5.0, 4.5], "base")
    assert both["value"] == pytest.approx(2.0) and both["spread"] == pytest.approx(0.1 / 0.95 * 2, rel=1e-6)
    report = {
        "environment": {"gpu": "NVIDIA H100", "date_utc": "2026-12-07T03:00:00+00:00"},
        "phases": {"w1": {"title": "W1", "status": "ok", "figures": {"bf16": figure(45000.0, "tokens/s")}}},
    }
    rows = markdown_rows(report, "python3 bench/headline.py").splitlines()
    assert rows[2].startswith("| W1: bf16 | **45,000 tokens/s** | `python3 bench/headline.py` | NVIDIA H100")


def test_a_bar_in_a_figures_name_stays_inside_its_cell() -> None:
    report = {
        "environment": {},
        "phases": {
            "w1": {"title": "W1", "status": "ok", "figures": {"max |score - float32|": figure(0.1, "abs")}}
        },
    }
    row = markdown_rows(report, "python3 bench/headline.py").splitlines()[2]
    assert row.startswith(r"| W1: max \|score - float32\| | **0.1 abs** |") and row.count(" | ") == 5


def test_the_script_imports_no_torch_where_a_spawned_process_imports_it_again() -> None:
    """The W2 phase's worker spawns intake processes, and each imports the program's main module again (as
    `__mp_main__`): the headline script's own imports stay light, its phases' modules loaded as they run."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    heavy = ("torch", "numpy", "bench.common", "bench.headline_phases")
    probe = (
        "import runpy, sys; runpy.run_path('bench/headline.py', run_name='__mp_main__'); "
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=root, env={"PYTHONPATH": str(root)}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
