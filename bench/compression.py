"""What the results codec costs and saves: W2-shaped results with pooled hidden states (bfloat16 and float32),
published through the worker's own Publisher to a real broker under each codec Kafka defines, against
uncompressed in the same process: bytes the broker stores and time until it acknowledged everything.

Every record is read back and compared with what was sent, byte for byte, and the pooled hidden states in
it against a float32 forward of HuggingFace's own model on a sample: a run whose results do not match exits 1.

    python3 bench/compression.py                 # embedded broker, W2's model shapes with 2 layers on the CPU
    python3 bench/compression.py --bootstrap HOST:PORT --layers 28
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import w2_load
from bench.common import (
    W2_SHAPES,
    add_options,
    argument_parser,
    check_sample,
    pick_device,
    report_header,
    report_path,
    sample_entry,
    w2_model_dir,
    write_verdict,
)
from models import Scorer, ScorerConfig
from schemas import HiddenDType, ScoreRequest, ScoreResult, decode_result
from worker.broker import EmbeddedBroker
from worker.codecs import CODEC_NAMES
from worker.config import WorkerSettings
from worker.publisher import OutRecord, Publisher, result_record
from worker.topics import create_missing_topics
from worker.undecodable import parse_batch

DTYPES = (HiddenDType.BFLOAT16, HiddenDType.FLOAT32)
# The prompts' length does not change a result's size, only the forward's cost: on the CPU they are cut to
# this many tokens (the 1-4 items and the hidden-state half of W2 are kept).
CPU_ITEM_TOKENS = 32


@dataclass(frozen=True)
class Run:
    codec: str
    dtype: str
    stored_bytes: int
    publish_s: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argument_parser(__doc__)
    add_options(parser, "compression", reference_sample=8)
    parser.add_argument("--bootstrap", help="a broker to publish to (default: an embedded one)")
    parser.add_argument("--requests", type=int, default=1024, help="W2 requests scored (1024)")
    parser.add_argument(
        "--layers", type=int, default=None, help="decoder layers (default: 28 on CUDA, 2 on CPU)"
    )
    parser.add_argument("--group", type=int, default=64, help="results handed to the producer at once (64)")
    parser.add_argument("--repeats", type=int, default=3, help="publishes per codec and dtype, median (3)")
    return parser.parse_args(argv)


def score(
    args: argparse.Namespace, device: str, workdir: Path
) -> tuple[Path, list[ScoreRequest], dict[str, list[ScoreResult]]]:
    """W2's requests scored once per hidden-state dtype by the project's Scorer."""
    layers = args.layers or (28 if device == "cuda" else 2)
    model_dir = w2_model_dir({**W2_SHAPES, "num_hidden_layers": layers}, device, workdir)
    cut = CPU_ITEM_TOKENS if device == "cpu" else None
    requests = w2_load.w2_requests(args.requests, W2_SHAPES["vocab_size"], cut)
    # Compiled layers and graphs change how fast, not what: the results are the same bytes to compress.
    scorer = Scorer(str(model_dir), ScorerConfig(device=device, compile="off", cuda_graphs="off"))
    scored = {}
    for dtype in DTYPES:
        asked = [_with_dtype(r, dtype) for r in requests]
        scored[dtype.value] = scorer.score(asked)
        bad = [r.request_id for r in scored[dtype.value] if r.error is not None]
        if bad:
            raise SystemExit(f"scoring failed for {len(bad)} requests, e.g. {bad[:3]}")
    return model_dir, requests, scored


def _with_dtype(request: ScoreRequest, dtype: HiddenDType) -> ScoreRequest:
    return dataclasses.replace(request, hidden_states_dtype=dtype)


async def publish(bootstrap: str, codec: str, records: list[OutRecord], group: int, tag: str) -> Run:
    """Publish `records` to a fresh topic as the worker does (a model batch's results at once), then read
    everything back and compare; the bytes the broker stores are summed from the raw batches."""
    topic = f"compression-{tag}-{codec}"
    await create_missing_topics({"bootstrap_servers": bootstrap}, [topic], 1, 1)
    settings = WorkerSettings(
        bootstrap_servers=bootstrap, model_dir=Path(tempfile.gettempdir()), results_topic=topic,
        results_compression=codec,
    )  # fmt: skip
    publisher = Publisher(settings)
    await publisher.start()
    aimed = [OutRecord(topic, r.key, r.value, r.headers, r.result) for r in records]
    try:
        started = time.perf_counter()
        for i in range(0, len(aimed), group):
            await publisher.deliver(aimed[i : i + group])
        publish_s = time.perf_counter() - started
    finally:
        await publisher.stop()
    stored = await read_back(bootstrap, topic, aimed)
    return Run(codec, "", stored, publish_s)


async def read_back(bootstrap: str, topic: str, sent: list[OutRecord]) -> int:
    """Every record as sent (key, value, headers), in order; returns the stored bytes of its batches."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    tp = TopicPartition(topic, 0)
    try:
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        got: list[Any] = []
        deadline = time.monotonic() + 60
        while len(got) < len(sent) and time.monotonic() < deadline:
            batches = await consumer.getmany(tp, timeout_ms=500)
            got += batches.get(tp, [])
        if [(r.key, r.value, list(r.headers)) for r in got] != [(r.key, r.value, r.headers) for r in sent]:
            raise SystemExit(f"{topic}: {len(got)} records read back, not the {len(sent)} sent as sent")
        return await stored_bytes(consumer, tp, len(sent))
    finally:
        await consumer.stop()


async def stored_bytes(consumer: AIOKafkaConsumer, tp: TopicPartition, records: int) -> int:
    """The sizes of the partition's batches as the broker stores them, from raw fetches."""
    from aiokafka.protocol.fetch import FetchRequest

    client = consumer._client
    node = client.cluster.leader_for_partition(tp)
    offset, total = 0, 0
    while offset < records:
        request = FetchRequest(100, 1, 64 << 20, 0, [(tp.topic, [(tp.partition, offset, 64 << 20)])])
        response = await client.send(node, request)
        data = bytes(response.topics[0][1][0][-1])
        batch = parse_batch(data, offset)
        while batch is not None and batch.complete:
            total += len(batch.data)
            offset = batch.last_offset + 1
            data = data[len(batch.data) :]
            batch = parse_batch(data, offset)
    return total


def check_against_float32(
    model_dir: Path, device: str, requests: list[ScoreRequest], records: list[OutRecord], sample: int
) -> dict[str, Any]:
    """The first `sample` results as published (every codec's copy was read back equal to these bytes)
    against HF's float32 forward, with common.check_sample's bounds."""
    entries = [
        sample_entry(request.items, decode_result(record.value or b""))  # type: ignore[arg-type]
        for request, record in zip(requests[:sample], records[:sample], strict=True)
    ]
    return check_sample(model_dir, device, entries)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    failures: list[str] = []
    device = pick_device("the compression benchmark", cpu_allowed=True) or "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, requests, scored = score(args, device, Path(tmp))
        report: dict[str, Any] = {**report_header(), "requests": args.requests, "runs": []}
        broker = None if args.bootstrap else EmbeddedBroker().start()
        bootstrap = args.bootstrap or broker.bootstrap_servers  # type: ignore[union-attr]
        try:
            settings = WorkerSettings(bootstrap_servers=bootstrap, model_dir=model_dir)
            for dtype, results in scored.items():
                records = [result_record(settings, r.request_id.encode(), r) for r in results]
                check = check_against_float32(model_dir, device, requests, records, args.reference_sample)
                report[f"correctness_{dtype}"] = check
                if not check["ok"]:
                    failures.append(f"{dtype} results differ from HF float32: {check}")
                for codec in CODEC_NAMES:
                    runs = [
                        asyncio.run(
                            publish(bootstrap, codec, records, args.group, f"{dtype}-{i}-{time.time_ns()}")
                        )
                        for i in range(args.repeats)
                    ]
                    report["runs"].append(
                        {
                            "codec": codec, "dtype": dtype, "records": len(records),
                            "stored_bytes": runs[0].stored_bytes,
                            "publish_s": statistics.median(r.publish_s for r in runs),
                            "publish_s_all": [r.publish_s for r in runs],
                        }
                    )  # fmt: skip
        finally:
            if broker is not None:
                broker.stop()
    print_table(report["runs"])
    return write_verdict(report, failures, report_path("compression", args.json), "compression")


def print_table(runs: list[dict[str, Any]]) -> None:
    """One line per dtype and codec, with the ratios to the same dtype uncompressed."""
    base = {r["dtype"]: r for r in runs if r["codec"] == "none"}
    print(f"{'dtype':9} {'codec':7} {'stored MiB':>10} {'vs none':>8} {'publish s':>10} {'vs none':>8}")
    for r in runs:
        b = base[r["dtype"]]
        stored, publish_s = r["stored_bytes"], r["publish_s"]
        print(
            f"{r['dtype']:9} {r['codec']:7} {stored / 2**20:10.2f} {stored / b['stored_bytes']:8.3f} "
            f"{publish_s:10.3f} {publish_s / b['publish_s']:8.3f}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
