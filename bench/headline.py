"""The headline run: every headline figure of the GPU side in one process of at most 9 minutes on one H100 or
H200, in order of importance, each phase within its own time budget, every figure checked against float32.

Run on the GPU machine from the repository root (W2's phase needs the carried wheels, bench/README.md):
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 && python3 bench/headline.py
`--quick` runs the same phases on tiny models on the CPU (a smoke test of the run, not a measurement).
`--compare OLD.json` prints each figure beside an earlier report's and flags moves beyond the noise.
`--resume EARLIER.json` keeps the phases an earlier call ran ok (on the same GPU, from the same sources:
the report's `source` digest) and runs only the others, into one report: a run that a call could not finish
is finished by the next, each kept phase naming the call that ran it (`ran`).

After each phase the report ($OUT/headline.json, or the current directory's) and the Markdown rows of
docs/benchmarks.md's tables (headline.md beside it) are rewritten in one step: a run killed part-way leaves
every finished phase behind. A phase's status: ok (timed and checked against float32), wrong (a check of
what it timed failed: its figures are no figures), error (it raised), cut (it ran past its budget, or no
time was left to start it), skipped (its module is absent, or the CPU cannot time it). The exit status is 1
when any phase was wrong or raised, else 0.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.headline_kit import (
    Context,
    PhaseCut,
    compare,
    load_report,
    markdown_rows,
    resumable,
    source_digest,
    write_atomic,
)

# This module imports neither torch nor the phases' modules until a phase runs: the W2 phase's worker
# spawns its intake processes, and a spawned process imports the program's main module again (this file,
# when run as a script), which with torch at the top cost each of them seconds at every worker restart.

COMMAND = "python3 bench/headline.py"
ROOT = Path(__file__).resolve().parents[1]
TOTAL_S = 540.0  # the whole run, process start to the last report: 9 minutes
# A quick run's budgets are the GPU's times this: the CPU is slower on its tiny models than the GPU on the
# full ones, and a quick run checks that every phase runs and checks, not how fast.
QUICK_SCALE = 4.0
CUT_AGAIN_S = 5.0  # after a cut, raised again this often until the phase has let go
# A phase's budget is its time on an H100 with some room. On a host whose CPU is slower the phases take
# longer (the H100 of 2026-12-07 19:28: W1 134 s against 95 s, the adapters' float32 check 27.5 s against
# 13 s, the same GPU times): a phase may run past its budget up to OVERRUN times it while the run has the
# time. The phases go in order of importance, so the run's end cuts the last ones, not the first; a phase
# that hangs is still cut.
OVERRUN = 1.5
START_S = 20.0  # what the start (imports, CUDA's context, the report's header) takes before the first phase


def _later(module: str, name: str) -> Callable[[Context], dict[str, Any]]:
    """A phase's function, imported from bench.`module` when the phase runs."""

    def run(ctx: Context) -> dict[str, Any]:
        import importlib

        function: Callable[[Context], dict[str, Any]] = getattr(
            importlib.import_module(f"bench.{module}"), name
        )
        return function(ctx)

    run.__qualname__ = f"{module}.{name}"
    return run


def report_header(args: Any) -> dict[str, Any]:
    from bench.common import report_header as header

    return header(args)


@dataclass(frozen=True)
class Phase:
    """One entry of the run: its name, title, time budget on the GPU (seconds), what it runs, and how long
    it took on an H100 (`typical_s`: a phase is not started with less of the run left)."""

    name: str
    title: str
    budget_s: float
    run: Callable[[Context], dict[str, Any]]
    typical_s: float = 0.0


