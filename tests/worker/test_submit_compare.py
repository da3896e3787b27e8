"""`score-worker submit --compare`: the flags fill each line's comparison fields, require them of the worker,
and a line that cannot be compared stops the command before anything is sent."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from schemas import Compare
from worker.cli import main as cli_main
from worker.submit import InputError, _line_defaults, parse_request_line


def _defaults(compare: str | None, column: int | None = None) -> dict[str, object]:
    return _line_defaults(argparse.Namespace(compare=compare, reward_column=column))


def test_flags_fill_lines_that_do_not_say_and_require_compare() -> None:
    line = json.dumps({"request_id": "a", "query": "q", "items": ["x", "y", "z"]})
    request = parse_request_line(line, 1, _defaults("rank", 0))
    assert (request.compare, request.reward_column) == (Compare.RANK, 0)
    assert request.requires == ("compare",)
    own = json.dumps(
        {"request_id": "b", "items": ["x", "y"], "compare": "pairwise", "requires": ["messages"]}
    )
    kept = parse_request_line(own, 2, _defaults("rank"))
    assert kept.compare is Compare.PAIRWISE  # the line's own choice stands
    assert kept.requires == ("messages", "compare")
    plain = parse_request_line(own.replace('"compare": "pairwise", ', ""), 3, _defaults(None))
    assert plain.compare is None and plain.requires == ("messages",)


def test_a_reward_column_needs_compare() -> None:
    with pytest.raises(InputError, match="--compare"):
        _defaults(None, 1)


def test_a_line_that_cannot_be_compared_stops_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "requests.jsonl"
    source.write_text(json.dumps({"items": ["only one"]}) + "\n", encoding="utf-8")
    args = ["submit", "--bootstrap-servers", "127.0.0.1:9", "--input", str(source), "--compare", "pairwise"]
    assert cli_main(args) == 2
    assert "line 1: COMPARE_INVALID" in capsys.readouterr().err
