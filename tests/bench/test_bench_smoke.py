"""The GPU check script runs on CPU too (exact attention path): keeps bench/ from rotting between GPU runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from models.tiny import ARCHITECTURES

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_cpu_smoke_passes(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OUT": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--cpu-smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # Every tiny architecture plus the GQA llama is checked; a run that checks nothing must not pass.
    expected = len(ARCHITECTURES) + 1
    assert re.search(rf"gpu_check: {expected} PASS, 0 FAIL", proc.stdout), proc.stdout[-2000:]
    written = list(tmp_path.glob("*.json"))
    assert written, "gpu_check wrote no JSON report"
    assert json.loads(written[0].read_text())
