"""Running a bench script as on the GPU machine, for the tests that run the benchmarks' smoke runs on the CPU
(split over several files so that the test processes run them side by side)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(args: list[str], out: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """A bench script run from the repository root, as on the GPU machine, its $OUT at `out`."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OUT": str(out), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, *args]
    return subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
