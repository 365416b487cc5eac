"""The batch file format: input lines, duplicate custom_ids, resuming from a cut output file."""

from __future__ import annotations

import json

import pytest

from verispec.batch.records import (
    BadLine, BatchRequest, ResultsFile, bad_line_record, parse_line, read_done, read_requests, response_record,
)


def _line(**fields) -> str:
    entry = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "x"}}
    return json.dumps({k: v for k, v in (entry | fields).items() if v is not None})


@pytest.mark.parametrize("text, custom_id, expected", [
    ('{"custom_id": "a", "method"', None, "line 7 is not JSON"),
    ('["a"]', None, "line 7 is a JSON list"),
    (_line(custom_id=""), None, "custom_id=''"),
    (_line(custom_id=3), None, "custom_id=3"),
    (_line(method="GET"), "a", "method='GET' is invalid"),
    (_line(url="/v1/embeddings"), "a", "url='/v1/embeddings' is invalid"),
    (_line(body="prompt"), "a", "body is a str"),
    (_line(body={"model": "m", "prompt": "x", "stream": True}), "a", "body.stream is true"),
])
def test_a_line_that_is_no_request_says_why(text: str, custom_id: str | None, expected: str) -> None:
    bad = parse_line(7, text)
    assert isinstance(bad, BadLine) and bad.custom_id == custom_id and expected in bad.message
    record = bad_line_record(bad)
    assert record["response"] is None and record["error"]["code"] == "invalid_request"
    assert ("line" in record) == (custom_id is None)


def test_a_request_keeps_its_body_as_the_server_would_receive_it() -> None:
    request = parse_line(3, _line(url="/v1/chat/completions", body={"model": "m", "n": "2"}))
    assert request == BatchRequest(3, "a", "/v1/chat/completions", b'{"model": "m", "n": "2"}')


def test_repeated_custom_ids_are_refused_naming_their_lines(tmp_path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([_line(custom_id="a"), _line(custom_id="b"), "", _line(custom_id="a")]) + "\n")
    with pytest.raises(ValueError, match=r"'a' \(lines 1 and 4\)"):
        read_requests(path)


def test_an_error_status_is_an_error_record() -> None:
    body = json.dumps({"error": {"message": "n: bad", "type": "invalid_request_error", "param": "n", "code": None}})
    record = response_record("a", 400, body.encode())
    assert record["error"] == {"code": "invalid_request_error", "message": "n: bad"}
    assert record["response"]["status_code"] == 400 and record["response"]["body"] == json.loads(body)
    ok = response_record("b", 200, b'{"id": "cmpl-1", "choices": []}')
    assert ok["error"] is None and ok["response"]["request_id"] == "cmpl-1"


def test_resuming_drops_a_line_cut_short_and_keeps_whole_ones(tmp_path) -> None:
    path = tmp_path / "out.jsonl"
    first, second = bad_line_record(BadLine(1, "a", "x")), bad_line_record(BadLine(2, None, "y"))
    whole = json.dumps(first) + "\n" + json.dumps(second) + "\n"
    path.write_text(whole + json.dumps(first)[:25])  # the kill came mid-write
    assert read_done(path) == {"a", "\0line 2"}
    assert path.read_text() == whole
    path.write_text(whole.rstrip("\n"))  # a whole last record, its newline not yet written
    assert read_done(path) == {"a", "\0line 2"}
    assert path.read_text() == whole
    results = ResultsFile(path, read_done(path))
    assert not results.write(first)  # already there
    assert results.write(bad_line_record(BadLine(3, "c", "z")))
    results.close()
    assert len(path.read_text().splitlines()) == 3


def test_an_output_with_a_broken_line_inside_is_refused(tmp_path) -> None:
    path = tmp_path / "out.jsonl"
    record = json.dumps(bad_line_record(BadLine(1, "a", "x")))
    path.write_text(record + "\nnot a record\n" + record.replace('"a"', '"b"') + "\n")
    with pytest.raises(ValueError, match="line 2 is not a batch output record"):
        read_done(path)
    path.write_text(record + "\n" + record + "\n")
    with pytest.raises(ValueError, match="holds 'a' twice"):
        read_done(path)