# In order of importance: when time runs short, the last are the ones cut. Each phase runs the function of
# its name in the module named beside it (bench/headline_phases.py, bench/headline_models.py).
# Typical: each phase's time on an H100 (2026-12-07 15:28-15:53: w1 95 s, and since then an estimated 25 s
# for its 64 pairs' float32 scores (128 float32 forwards of 0.2 s) and 15 s for its passes with no hidden
# states asked (two passes of 7 s), l1 31, w2 89-103, w4 103-121,
# adapters 77, prm 19, deterministic 25, w5 43, hybrid 120 with its model's first compile, moe 34, vision 21);
# budgets the same with room to spare. They add up to more than the run (docs/benchmarks.md, the headline
# run): a phase that would not finish in what is left is not started, the later ones that fit still run,
# and the next call runs what this one left (--resume).
_TABLE: tuple[tuple[str, str, float, float, str], ...] = (
    ("w1", "W1, bf16 and FP8 against the matmul rooflines", 170, 135, "headline_phases"),
    ("l1", "L1, 1 and 64 requests of 100 tokens", 45, 31, "headline_phases"),
    ("w2", "W2 behind the embedded broker", 125, 100, "headline_phases"),
    ("w4", "W4, each prompt's answers interleaved", 130, 105, "headline_phases"),
    ("adapters", "mixed LoRA adapters against the base model", 100, 77, "headline_phases"),
    ("prm", "PRM, 8 steps against plain scoring", 30, 19, "headline_phases"),
    ("deterministic", "the deterministic setting against the default", 40, 25, "headline_phases"),
    ("w5", "W5, long context among W1's requests", 60, 43, "headline_phases"),
    ("hybrid", "a hybrid linear-attention model (Qwen3.5-9B-like)", 140, 120, "headline_models"),
    ("moe", "a mixture-of-experts model (Qwen3-30B-A3B's shapes, 8 layers)", 50, 34, "headline_models"),
    ("vision", "an image-text classifier (Gemma-3-4B-like), images beside text", 40, 21, "headline_models"),
)
PHASES: tuple[Phase, ...] = tuple(Phase(n, t, b, _later(m, n), typical) for n, t, b, typical, m in _TABLE)


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise PhaseCut in this (the main) thread once `seconds` have passed, and again every CUT_AGAIN_S
    until the block is left (an event loop keeps a task's exception and runs on: the next one lands
    elsewhere). Python runs the handler between bytecodes, so a phase is cut when the device call it waits
    on returns."""

    def cut(signum: int, frame: object) -> None:
        raise PhaseCut(f"past its budget of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, cut)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01), CUT_AGAIN_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_phase(phase: Phase, ctx: Context, budget_s: float) -> dict[str, Any]:
    """One phase within `budget_s`: its figures and checks, with its status and how long it took."""
    entry: dict[str, Any] = {"title": phase.title, "budget_s": round(budget_s, 1)}
    started = time.monotonic()
    ctx.deadline = started + budget_s
    import torch

    # A worker holds one Scorer: no phase's compiled graphs count against another's recompile limit.
    torch._dynamo.reset()
    try:
        with time_limit(budget_s):
            result = phase.run(ctx)
    except PhaseCut as cut:
        entry.update(status="cut", notes=[f"cut: {cut}"])
    except Exception as exc:
        traceback.print_exc()
        entry.update(
            status="error", error=f"{type(exc).__name__}: {exc}", notes=[f"raised {type(exc).__name__}"]
        )
    else:
        if "skipped" in result:
            entry.update(status="skipped", notes=[result["skipped"]])
        else:
            failed = [name for name, c in result.get("checks", {}).items() if not c.get("ok")]
            no_checks = not result.get("checks")
            entry.update(result, status="wrong" if failed or no_checks else "ok")
            entry["notes"] = [*result.get("notes", []), *(["nothing was checked"] if no_checks else [])]
            entry["failed_checks"] = failed
    finally:
        entry["seconds"] = round(time.monotonic() - started, 1)
        with contextlib.suppress(Exception):
            _release(ctx.device)
    return entry


def _release(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_within(phase: Phase, ctx: Context, budget_s: float, end: float, scale: float) -> dict[str, Any]:
    """The phase within its budget (OVERRUN times it while the run has time, never past `end`), or cut
    unstarted when less of the run is left than it typically takes (its typical time times `scale`, the
    quick run's) or than a start is worth."""
    left = end - time.monotonic()
    budget = min(budget_s * OVERRUN, left)
    print(f"\n=== {phase.name}: {phase.title} (budget {budget:.0f} s, {left:.0f} s left)", flush=True)
    if budget < min(10.0, budget_s) or left < phase.typical_s * scale:
        typical = f"; it takes about {phase.typical_s * scale:.0f} s" if phase.typical_s else ""
        why = f"cut: {left:.0f} s left in the run{typical}, not started (a later call: --resume)"
        return {"title": phase.title, "status": "cut", "notes": [why]}
    return run_phase(phase, ctx, budget)


def parse_args(argv: Sequence[str] | None) -> Any:
    from bench.common import argument_parser

    parser = argument_parser(__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="tiny models on the CPU: a smoke test of the run"
    )
    parser.add_argument("--compare", type=Path, default=None, help="an earlier headline.json to set beside")
    parser.add_argument("--json", type=Path, default=None, help="the report (default $OUT/headline.json)")
    parser.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="EARLIER.json",
        help="keep the phases an earlier call ran ok (same GPU, same sources) and run only the others",
    )
    parser.add_argument(
        "--phases", default=",".join(p.name for p in PHASES), help="the phases to run, in the run's order"
    )
    parser.add_argument(
        "--total-s",
        type=float,
        default=None,
        help=f"the whole run's time ({TOTAL_S:.0f}; quick x{QUICK_SCALE:.0f})",
    )
    parser.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="NAME=SECONDS",
        help=f"another time budget for a phase (repeatable; it may run {OVERRUN}x it while the run has time)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from bench.common import out_dir, pick_device

    started = time.monotonic()
    args = parse_args(argv)
    device = pick_device("the headline run (or --quick)", cpu_allowed=args.quick)
    if device is None:
        return 2
    if device == "cuda" and args.quick:
        device = "cpu"  # a quick run is the CPU's smoke test, wherever it runs
    wanted = [n for n in args.phases.split(",") if n]
    unknown = set(wanted) - {p.name for p in PHASES}
    if unknown:
        print(f"unknown phases {sorted(unknown)}; known: {[p.name for p in PHASES]}", file=sys.stderr)
        return 2
    scale = QUICK_SCALE if args.quick else 1.0
    total_s = args.total_s or TOTAL_S * scale
    budgets = {p.name: p.budget_s * scale for p in PHASES}
    budgets.update({k: float(v) for k, v in (item.split("=", 1) for item in args.budget)})
    target = args.json or (out_dir() or Path(".")) / f"headline{'-quick' if args.quick else ''}.json"
    rows_target = target.with_suffix(".md")
    report = report_header(args)
    report.update(device=device, total_s=total_s, source=source_digest(ROOT), phases={})
    kept: dict[str, dict[str, Any]] = {}
    if args.resume is not None:
        try:
            kept = resumable(load_report(args.resume), report, args.quick)
        except (OSError, ValueError) as exc:  # ResumeRefused, an unreadable or malformed report
            print(f"--resume {args.resume}: its phases cannot be kept: {exc}", file=sys.stderr)
            return 2
        report["resumed_from"] = str(args.resume)
    end = started + total_s - 5  # the last write's margin
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        ctx = Context(device=device, quick=args.quick, workdir=Path(tmp))
        for phase in (p for p in PHASES if p.name in wanted):
            if phase.name in kept:
                entry, ran = kept[phase.name], kept[phase.name]["ran"]
                when = f"{ran['date_utc']} on {ran['gpu'] or 'the CPU'}"
                print(f"\n=== {phase.name}: ok in the call of {when}: kept", flush=True)
            else:
                entry = run_within(phase, ctx, budgets[phase.name], end, scale)
            report["phases"][phase.name] = entry
            report["verdict"] = verdict(report)
            write_atomic(target, _json(report))
            write_atomic(rows_target, markdown_rows(report, COMMAND + (" --quick" if args.quick else "")))
            how = "kept" if phase.name in kept else f"{entry['status']} in {entry.get('seconds', 0)} s"
            print(f"=== {phase.name}: {how}; wrote {target}", flush=True)
    report["seconds"] = round(time.monotonic() - started, 1)
    write_atomic(target, _json(report))
    summary(report)
    if args.compare is not None:
        lines, flagged = compare(report, load_report(args.compare))
        print(f"\nagainst {args.compare} ({flagged} figures moved beyond the noise):")
        print("\n".join(lines))
    return 1 if report["verdict"] != "ok" else 0


