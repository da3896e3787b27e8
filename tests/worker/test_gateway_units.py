"""The gateway's pure pieces: vLLM's activations, the input shapes each route accepts, hidden-state
encodings and the status of every worker error code."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from schemas import ErrorCode, Tensor
from worker.gateway.bodies import vector
from worker.gateway.calls import activated, inputs
from worker.gateway.errors import GatewayError, status_of

# Both sides are float64 evaluations of the same functions (math's and numpy's exp), a few ulps apart at most.
CLOSE = 1e-12


def test_activations_are_vllms_and_do_not_overflow() -> None:
    logits = [3.0, -1.5, 0.25]
    shifted = np.exp(np.array(logits) - max(logits))
    np.testing.assert_allclose(activated(logits, True), shifted / shifted.sum(), rtol=CLOSE)
    assert activated(logits, False) == logits
    for x in (-800.0, -3.0, 0.0, 2.5, 800.0):  # exp(800) overflows: each side of zero takes its own form
        expected = 0.5 * (1.0 + np.tanh(x / 2.0))  # the logistic function, written another way
        assert activated([x], True)[0] == pytest.approx(expected, rel=CLOSE, abs=1e-300)
    huge = activated([1000.0, 999.0], True)
    assert huge[0] == pytest.approx(1 / (1 + np.exp(-1.0)), rel=CLOSE) and sum(huge) == pytest.approx(1.0)


def test_inputs_take_every_shape_the_references_take() -> None:
    assert inputs("a", "input") == ["a"]
    assert inputs([1, 2], "input") == [[1, 2]]
    assert inputs(["a", "b"], "input") == ["a", "b"]
    assert inputs([[1], [2, 3]], "input") == [[1], [2, 3]]
    assert inputs([], "input") == []
    for bad in (None, 3, [True], ["a", 3], [[1, "x"]], {"text": "a"}):
        with pytest.raises(GatewayError) as refused:
            inputs(bad, "input")
        assert refused.value.status == 400 and refused.value.param is not None


def test_hidden_states_as_floats_or_little_endian_float32_base64() -> None:
    values = np.array([1.5, -2.25, 3.0e-8], dtype=np.float32)
    for tensor in (Tensor.from_numpy(values), Tensor.from_numpy(values.astype(">f4"))):
        assert vector(tensor, "float") == values.tolist()
        assert base64.b64decode(vector(tensor, "base64")) == values.astype("<f4").tobytes()
    half = Tensor.from_numpy(values.astype(np.float16))  # widened exactly to float32
    assert vector(half, "float") == values.astype(np.float16).astype(np.float32).tolist()


def test_every_worker_error_code_has_a_status() -> None:
    statuses = {code: status_of(code) for code in ErrorCode}
    assert statuses[ErrorCode.EXPIRED] == 504 and statuses[ErrorCode.TOO_MANY_ITEMS] == 413
    assert statuses[ErrorCode.INVALID_REQUEST] == 400 and statuses[ErrorCode.MODEL_ERROR] == 500
    assert set(statuses.values()) <= {400, 413, 500, 502, 504}
