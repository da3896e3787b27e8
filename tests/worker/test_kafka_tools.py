"""Kafka's own command-line tools and kcat as peers of the worker, beside confluent-kafka and kafkajs.

- kcat (librdkafka) produces requests, one record per file, under every codec: each is scored as the
  float32 reference scores it. kcat then reads the results back.
- Kafka's console producer (Java, `compression.type` each codec) writes text lines, which are not msgpack
  requests: each gets its MALFORMED_MESSAGE error result (its id from the x-request-id header) and a
  dead-letter copy, and the worker goes on. The console producer writes text only, so valid requests
  cannot come from it.
- Kafka's console consumer reads the results; `kafka-consumer-groups --describe` reports the worker's
  group with every partition committed to its end (lag 0).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import raw_batches
from aiokafka.structs import ConsumerRecord
from brokers import BrokerPool, described_offsets, not_here
from fault_kit.traffic import wait_until
from tolerances import assert_scored_alike
from worker_testkit import LiveWorker, produce, read_topic, request_record

from models import Scorer
from schemas import ErrorCode, ResultStatus, ScoreRequest, decode_result, encode_request
from schemas.headers import HEADER_REQUEST_ID, header_value
from worker.apache_kafka import ApacheKafka

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CODECS = ("none", "gzip", "snappy", "lz4", "zstd")
PER_CODEC = 4


@pytest.fixture(scope="module")
def kafka(broker_pool: BrokerPool) -> ApacheKafka:
    broker = broker_pool.broker("default")
    if broker.cluster is None:
        not_here(
            f"Kafka's tools run from the jars of an Apache Kafka the tests started, not {broker.description}"
        )
    return broker.cluster


@pytest.fixture(scope="module")
def kcat() -> str:
    found = shutil.which("kcat") or shutil.which("kafkacat")
    if found is None:
        not_here("kcat is not installed (apt-get install kcat)")
    return found


def test_kcat_writes_requests_under_every_codec_and_reads_the_results(
    kafka: ApacheKafka, kcat: str, live_worker: LiveWorker, reference: Scorer, tmp_path: Path
) -> None:
    names = live_worker.names
    requests = {
        codec: [
            ScoreRequest(
                request_id=f"kcat-{codec}-{i}", items=(f"kcat says {codec} {i}", "and more"), query="q?"
            )
            for i in range(PER_CODEC)
        ]
        for codec in CODECS
    }
    for codec, batch in requests.items():
        files = []
        for request in batch:
            path = tmp_path / f"{request.request_id}.msgpack"
            path.write_bytes(encode_request(request))
            files.append(str(path))
        # One record per file, in one produce batch under the codec; the id travels in a header as well.
        subprocess.run(
            [kcat, "-P", "-b", kafka.bootstrap_servers, "-t", names.requests, "-z", codec,
             "-X", "linger.ms=50", "-H", "content-type=application/msgpack", *files],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
    assert set(raw_batches.stored_codecs(kafka.bootstrap_servers, names.requests, 3)) >= set(CODECS) - {
        "none"
    }

    every = [r for batch in requests.values() for r in batch]
    wanted = {r.request_id for r in every}
    records = asyncio.run(read_topic(kafka.bootstrap_servers, names.results, len(every), settle_s=0.5))
    results = {}
    for record in records:
        result = decode_result(record.value or b"")
        if result.request_id in wanted:
            assert result.request_id not in results, f"{result.request_id} answered twice"
            results[result.request_id] = result
    assert set(results) == wanted
    for request, expected in zip(every, reference.score(every), strict=True):
        assert results[request.request_id].status == ResultStatus.OK, results[request.request_id].error
        assert_scored_alike(results[request.request_id], expected, reference, [request])

    # kcat reads them back: each result's headers name its request (the records were sent without keys).
    done = subprocess.run(
        [kcat, "-C", "-b", kafka.bootstrap_servers, "-t", names.results, "-o", "beginning", "-e", "-q",
         "-f", "%h\\n"],
        check=True, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    read_back = Counter(
        header.split("=", 1)[1]
        for line in done.stdout.splitlines()
        for header in line.split(",")
        if header.startswith(f"{HEADER_REQUEST_ID}=")
    )
    assert {rid: read_back[rid] for rid in wanted} == dict.fromkeys(wanted, 1)


def test_the_console_producer_under_every_compression_type_gets_an_error_result_per_line(
    kafka: ApacheKafka, live_worker: LiveWorker
) -> None:
    names = live_worker.names
    ids = [f"console-{codec}-{i}" for codec in CODECS for i in range(PER_CODEC)]
    for codec in CODECS:
        # header, key and value of each line, tab-separated, as parse.headers and parse.key read them
        lines = "".join(
            f"{HEADER_REQUEST_ID}:console-{codec}-{i}\tconsole-{codec}-{i}\tscore this please ({codec})\n"
            for i in range(PER_CODEC)
        )
        kafka.run_tool(
            "kafka-console-producer", "--bootstrap-server", kafka.bootstrap_servers,
            "--topic", names.requests, "--producer-property", f"compression.type={codec}",
            "--producer-property", "linger.ms=50",
            "--property", "parse.key=true", "--property", "parse.headers=true",
            input_text=lines,
        )  # fmt: skip

    async def answers() -> tuple[dict[str, ErrorCode | None], list[str]]:
        results = await read_topic(kafka.bootstrap_servers, names.results, len(ids), settle_s=0.5)
        codes = {}
        for record in results:
            result = decode_result(record.value or b"")
            if result.request_id in ids:
                assert result.request_id not in codes, f"{result.request_id} answered twice"
                assert result.status == ResultStatus.ERROR
                codes[result.request_id] = result.error.code if result.error else None
        letters = await read_topic(kafka.bootstrap_servers, names.dlq, len(ids), settle_s=0.5)
        dead = [(header_value(r.headers, HEADER_REQUEST_ID) or b"").decode() for r in letters]
        return codes, dead

    codes, dead = asyncio.run(answers())
    assert codes == dict.fromkeys(ids, ErrorCode.MALFORMED_MESSAGE)
    assert Counter(d for d in dead if d in ids) == Counter(ids)  # one dead-letter copy each


def test_the_console_consumer_and_consumer_groups_see_what_the_worker_did(
    kafka: ApacheKafka, live_worker: LiveWorker
) -> None:
    names = live_worker.names
    requests = [ScoreRequest(request_id=f"tools-{i}", items=(f"read me back {i}",)) for i in range(5)]
    asyncio.run(produce(kafka.bootstrap_servers, names.requests, [request_record(r) for r in requests]))

    async def all_answers() -> list[ConsumerRecord[bytes, bytes]]:
        # The results topic also holds what the module's other tests were answered, when they ran first.
        wanted = {r.request_id for r in requests}
        for _ in range(60):
            records = await read_topic(kafka.bootstrap_servers, names.results, 1, settle_s=0.5)
            if wanted <= {decode_result(r.value or b"").request_id for r in records}:
                return records
        raise AssertionError("the worker did not answer")

    answered = asyncio.run(all_answers())
    # Kafka 4 names the formatter's options --formatter-property (--property is deprecated there).
    option = "--formatter-property" if int(kafka.version.split(".")[0]) >= 4 else "--property"
    done = kafka.run_tool(
        "kafka-console-consumer", "--bootstrap-server", kafka.bootstrap_servers, "--topic", names.results,
        "--from-beginning", "--max-messages", str(len(answered)), "--timeout-ms", "30000",
        option, "print.key=true", option, "print.value=false",
    )  # fmt: skip
    keys = done.stdout.split()
    # A result keeps its request's key; the formatter prints a missing one as "null".
    assert Counter(keys) == Counter(r.key.decode() if r.key is not None else "null" for r in answered)

    # The worker commits what it answered: Kafka's own tool reports every partition at its end.
    def committed_to_the_end() -> bool:
        _, rows = described_offsets(kafka, names.group, names.requests)
        return all(current == end for current, end in rows.values())

    asyncio.run(wait_until(committed_to_the_end, 60, "the group committed to the log's end", poll_s=1.0))
