"""`verispec run-batch` in one process: the server's answers, error records, duplicates refused,
and a run killed midway resumed to a complete output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import pytest

from verispec.cli import main

from ..serve.conftest import make_llm, serving
from .conftest import MODEL, MODEL_FLAGS, choices, request_line, results, write_requests

MALFORMED = '{"custom_id": "cut", "method": "POST", "url": "/v1/compl'
BAD_BODIES = {  # custom_id: body the server refuses
    "bad-type": {"model": MODEL, "prompt": "t1", "temperature": "hot"},
    "bad-value": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 2.0},
    "bad-model": {"model": "gpt-4", "prompt": "t1"},
}


def _bad(custom_id: str, body: dict) -> str:
    url = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


@pytest.fixture(scope="module")
def answered(checkpoint, tmp_path_factory) -> tuple[Path, Path]:
    """(input, output) of one run over good requests, a malformed line and bodies the server refuses."""
    directory = tmp_path_factory.mktemp("batch-local")
    requests = write_requests(directory / "in.jsonl", 9, extra=(MALFORMED, *(_bad(k, v) for k, v in BAD_BODIES.items())))
    output = directory / "out.jsonl"
    assert main(["run-batch", "-i", str(requests), "-o", str(output), "--model", checkpoint, *MODEL_FLAGS,
                 "--no-progress"]) == 0
    return requests, output


def test_every_line_gets_one_record_and_failures_do_not_stop_the_rest(answered) -> None:
    _, output = answered
    records = results(output)
    assert set(records) == {f"req-{i}" for i in range(9)} | set(BAD_BODIES) | {"line 10"}
    for i in range(9):
        record = records[f"req-{i}"]
        assert record["error"] is None and record["response"]["status_code"] == 200
        assert record["response"]["body"]["usage"]["completion_tokens"] == 12
    assert "line 10 is not JSON" in records["line 10"]["error"]["message"]
    assert records["line 10"]["custom_id"] is None and records["line 10"]["response"] is None
    assert records["bad-model"]["response"]["status_code"] == 404
    for key in ("bad-type", "bad-value"):
        assert records[key]["response"]["status_code"] == 400


def test_records_are_what_the_server_answers(answered, checkpoint) -> None:
    """Same bodies over HTTP to `verispec serve`'s app: the same status, the same error bodies,
    the same choices for greedy and seeded requests."""
    requests, output = answered
    records = results(output)
    lines = [json.loads(line) for line in requests.read_text().splitlines() if line != MALFORMED]
    with serving(make_llm(checkpoint), MODEL) as url:
        for line in lines:
            response = httpx2.post(url + line["url"], json=line["body"], timeout=60)
            record = records[line["custom_id"]]["response"]
            assert response.status_code == record["status_code"], line["custom_id"]
            if response.status_code == 200:
                assert response.json()["choices"] == record["body"]["choices"], line["custom_id"]
            else:
                assert response.json() == record["body"], line["custom_id"]


def test_rerunning_a_complete_output_runs_nothing(answered, capsys) -> None:
    requests, output = answered
    before = output.read_text()
    # A model that does not exist: a run with nothing left to do loads none.
    assert main(["run-batch", "-i", str(requests), "-o", str(output), "--model", "/nonexistent", "--no-progress"]) == 0
    assert output.read_text() == before
    assert "13 already in" in capsys.readouterr().err


def test_repeated_custom_ids_stop_the_command_before_anything_runs(tmp_path, capsys) -> None:
    requests = tmp_path / "in.jsonl"
    requests.write_text(request_line("x", 0) + "\n" + request_line("y", 1) + "\n" + request_line("x", 2) + "\n")
    output = tmp_path / "out.jsonl"
    assert main(["run-batch", "-i", str(requests), "-o", str(output), "--model", "/nonexistent"]) == 2
    assert "repeats custom_ids: 'x' (lines 1 and 3)" in capsys.readouterr().err
    assert not output.exists()


@pytest.mark.parametrize("flags, message", [
    (["--replicas", "2"], "--replicas=2 needs --ray"),
    (["--ray", "--threads", "2"], "with --ray, use --threads-per-replica"),
    (["--ray", "--replicas", "0"], "--replicas=0 is invalid"),
])
def test_ray_flags_are_checked_before_anything_starts(flags, message, tmp_path, capsys) -> None:
    requests = write_requests(tmp_path / "in.jsonl", 1)
    assert main(["run-batch", "-i", str(requests), "-o", str(tmp_path / "o"), "--model", "/nonexistent", *flags]) == 2
    assert message in capsys.readouterr().err


def test_a_run_killed_midway_resumes_to_the_whole_output(checkpoint, tmp_path) -> None:
    """SIGKILL once some records are written, a half-written record appended (a kill mid-write),
    then the same command again: every request once, the same choices as an unbroken run."""
    requests = write_requests(tmp_path / "in.jsonl", 24, max_tokens=24)
    command = ["run-batch", "-i", str(requests), "--model", checkpoint, *MODEL_FLAGS, "--max-num-seqs", "1",
               "--no-progress"]
    killed = tmp_path / "killed.jsonl"
    process = subprocess.Popen([sys.executable, "-m", "verispec.cli", *command, "-o", str(killed)],
                               stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (killed.exists() and len(killed.read_text().splitlines()) >= 3):
            assert process.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "no records within 120 s"
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.kill()
        process.wait(timeout=30)
    written = len(killed.read_text().splitlines())
    assert 3 <= written < 24
    with killed.open("a") as file:
        file.write(killed.read_text().splitlines()[0][:40])
    assert main([*command, "-o", str(killed)]) == 0
    unbroken = tmp_path / "unbroken.jsonl"
    assert main([*command, "-o", str(unbroken)]) == 0
    assert choices(killed) == choices(unbroken)
    assert len(choices(killed)) == 24
