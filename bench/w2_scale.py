"""W2 through the consumer group on one host: N worker processes (one per GPU, under the host's supervisor:
`score-worker run --gpus N`) against one, in the same run, on the same broker and model.

For each count (1, then N): a fresh set of topics (--partitions each), the host worker started as a user
starts it and awaited on its /readyz, a warm-up, then W2's saturation phase (every request produced at once;
items/s from the first send to the last result). At N: the latency phase at half N's saturation rate
(p50/p90/p99 produce to result). A sample of each count's saturation results is checked against HF float32
(bench.common.check_sample): beyond its bound, the run fails (exit 1). With `--tensor-parallel T`, each
worker process is a group of T GPUs instead (N GPUs make N / T members).

On the GPU machine, from the repository root:  PYTHONPATH=. python3 bench/w2_scale.py --gpus 2
On a CPU (--quick): tiny shapes, CPU worker processes; a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench import w2_load
from bench.common import (
    W2_QUICK_SHAPES,
    W2_SHAPES,
    argument_parser,
    check_sample,
    report_header,
    report_path,
    stop_process,
    w2_model_dir,
    write_verdict,
)
from worker.apache_kafka import LOCAL_BROKERS, start_local_broker
from worker.broker import free_port


def host_worker(
    args: argparse.Namespace, bootstrap: str, model_dir: Path, count: int, tag: str, device: str
) -> tuple[subprocess.Popen[bytes], int]:
    """`score-worker run` with `count` GPUs (or CPU processes), on topics of its own; and its port."""
    port = free_port()
    settings = {
        "BOOTSTRAP_SERVERS": bootstrap, "MODEL_DIR": str(model_dir), "GROUP_ID": f"w2s-{tag}",
        "REQUESTS_TOPIC": f"w2s.{tag}.requests", "RESULTS_TOPIC": f"w2s.{tag}.results",
        "DLQ_TOPIC": f"w2s.{tag}.dlq", "GPUS": str(count * args.tensor_parallel), "DEVICE": device,
        "TENSOR_PARALLEL": str(args.tensor_parallel), "TOPIC_PARTITIONS": str(args.partitions),
        "METRICS_PORT": str(port), "METRICS_HOST": "127.0.0.1", "MAX_BATCH_TOKENS": "16384",
        "MAX_INFLIGHT_REQUESTS": "4096", "SELF_CHECK": "false", "WORKER_ID": f"w2s-{tag}",
        "LOG_FORMAT": "json", "WARM_UP": "true" if device == "cuda" else "false",
    }  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCORE_WORKER_")}
    env.update({f"SCORE_WORKER_{name}": value for name, value in settings.items()})
    log = open(Path(tempfile.gettempdir()) / f"w2-scale-{tag}.log", "wb")  # noqa: SIM115 (the process writes it)
    command = [sys.executable, "-m", "worker", "run"]
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT), port


def wait_ready(process: subprocess.Popen[bytes], port: int, timeout_s: float) -> float:
    """Seconds until the host's /readyz answers 200 (every worker process loaded and in the group)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if process.poll() is not None:
            raise RuntimeError(f"the host worker exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as answer:
                if answer.status == 200:
                    return time.monotonic() - started
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the host worker was not ready in {timeout_s:.0f} s")


async def load(config: w2_load.LoadConfig, latency: bool, latency_seconds: float) -> dict[str, Any]:
    """Warm-up, saturation and (where asked) latency at half the saturation rate, through one loader."""
    requests = w2_load.make_workload(config)
    loader = w2_load.Loader(config)
    await loader.start()
    try:
        warm = await loader.burst(requests[: config.warmup_requests], "warm", config.warmup_timeout_s)
        loader.keep = {f"sat-{i}" for i in range(config.sample)}
        sat = await loader.burst(requests, "sat", config.saturation_timeout_s)
        report: dict[str, Any] = {"warmup": warm, "saturation": sat}
        report["sample"] = [
            {"items": [list(item) for item in requests[i].items], **loader.kept[f"sat-{i}"]}
            for i in range(config.sample)
            if f"sat-{i}" in loader.kept
        ]
        report["items_per_s"] = sat["items_completed"] / max(sat["t_last_result"] - sat["t_first_send"], 1e-9)
        if latency and sat["completed"] == sat["requests"]:
            rate = 0.5 * report["items_per_s"]
            count, budget = 0, rate * latency_seconds
            while count < len(requests) and budget > 0:
                budget -= len(requests[count].items)
                count += 1
            report["latency"] = await loader.paced(requests[:count], "lat", rate)
        return report
    finally:
        await loader.stop()


def run_count(
    args: argparse.Namespace, broker: Any, model_dir: Path, count: int, device: str, vocab: int
) -> dict[str, Any]:
    tag = f"n{count}"
    process, port = host_worker(args, broker.bootstrap_servers, model_dir, count, tag, device)
    try:
        ready_s = wait_ready(process, port, args.ready_timeout)
        config = w2_load.LoadConfig(
            bootstrap=broker.bootstrap_servers, requests_topic=f"w2s.{tag}.requests",
            results_topic=f"w2s.{tag}.results", vocab_size=vocab, requests=args.requests,
            saturation_timeout_s=args.saturation_timeout, latency_seconds=args.latency_seconds,
            warmup_requests=16 if args.quick else 64, sample=8 if args.quick else 24,
        )  # fmt: skip
        report = asyncio.run(load(config, count == args.gpus // args.tensor_parallel, args.latency_seconds))
        report["ready_s"] = ready_s
        report["correctness"] = check_sample(model_dir, device, report.pop("sample"))
        return report
    finally:
        stop_process(process, 90)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argument_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, CPU processes: a smoke test")
    parser.add_argument("--gpus", type=int, default=2, help="GPUs of the larger count (default 2)")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="GPUs per worker process (1)")
    parser.add_argument("--partitions", type=int, default=16, help="partitions of each requests topic")
    parser.add_argument("--requests", type=int, default=None, help="requests (default 8192; quick 192)")
    parser.add_argument("--saturation-timeout", type=float, default=240.0)
    parser.add_argument("--latency-seconds", type=float, default=None, help="paced phase (20; quick 3)")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--broker", choices=LOCAL_BROKERS, default="embedded")
    parser.add_argument("--json", type=Path, default=None, help="output file (default $OUT/w2_scale.json)")
    args = parser.parse_args(argv)
    args.requests = args.requests or (192 if args.quick else 8192)
    args.latency_seconds = args.latency_seconds or (3.0 if args.quick else 20.0)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    shapes = W2_QUICK_SHAPES if args.quick else W2_SHAPES
    report = report_header(args)
    counts = sorted({1, args.gpus // args.tensor_parallel})
    with tempfile.TemporaryDirectory() as scratch, start_local_broker(args.broker) as broker:
        model_dir = w2_model_dir(shapes, device, Path(scratch))
        runs = {
            f"{n} worker processes": run_count(args, broker, model_dir, n, device, shapes["vocab_size"])
            for n in counts
        }
    failures = [f"{name}: {run['correctness']}" for name, run in runs.items() if not run["correctness"]["ok"]]
    one, many = runs[f"{counts[0]} worker processes"], runs[f"{counts[-1]} worker processes"]
    report["runs"] = runs
    report["scaling"] = many["items_per_s"] / max(one["items_per_s"], 1e-9)
    for name, run in runs.items():
        print(f"{name}: saturation {run['items_per_s']:,.1f} items/s (ready in {run['ready_s']:.1f} s)")
    print(f"{counts[-1]} over 1: {report['scaling']:.2f}x")
    if "latency" in many:
        print(f"half load at {counts[-1]}: {json.dumps(many['latency'].get('latency', {}))}")
    return write_verdict(report, failures, report_path("w2_scale", args.json, args.quick), "w2_scale")


if __name__ == "__main__":
    sys.exit(main())
