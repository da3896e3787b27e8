"""The README's examples must stay true: its Python example and its hex dump run against the real codec."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from schemas import (
    ErrorCode,
    HiddenDType,
    ResultStatus,
    ScoreResult,
    Tensor,
    decode_request,
    encode_result,
    headers_to_dict,
)

README = Path(__file__).resolve().parents[2] / "schemas" / "README.md"


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.DOTALL)


@pytest.fixture(scope="module")
def example() -> dict[str, Any]:
    (source,) = code_blocks("python")
    namespace: dict[str, Any] = {"__name__": "readme_example"}  # not "__main__": nothing is sent
    exec(compile(source, str(README), "exec"), namespace)
    return namespace


def test_python_example_builds_a_valid_request(example: dict[str, Any]) -> None:
    key, value, headers = example["make_request"](
        "Q: ", ["a", "b"], hidden_dtype="bfloat16", metadata={"n": 1}
    )
    request = decode_request(value)
    assert key == request.request_id.encode()
    assert request.items == ("a", "b") and request.query == "Q: " and request.metadata == {"n": 1}
    assert request.return_pooled_hidden_states and request.hidden_states_dtype is HiddenDType.BFLOAT16
    as_dict = headers_to_dict(headers)
    assert as_dict["x-request-id"] == key and as_dict["x-schema-version"] == b"1"
    assert as_dict["content-type"] == b"application/vnd.score-worker.request.v1+msgpack"


def test_python_example_reads_results_of_every_dtype(example: dict[str, Any]) -> None:
    values = np.array([1.0, -2.5, 3.140625], dtype=np.float32)
    bf16_bits = (values.view(np.uint32) >> 16).astype(np.uint16)
    pooled = (
        Tensor.from_numpy(values),
        Tensor.from_numpy(values.astype(np.float16)),
        Tensor.from_bfloat16_bits(bf16_bits),
    )
    result = ScoreResult("r", ResultStatus.OK, scores=((0.5,), (1.5,), (2.5,)), pooled_hidden_states=pooled)
    scores, states = example["read_result"](encode_result(result))
    assert scores == [[0.5], [1.5], [2.5]]
    assert states == [values.tolist()] * 3
    failure = ScoreResult.failure("r", ErrorCode.EMPTY_INPUT, "items[0] is empty; give it content.")
    with pytest.raises(RuntimeError, match="EMPTY_INPUT"):
        example["read_result"](encode_result(failure))


def test_hex_dump_matches_the_encoder() -> None:
    text = README.read_text(encoding="utf-8")
    dump = text.split("is 37 bytes:\n\n```\n", 1)[1].split("```", 1)[0]
    # Each line is "<hex bytes>   <description>": the hex column ends at the first run of spaces.
    hex_bytes = "".join(re.split(r"\s{2,}", line)[0].replace(" ", "") for line in dump.splitlines())
    tensor = Tensor.from_numpy(np.array([1.0, -2.5, 3.140625], dtype=np.float32))
    bits = np.frombuffer(tensor.data, dtype="<u4") >> 16
    wire = {"dtype": "bfloat16", "shape": [3], "data": bits.astype("<u2").tobytes()}
    assert bytes.fromhex(hex_bytes) == msgpack.packb(wire)
    assert len(msgpack.packb(wire)) == 37
