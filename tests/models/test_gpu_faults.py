"""On a CUDA device: a real out-of-memory fails only its request; a kernel fault that kills the context
raises DeviceLostError. Skipped where there is no GPU (the CPU suite covers the same logic with a fake
kernel failure); run on the GPU machine with `python -m pytest tests/models/test_gpu_faults.py`."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tolerances import TENSOR_CORES, forward_sums, half_forward_bound

from models import Scorer, ScorerConfig
from schemas import ErrorCode, ScoreRequest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HEADROOM_BYTES = 256 * 2**20  # what the capped allocator leaves beyond the weights and warm-up


def test_a_real_out_of_memory_fails_only_the_request_that_causes_it(tiny_llama_dir: Path) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cuda", max_batch_tokens=10_000_000))
    small = [ScoreRequest(f"small-{i}", items=(f"a short text {i}",) * 4) for i in range(12)]
    expected = scorer.score(small)
    total = torch.cuda.get_device_properties(device).total_memory
    cap = torch.cuda.memory_reserved(device) + HEADROOM_BYTES
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    try:
        # 1,500 items of 500 token ids: 750,000 tokens, several GB of activations: far above the cap.
        huge = ScoreRequest("huge", items=(tuple(3 + i % 90 for i in range(500)),) * 1500)
        results = scorer.score([*small[:6], huge, *small[6:]])
        by_id = {r.request_id: r for r in results}
        error = by_id["huge"].error
        assert error is not None and error.code is ErrorCode.MODEL_ERROR
        assert "OutOfMemoryError" in error.message or "out of memory" in error.message
        # bf16, another batch layout: two bf16 forwards, each of the model's sums in series (float32 on
        # tensor cores) rounded to bf16 (u = 2^-8), at the score's scale (at least 1).
        sums = forward_sums(tiny_llama_dir, max(len(p) for r in small for p in scorer.prepare(r).prompts))
        for want in expected:
            got = by_id[want.request_id]
            assert got.ok, got.error
            for row, want_row in zip(got.scores, want.scores, strict=True):
                scale = max(1.0, max(abs(value) for value in want_row))
                bound = half_forward_bound(
                    torch.bfloat16, sums=sums, magnitude=scale, accumulation=TENSOR_CORES
                )
                assert row == pytest.approx(want_row, abs=bound, rel=0)
        assert all(r.ok for r in scorer.score(small))  # the allocator recovered
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)


_DEVICE_ASSERT = """
import torch
from models import Scorer, ScorerConfig
from models.errors import DeviceLostError
from schemas import ScoreRequest

scorer = Scorer({model!r}, ScorerConfig(device="cuda"))
real_forward = scorer._launch_batch

def faulting_forward(batch):
    if any(p.request.request_id == "fault" for p in batch):
        # An out-of-bounds index inside a kernel: a device-side assert, which ends the CUDA context.
        torch.zeros(4, device="cuda")[torch.tensor([99], device="cuda")].sum().item()
    return real_forward(batch)

scorer._launch_batch = faulting_forward
assert scorer.score([ScoreRequest("before", items=("fine",))])[0].ok
try:
    scorer.score([ScoreRequest("ok", items=("fine",)), ScoreRequest("fault", items=("fine",))])
except DeviceLostError as error:
    print("DEVICE LOST:", error)
else:
    print("NO ERROR")
"""


def test_a_kernel_fault_that_ends_the_cuda_context_raises_device_lost(tiny_llama_dir: Path) -> None:
    # A dead CUDA context cannot be revived in a process: the scenario runs in its own.
    code = textwrap.dedent(_DEVICE_ASSERT.format(model=str(tiny_llama_dir)))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=Path.cwd()
    )
    assert "DEVICE LOST:" in done.stdout, done.stdout + done.stderr
    assert "must restart" in done.stdout