def verdict(report: dict[str, Any]) -> Any:
    """ "ok", or what failed: the phases that were wrong or raised (cut and skipped ones are noted, not
    failed)."""
    failures = [
        f"{name}: {entry['status']}: {entry.get('failed_checks') or entry.get('error')}"
        for name, entry in report["phases"].items()
        if entry["status"] in {"wrong", "error"}
    ]
    return failures or "ok"


def summary(report: dict[str, Any]) -> None:
    print(f"\nheadline run in {report['seconds']} s on {report['environment'].get('gpu', 'the CPU')}:")
    for name, entry in report["phases"].items():
        notes = "; ".join(entry.get("notes", []))
        print(f"  {name:<14}{entry['status']:<9}{entry.get('seconds', 0):>7} s  {notes}")
        for label, fig in entry.get("figures", {}).items():
            noise = f" (spread {100 * fig['spread']:.1f}%)" if fig.get("spread") else ""
            print(f"      {label}: {fig['value']} {fig['unit']}{noise}")
    for failure in [] if report["verdict"] == "ok" else report["verdict"]:
        print(f"headline FAILED: {failure}", file=sys.stderr)


def _json(report: dict[str, Any]) -> str:
    import json

    return json.dumps(report, indent=2, default=_plain)


def _plain(value: Any) -> Any:
    """Report values JSON has no form for: arrays as lists, anything else as its text."""
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else str(value)


if __name__ == "__main__":
    sys.exit(main())
