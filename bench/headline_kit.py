"""The headline run's parts: the context its phases share, figures with the noise measured beside them, the
report and its Markdown rows written as the run goes, and the comparison with an earlier report."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The least relative move --compare flags, whatever the measured spread: two passes that happen to agree
# closely say little about the next run's noise.
NOISE_FLOOR = 0.01


class PhaseCut(BaseException):
    """A phase ran past its time budget: its figures are missing, not wrong. Not an Exception: the engine
    answers an Exception in a batch by scoring the batch's halves apart, which would swallow the cut."""


@dataclass
class Context:
    """What every phase is given: the device, whether this is a quick run, a scratch folder, the phase's
    deadline (time.monotonic()), and `shared`, what earlier phases left for later ones (W1's saved model)."""

    device: str
    quick: bool
    workdir: Path
    deadline: float = math.inf
    shared: dict[str, Any] = field(default_factory=dict)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def w1_dir(self) -> Path:
        """W1's model (8B Llama shapes, random weights; tiny shapes in a quick run) saved with a tokenizer:
        the one W1's phase saved, else built here once for the phases after it."""
        if "w1_dir" not in self.shared:
            from bench.common import W1_QUICK_SHAPES, W1_SHAPES, model_dir

            shapes = W1_QUICK_SHAPES if self.quick else W1_SHAPES
            self.shared["w1_dir"] = model_dir("llama", shapes, self.device, self.workdir / "w1-shared")
        return Path(self.shared["w1_dir"])


def spread(samples: Sequence[float]) -> float | None:
    """(max - min) / median of a figure's repeats: its noise in this run (None for fewer than two)."""
    if len(samples) < 2:
        return None
    middle = statistics.median(samples)
    return (max(samples) - min(samples)) / abs(middle) if middle else None


def figure(
    value: float | None,
    unit: str,
    samples: Sequence[float] = (),
    higher_is_better: bool = True,
    baseline: str = "",
    noise: float | None = None,
) -> dict[str, Any]:
    """One reported figure: its value, unit, the repeats it came from and their spread (or `noise` where the
    spread comes from elsewhere, e.g. p90 against p50), which way is better, and its same-run baseline."""
    return {
        "value": value,
        "unit": unit,
        "samples": list(samples),
        "spread": noise if noise is not None else spread(samples),
        "higher_is_better": higher_is_better,
        "baseline": baseline,
    }


def rate(amount: float, seconds: Sequence[float], unit: str, baseline: str = "") -> dict[str, Any]:
    """amount / seconds for each timed pass; the best pass is the figure."""
    samples = [amount / s for s in seconds]
    return figure(max(samples), unit, samples, baseline=baseline)


def ratio(top: Sequence[float], bottom: Sequence[float], baseline: str) -> dict[str, Any]:
    """best(top) / best(bottom) of two sets of rates (higher is better), its noise the sum of theirs."""
    noise = sum(spread(s) or 0.0 for s in (top, bottom)) or None
    return figure(max(top) / max(bottom), "x", higher_is_better=True, baseline=baseline, noise=noise)


