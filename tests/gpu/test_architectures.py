"""Every supported architecture through the packed Scorer against HuggingFace float32 (architecture_check.py):
one mixed batch in several packs, each request alone, the deterministic setting, graph replays and the
attention kernel that ran.

On the GPU (marked `gpu`, skipped without a CUDA device) every dtype and attention path with the worker's
defaults, and bf16 again through flash; on the CPU, float32 with the exact reference attention, which tests
the check itself, not a kernel, and runs wherever the suite does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from architecture_check import GPU_RUNS, GQA_MODEL, check_model

from models.tiny import ARCHITECTURES

ON_GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
# (device, attention kernel of the varlen runs, the dtype/attention runs): on the GPU every run with the
# worker's default kernel (Triton on Hopper) and bf16 through flash; on the CPU the exact path in float32
# (half-precision CPU kernels are not what this checks).
CHECKS = [
    pytest.param(("cuda", "auto", GPU_RUNS), marks=ON_GPU, id="auto"),
    pytest.param(("cuda", "flash", (("bfloat16", "varlen"),)), marks=ON_GPU, id="flash"),
    pytest.param(("cpu", "auto", (("float32", "reference"),)), id="cpu"),
]


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("name", [*ARCHITECTURES, GQA_MODEL])
def test_every_architecture_matches_float32_hf(
    name: str, check: tuple[str, str, tuple[tuple[str, str], ...]], architecture_models: dict[str, Path]
) -> None:
    """Scores and hidden states within twice HF's own error in the dtype plus a floor, hidden states exactly
    where asked, the invalid request alone refused, batch drift, bit-identical deterministic results, and on
    the GPU graph replays and the varlen kernel seen in the profile; float32 with the varlen kernel is
    refused at start-up, not failed later."""
    device, kernel, runs = check
    outcomes = check_model(name, architecture_models[name], device, runs, kernel)  # type: ignore[arg-type]
    assert [(o.dtype, o.attention) for o in outcomes] == list(runs)
    failures = [f"{o.dtype}/{o.attention}: {f} ({o.numbers})" for o in outcomes for f in o.failures]
    assert not failures, failures
