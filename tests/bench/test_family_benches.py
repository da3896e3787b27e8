"""The smoke runs of the newer model families' benchmarks on the CPU (a mixture of experts, a hybrid
linear-attention model, an image-text classifier) and their verdicts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from scripts import ROOT
from scripts import run_script as _run_script

pytestmark = pytest.mark.slow  # each runs a benchmark script end to end in a process of its own


def test_moe_benchmark_quick_run_checks_what_it_timed(tmp_path: Path) -> None:
    """bench/moe.py on a tiny mixture of experts on the CPU: the packed Scorer and HF's padded forward timed
    over the same stream, the packed results checked against HF float32 (its loop over experts), the
    active parameters counted (a token multiplies 2 of the 8 experts of each sparse block)."""
    proc = _run_script(["bench/moe.py", "--quick", "--repeats", "1"], tmp_path, 600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "moe-quick.json").read_text())
    assert report["verdict"] == "ok" and report["vs_fp32"]["ok"] and report["vs_fp32"]["items"] == 8
    assert set(report["runs"]) == {"packed", "hf_sdpa_padded32_sorted"}
    shapes = report["shapes"]
    hidden, width, layers = (
        shapes["hidden_size"],
        shapes["moe_intermediate_size"],
        shapes["num_hidden_layers"],
    )
    idle = layers * (shapes["num_experts"] - shapes["num_experts_per_tok"]) * 3 * hidden * width
    assert report["flops_per_token"]["dense"] == 2 * report["active_parameters"]
    assert report["active_parameters"] > 0 and report["runs"]["packed"]["experts_path"] == "loop"
    assert idle > report["active_parameters"]  # most of the tiny model's weights sit in idle experts


@pytest.mark.parametrize("kind", ["qwen3_5_text", "qwen3_next"])
def test_hybrid_benchmark_quick_run_checks_what_it_timed(kind: str, tmp_path: Path) -> None:
    """bench/hybrid.py on a tiny hybrid on the CPU: timed, its sample checked against HF float32, the report
    written with its verdict."""
    proc = _run_script(["bench/hybrid.py", "--quick", "--kind", kind], tmp_path, 600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "hybrid-quick.json").read_text())
    assert report["verdict"] == "ok" and report["vs_float32"]["ok"]
    assert report["linear_kernel"] == "torch" and report["tokens_per_s"] > 0
    assert report["vs_float32"]["items"] == 12


def test_vision_benchmark_quick_run_checks_what_it_timed(tmp_path: Path) -> None:
    """bench/vision.py on the tiny image-text model on the CPU: a mixed batch timed, images and tokens per
    second reported, a sample of both kinds checked against HF float32."""
    proc = _run_script(["bench/vision.py", "--quick"], tmp_path, 600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "vision-quick.json").read_text())
    assert report["verdict"] == "ok" and report["vs_fp32"]["ok"]
    assert report["images"] == report["requests"] // 2 and report["images_per_s"] > 0
    assert report["vs_fp32"]["with_images"] == report["vs_fp32"]["requests"] // 2


def test_vision_judge_benchmark_quick_run_checks_both_paths(tmp_path: Path) -> None:
    """bench/vision_judge.py on the tiny Qwen2.5-VL judge on the CPU: the packed path and the padded one
    timed on the same mixed batch, each checked against HF float32 on a sample."""
    proc = _run_script(["bench/vision_judge.py", "--quick"], tmp_path, 600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "vision_judge-quick.json").read_text())
    assert report["verdict"] == "ok" and report["packed_speedup"] > 0
    for path, attention in (("packed", "attention='reference'"), ("padded", "attention='plain'")):
        assert report[path]["vs_fp32"]["ok"] and attention in report[path]["info"]


def test_vision_judge_full_shapes_make_a_valid_config(tmp_path: Path) -> None:
    """The GPU run's Qwen2.5-VL-3B-like config from the tiny judge's files: the tiny judge's per-layer list
    does not travel to the 36-layer text model (transformers refuses a list of another length)."""
    sys.path.insert(0, str(ROOT))
    from bench.vision_judge import QWEN2_5_VL_3B, judge_config
    from models.tiny_vision import write_tiny_qwen_vl_judge

    write_tiny_qwen_vl_judge(tmp_path / "judge", 0, "qwen2_5_vl")
    config = judge_config(tmp_path / "judge", QWEN2_5_VL_3B)
    text = config.get_text_config()
    assert text.num_hidden_layers == 36 and len(text.layer_types) == 36
    assert config.vision_config.depth == QWEN2_5_VL_3B["vision"]["depth"]