def check(ok: bool, details: dict[str, Any] | None = None, **more: Any) -> dict[str, Any]:
    """A check of what a phase timed: passed or not, with what it found."""
    return {**(details or {}), **more, "ok": bool(ok)}


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` in one step: a run killed while writing leaves the previous version whole."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def _shown(value: Any, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "x":
        return f"{value:.3f}x"
    if unit in {"tokens/s", "items/s", "TFLOP/s"}:
        return f"{value:,.0f} {unit}"
    if unit == "%":
        return f"{value:.1f}%"
    return f"{value:.4g} {unit}"


def _cell(text: str) -> str:
    """Text as one cell of a Markdown table: its bars escaped, on one line."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_rows(report: dict[str, Any], command: str) -> str:
    """The rows of docs/benchmarks.md's table (figure, latest, command, machine, date, same-run baseline)
    for every figure the run has so far; phases without figures say why."""
    lines = [
        "| figure | latest | command | machine | date (UTC) | same-run baseline |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, phase in report.get("phases", {}).items():
        # A phase kept from an earlier call (--resume) gives that call's machine and date.
        environment = phase.get("ran") or report.get("environment", {})
        machine = environment.get("gpu") or "CPU"
        date = str(environment.get("date_utc", ""))[:16].replace("T", " ")
        status = phase.get("status")
        title = _cell(phase.get("title", name))
        if status != "ok":
            why = _cell("; ".join(str(n) for n in phase.get("notes", [])) or phase.get("error", ""))
            lines.append(f"| {title} | **{status}**: {why} | `{command}` | {machine} | {date} | |")
            continue
        for label, fig in phase.get("figures", {}).items():
            noise = fig.get("spread")
            spread_text = f" (spread {100 * noise:.1f}%)" if noise else ""
            latest = f"**{_shown(fig['value'], fig['unit'])}**{spread_text}"
            baseline = _cell(fig.get("baseline", ""))
            lines.append(
                f"| {title}: {_cell(label)} | {latest} | `{command}` | {machine} | {date} | {baseline} |"
            )
    return "\n".join(lines) + "\n"


def compare(new: dict[str, Any], old: dict[str, Any]) -> tuple[list[str], int]:
    """Each figure of `new` beside the same figure of `old`, with the move flagged where it is beyond the
    noise either run measured (twice the larger spread, at least NOISE_FLOOR); the lines and the number
    flagged. Only figures of the same unit are compared."""
    lines = [f"{'figure':<64}{'old':>16}{'new':>16}{'move':>9}  {'noise':>7}"]
    flagged = 0
    old_phases = old.get("phases", {})
    for name, phase in new.get("phases", {}).items():
        before = old_phases.get(name, {}).get("figures", {})
        for label, fig in phase.get("figures", {}).items():
            was = before.get(label)
            key = f"{name}: {label}"[:63]
            if (
                was is None
                or was.get("unit") != fig.get("unit")
                or not was.get("value")
                or fig["value"] is None
            ):
                lines.append(f"{key:<64}{'-':>16}{_shown(fig['value'], fig['unit']):>16}")
                continue
            move = (fig["value"] - was["value"]) / abs(was["value"])
            noise = max(NOISE_FLOOR, 2 * max(fig.get("spread") or 0.0, was.get("spread") or 0.0))
            worse = move < 0 if fig.get("higher_is_better", True) else move > 0
            mark = ""
            if abs(move) > noise:
                flagged += 1
                mark = "  WORSE" if worse else "  better"
            lines.append(
                f"{key:<64}{_shown(was['value'], was['unit']):>16}{_shown(fig['value'], fig['unit']):>16}"
                f"{100 * move:>+8.1f}%  {100 * noise:>6.1f}%{mark}"
            )
    return lines, flagged


def namespace(**values: Any) -> argparse.Namespace:
    """The options a bench script's case function reads, given here rather than parsed."""
    return argparse.Namespace(**values)


def load_report(path: Path) -> dict[str, Any]:
    report: dict[str, Any] = json.loads(path.read_text())
    return report


# The code a report's figures come from: what a phase kept from an earlier call (--resume) must share.
SOURCE_DIRS = ("bench", "models", "schemas", "worker")


def source_digest(root: Path) -> str:
    """A digest of the Python sources under SOURCE_DIRS (their paths and bytes): two runs with the same
    digest ran the same engine and the same benchmarks, whatever the docs or tests around them."""
    digest = hashlib.sha256()
    for path in sorted(p for d in SOURCE_DIRS for p in (root / d).rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


class ResumeRefused(ValueError):
    """An earlier report whose phases cannot stand beside this run's."""


def resumable(earlier: dict[str, Any], current: dict[str, Any], quick: bool) -> dict[str, dict[str, Any]]:
    """The phases of `earlier` (a report) that this run keeps rather than runs again: those that were ok,
    each with the call that ran it (`ran`: its date and machine). Refused (ResumeRefused) unless the earlier
    run was the same kind (quick or not), on the same GPU, from the same sources (source_digest)."""
    then, now = earlier.get("environment", {}), current.get("environment", {})
    earlier_quick = str(earlier.get("args", {}).get("quick")) == "True"
    problems = []
    if earlier_quick != quick:
        problems.append(f"it was {'a quick' if earlier_quick else 'a full'} run")
    if then.get("gpu") != now.get("gpu"):
        machines = [then.get("gpu") or "the CPU", now.get("gpu") or "the CPU"]
        problems.append(f"it ran on {machines[0]}, this run on {machines[1]}")
    if earlier.get("source") != current.get("source"):
        problems.append(
            f"its sources ({earlier.get('source') or 'no digest'}) are not this run's "
            f"({current.get('source')})"
        )
    if problems:
        raise ResumeRefused("; ".join(problems))
    call = {"date_utc": then.get("date_utc"), "gpu": then.get("gpu")}
    return {
        name: {**entry, "ran": entry.get("ran") or call}
        for name, entry in earlier.get("phases", {}).items()
        if entry.get("status") == "ok"
    }
