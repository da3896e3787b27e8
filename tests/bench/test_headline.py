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
from bench.headline_kit import (
    SOURCE_DIRS,
    Context,
    check,
    compare,
    figure,
    markdown_rows,
    ratio,
    source_digest,
    spread,
)


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


def test_a_phase_that_would_not_finish_is_left_for_a_later_call_and_a_shorter_one_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With less of the run left than a phase typically takes, it is not started (it would only be cut
    part-way, its time lost): it is cut unstarted, and a later phase that fits still runs."""
    monkeypatch.setattr(headline, "report_header", lambda args: {"environment": {"date_utc": "2026-12-07"}})
    ran: list[str] = []

    def fine(name: str) -> Any:
        def run(ctx: Context) -> dict[str, Any]:
            ran.append(name)
            return _fine(ctx)

        return run

    scale = headline.QUICK_SCALE  # the quick run's typical times are this many times the table's
    phases = (
        headline.Phase("first", "fits", 5, fine("first"), typical_s=0.1 / scale),
        headline.Phase("long", "takes longer than is left", 5, fine("long"), typical_s=60 / scale),
        headline.Phase("short", "fits in what is left", 5, fine("short"), typical_s=1 / scale),
    )
    monkeypatch.setattr(headline, "PHASES", phases)
    target = tmp_path / "h.json"
    # 20 s in all, the last 5 the report's margin: 15 s for the phases.
    assert headline.main(["--quick", "--total-s", "20", "--json", str(target)]) == 0
    assert ran == ["first", "short"]
    report = json.loads(target.read_text())
    assert [p["status"] for p in report["phases"].values()] == ["ok", "cut", "ok"]
    assert "it takes about 60 s, not started" in report["phases"]["long"]["notes"][0]
    assert "--resume" in report["phases"]["long"]["notes"][0]


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


def test_a_resumed_run_keeps_the_phases_an_earlier_call_ran_ok_and_runs_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call that could not finish every phase leaves its report; the next call, given it (--resume),
    keeps its ok phases with that call's date and machine, and runs only the others: together they make
    one report. A report from another GPU, another kind of run or other sources is refused."""
    ran: list[str] = []

    def counted(name: str, outcome: Any) -> Any:
        def run(ctx: Context) -> dict[str, Any]:
            ran.append(name)
            result: dict[str, Any] = outcome(ctx)
            return result

        return run

    def header(date: str, gpu: str = "H100") -> None:
        environment = {"date_utc": date, "gpu": gpu}
        monkeypatch.setattr(
            headline, "report_header", lambda args: {"environment": environment, "args": {"quick": "True"}}
        )

    wrong_first = iter([_wrong, _fine])

    def flaky(ctx: Context) -> dict[str, Any]:
        result: dict[str, Any] = next(wrong_first)(ctx)
        return result

    monkeypatch.setattr(
        headline,
        "PHASES",
        (
            headline.Phase("first", "a phase ok at once", 5, counted("first", _fine)),
            headline.Phase("flaky", "wrong, then ok", 5, counted("flaky", flaky)),
            headline.Phase("later", "not run at first", 5, counted("later", _fine)),
        ),
    )
    earlier, resumed, again = tmp_path / "earlier.json", tmp_path / "resumed.json", tmp_path / "again.json"
    header("2026-12-07T10:00")
    assert headline.main(["--quick", "--phases", "first,flaky", "--json", str(earlier)]) == 1
    header("2026-12-08T10:00")
    assert headline.main(["--quick", "--resume", str(earlier), "--json", str(resumed)]) == 0
    assert ran == ["first", "flaky", "flaky", "later"]  # the earlier ok phase was not run again
    report = json.loads(resumed.read_text())
    assert [(name, p["status"]) for name, p in report["phases"].items()] == [
        ("first", "ok"), ("flaky", "ok"), ("later", "ok"),
    ]  # fmt: skip
    assert report["phases"]["first"]["ran"] == {"date_utc": "2026-12-07T10:00", "gpu": "H100"}
    assert "ran" not in report["phases"]["flaky"] and report["verdict"] == "ok"
    rows = {line.split(" | ")[0]: line for line in resumed.with_suffix(".md").read_text().splitlines()}
    assert "2026-12-07 10:00" in rows["| a phase ok at once: rate"]
    assert "2026-12-08 10:00" in rows["| not run at first: rate"]
    # Resumed from a resumed report: each kept phase still names the call that ran it.
    assert headline.main(["--quick", "--resume", str(resumed), "--json", str(again)]) == 0
    assert ran == ["first", "flaky", "flaky", "later"]
    assert json.loads(again.read_text())["phases"]["first"]["ran"]["date_utc"] == "2026-12-07T10:00"
    # Refused, before any phase runs: another GPU, a full run's report for a quick run, other sources.
    header("2026-12-08T11:00", gpu="H200")
    assert headline.main(["--quick", "--resume", str(earlier), "--json", str(again)]) == 2
    full = tmp_path / "full.json"
    full.write_text(json.dumps({**json.loads(earlier.read_text()), "args": {"quick": "False"}}))
    header("2026-12-08T11:00")
    assert headline.main(["--quick", "--resume", str(full), "--json", str(again)]) == 2
    monkeypatch.setattr(headline, "source_digest", lambda root: "another tree")
    assert headline.main(["--quick", "--resume", str(earlier), "--json", str(again)]) == 2
    assert headline.main(["--quick", "--resume", str(tmp_path / "absent.json"), "--json", str(again)]) == 2
    assert ran == ["first", "flaky", "flaky", "later"]


def test_the_source_digest_follows_the_code_and_nothing_else(tmp_path: Path) -> None:
    for directory in SOURCE_DIRS:
        (tmp_path / directory).mkdir()
        (tmp_path / directory / "a.py").write_text(f"# {directory}\n")
    before = source_digest(tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "notes.md").write_text("figures\n")
    (tmp_path / "bench" / "report.json").write_text("{}")
    assert source_digest(tmp_path) == before
    (tmp_path / "models" / "a.py").write_text("# models, changed\n")
    assert source_digest(tmp_path) != before


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
