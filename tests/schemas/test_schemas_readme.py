"""The README must stay true: its Python example, JSON maps and hex dump run against the real codec, its
JavaScript example parses, and its tables list exactly the fields and error codes the code has."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from schemas import (
    ChatMessage,
    ErrorCode,
    HiddenDType,
    ResultStatus,
    SchemaError,
    ScoreRequest,
    ScoreResult,
    Tensor,
    Truncation,
    decode_request,
    decode_result,
    encode_request,
    encode_result,
    headers_to_dict,
)
from schemas.request import REQUEST_FIELDS

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


def test_python_example_passes_other_request_fields(example: dict[str, Any]) -> None:
    _, value, _ = example["make_request"](
        "Q: ", ["a"], truncate="item_right", label_token_ids=[3, 4], requires=["truncate"]
    )
    request = decode_request(value)
    assert request.truncate is Truncation.ITEM_RIGHT and request.label_token_ids == (3, 4)
    assert request.requires == ("truncate",)


def test_python_example_builds_a_judge_request(example: dict[str, Any]) -> None:
    conversation = [("system", "Reply Yes or No."), ("user", "Is 2 + 2 = 4?")]
    key, value, _ = example["make_judge_request"](conversation, ["Yes, it is.", "No."], [7566, 2360])
    request = decode_request(value)
    assert key == request.request_id.encode() and request.query is None
    assert request.messages == (
        ChatMessage("system", "Reply Yes or No."),
        ChatMessage("user", "Is 2 + 2 = 4?"),
    )
    assert request.items == ("Yes, it is.", "No.") and request.label_token_ids == (7566, 2360)
    assert request.apply_softmax and request.truncate is Truncation.QUERY_LEFT
    assert request.requires == ("messages", "label_token_ids", "truncate")


def test_json_examples_are_valid_messages() -> None:
    blocks = [json.loads(block) for block in code_blocks("json")]
    assert blocks, "the README shows its example maps as JSON blocks"
    for body in blocks:
        decode = decode_result if "status" in body else decode_request
        encode: Any = encode_result if "status" in body else encode_request
        decoded = decode(msgpack.packb(body))
        wire = msgpack.unpackb(encode(decoded))
        # Every key shown is a field, read as shown; the encoder adds only defaults for keys left out.
        assert {key: wire[key] for key in body} == body
    kinds = {"status" in body for body in blocks}
    assert kinds == {True, False}


def test_quoted_requires_message_is_the_real_one() -> None:
    text = README.read_text(encoding="utf-8")
    quoted = re.search(r'`"requires": \["pooling"\]` gets the message `([^`]*)`', text)
    assert quoted is not None
    with pytest.raises(SchemaError) as caught:
        ScoreRequest("r", items=(), requires=("pooling",))
    assert " ".join(quoted.group(1).split()) == caught.value.message


def table_keys(section: str) -> list[str]:
    """The first-column names of the table in the README section whose heading starts with `section`."""
    text = README.read_text(encoding="utf-8")
    body = text.split(f"\n## {section}", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+)` \|", body, flags=re.MULTILINE)


def test_tables_list_every_field_and_code() -> None:
    assert sorted(table_keys("3.")) == sorted(REQUEST_FIELDS)
    assert sorted(table_keys("5.")) == sorted(ScoreResult.__dataclass_fields__)
    assert table_keys("7.") == [code.value for code in ErrorCode]


def test_javascript_example_parses(tmp_path: Path) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    (source,) = code_blocks("js")
    module = tmp_path / "example.mjs"
    module.write_text(source, encoding="utf-8")
    proc = subprocess.run([node, "--check", str(module)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


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
    # Exact: the values have at most 8 significant bits (3.140625 = 201 / 64), so float16 and bfloat16 hold
    # them exactly and every dtype reads back the same float32 values, bit for bit.
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
