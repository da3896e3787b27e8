"""The JavaScript example of schemas/README.md, executed: kafkajs and @msgpack/msgpack from npm send
requests built by the example's makeRequest to a real worker and read the results with its readResult."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from tolerances import assert_scored_alike, forward_atol, rounded_pair_tolerances
from worker_testkit import LiveWorker

from schemas import HiddenDType, ResultStatus, ScoreRequest, ScoreResult

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kafkajs@2", "@msgpack/msgpack@3", "fzstd@0.1")

# Sends the requests through the README's makeRequest, reads every result with its readResult. The group
# joins before anything is sent, and reads the (fresh) results topic from its start.
DRIVER = """
import { Kafka, logLevel } from "kafkajs";
import { makeImageRequest, makeRequest, readResult } from "./example.mjs";

const [bootstrap, requestsTopic, resultsTopic, inputs] = process.argv.slice(2);
const kafka = new Kafka({ clientId: "readme-example", brokers: [bootstrap], logLevel: logLevel.ERROR });
const wanted = JSON.parse(inputs);
const consumer = kafka.consumer({
  groupId: `readme-${Date.now()}`, sessionTimeout: 6000, heartbeatInterval: 1000,
});
await consumer.connect();
await consumer.subscribe({ topic: resultsTopic, fromBeginning: true });
const results = new Map();
let done;
const finished = new Promise((resolve) => { done = resolve; });
await consumer.run({ eachMessage: async ({ message }) => {
  const result = readResult(message.value);
  if (ids.has(result.id)) {
    results.set(result.id, { ...result, states: result.states?.map((s) => Array.from(s)) });
  }
  if (results.size === ids.size) done();
} });
const producer = kafka.producer();
await producer.connect();
const messages = wanted.map(({ query, items, image }) => (
  image ? makeImageRequest(query, items, Buffer.from(image, "base64")) : makeRequest(query, items)
));
const ids = new Map(messages.map((m, i) => [m.key, i]));
await producer.send({ topic: requestsTopic, messages });
const timer = setTimeout(() => {
  console.error(`timed out with ${results.size} of ${ids.size}`);
  process.exit(3);
}, 120000);
await finished;
clearTimeout(timer);
console.log(JSON.stringify([...results.values()].map((r) => ({ ...r, index: ids.get(r.id) }))));
await producer.disconnect();
await consumer.disconnect();
"""


def readme_javascript() -> str:
    text = (ROOT / "schemas" / "README.md").read_text()
    match = re.search(r"JavaScript, with `@msgpack/msgpack`.*?```js\n(.*?)```", text, re.S)
    assert match, "schemas/README.md has no JavaScript example"
    return match.group(1)


def run_readme_example(
    live: LiveWorker, tmp_path: Path, inputs: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The README's example sends `inputs` (token ids, or texts with a base64 image) to the worker through
    the driver; its results, in the order of `inputs`."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip(
            "Node.js (node and npm) is not installed here: the README's JavaScript example is not run"
        )
    (tmp_path / "package.json").write_text(json.dumps({"type": "module", "private": True}))
    install = subprocess.run(
        ["npm", "install", "--no-audit", "--no-fund", "--silent", *PACKAGES],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-3000:]
    (tmp_path / "example.mjs").write_text(readme_javascript())
    (tmp_path / "driver.mjs").write_text(DRIVER)
    names = live.names
    proc = subprocess.run(
        ["node", "driver.mjs", live.bootstrap, names.requests, names.results, json.dumps(inputs)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = sorted(json.loads(proc.stdout.strip().splitlines()[-1]), key=lambda r: r["index"])
    assert len(got) == len(inputs)
    return got


def test_the_readme_javascript_example_sends_an_image(live_vision_worker: LiveWorker, tmp_path: Path) -> None:
    buffer = io.BytesIO()
    pixels = (np.random.default_rng(5).random((24, 36, 3)) * 255).astype(np.uint8)
    Image.fromarray(pixels).save(buffer, "PNG")
    image = buffer.getvalue()
    inputs = [
        {"query": "Which animal? ", "items": ["a cat", "a dog"], "image": base64.b64encode(image).decode()}
    ]
    (result,) = run_readme_example(live_vision_worker, tmp_path, inputs)
    request = ScoreRequest(
        result["id"], items=("a cat", "a dog"), query="Which animal? ", images=(image,),
        return_pooled_hidden_states=True, hidden_states_dtype=HiddenDType.BFLOAT16,
    )  # fmt: skip
    (expected,) = live_vision_worker.scorer.score([request])
    assert expected.ok, expected.error
    scores = ScoreResult(result["id"], ResultStatus.OK, scores=tuple(map(tuple, result["scores"])))
    assert_scored_alike(
        scores, replace(expected, pooled_hidden_states=None), live_vision_worker.scorer, [request]
    )
    assert len(result["states"]) == 2


def test_the_readme_javascript_example_scores_through_a_worker(
    live_worker: LiveWorker, tmp_path: Path
) -> None:
    inputs = [{"query": [12, 40], "items": [[5, 17, 42, 99], [7, 8]]}, {"query": [], "items": [[9, 10, 11]]}]
    got = run_readme_example(live_worker, tmp_path, inputs)
    for result, sent in zip(got, inputs, strict=True):
        items = tuple(tuple(i) for i in sent["items"])
        request = ScoreRequest(
            result["id"], items=items, query=tuple(sent["query"]), return_pooled_hidden_states=True,
            hidden_states_dtype=HiddenDType.BFLOAT16,
        )  # fmt: skip
        (expected,) = live_worker.scorer.score([request])
        assert expected.pooled_hidden_states is not None and result["truncated"] is None
        scores = ScoreResult(result["id"], ResultStatus.OK, scores=tuple(map(tuple, result["scores"])))
        assert_scored_alike(
            scores, replace(expected, pooled_hidden_states=None), live_worker.scorer, [request]
        )
        model_dir = Path(live_worker.scorer.hf_model.name_or_path)
        longest = len(sent["query"]) + max(len(item) for item in sent["items"])
        for state, want in zip(result["states"], expected.pooled_hidden_states, strict=True):
            widened = np.array(state, dtype=np.float32)
            # The README's tensorToFloat32 widens bfloat16 exactly: the low 16 bits of each float32 are 0.
            assert not (widened.view(np.uint32) & 0xFFFF).any()
            # Another batch than this scorer's: two float32 forwards, each rounded once to bfloat16.
            wanted = want.to_numpy().astype(np.float64)
            bound = forward_atol(model_dir, wanted, longest=longest)
            atol, rtol = rounded_pair_tolerances(torch.bfloat16, bound)
            np.testing.assert_allclose(widened.astype(np.float64), wanted, atol=atol, rtol=rtol)
