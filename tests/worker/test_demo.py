"""`score-worker demo` end to end: its own broker, a generated tiny model, one worker, printed results."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from worker.demo import sample_requests

pytestmark = pytest.mark.slow


def test_demo_runs_end_to_end() -> None:
    # The console entry point exactly as the README's first command runs it (no flags, nothing prepared).
    proc = subprocess.run(
        [sys.executable, "-m", "worker", "demo"], capture_output=True, text=True, timeout=180, check=False
    )
    out = proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr
    samples = sample_requests()
    for sample in samples:
        assert re.search(rf"^{sample.request.request_id}  (ok|error)", out, re.MULTILINE), (
            sample.request.request_id
        )
    assert re.search(r"^demo-01  ok ", out, re.MULTILINE)
    assert re.search(r"^demo-12  error .*\n    error TOKEN_ID_OUT_OF_RANGE: ", out, re.MULTILINE)
    for dtype in ("float32", "float16", "bfloat16"):
        assert re.search(rf"hidden\[0\] {dtype} shape \(64,\) \[-?\d+\.\d{{4}}, ", out), dtype
    assert f"{len(samples)} results in " in out and ": 11 ok, 1 error" in out
    assert "worker stopped" in out


def test_demo_with_a_given_model(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from worker.cli import main

    assert main(["demo", "--model", str(tiny_llama_dir)]) == 0
    out = capsys.readouterr().out
    assert "model:  tiny random-weight" not in out  # nothing generated: the given model is used
    # A one-label model: softmax over one label is exactly 1.
    assert re.search(r"^demo-03  ok .*\n    scores \[\[1\.0000\]\]", out, re.MULTILINE)
