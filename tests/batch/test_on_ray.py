"""Scale-out on a local Ray (2 CPUs, 127.0.0.1), started once for this module and always shut
down: run-batch on Ray Data gives the local run's records, survives a replica dying mid-run, and
`serve --ray-replicas 2` answers OpenAI's client from both replicas."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx2
import openai
import psutil
import pytest
import ray

from verispec.cli import main
from verispec.serve.on_ray import REPLICA_HEADER

from .conftest import MODEL, MODEL_FLAGS, choices, write_requests

RUN_LIMIT_S = 180  # one run-batch on Ray; start-up of the actors included


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="warning")
    try:
        yield
    finally:
        ray.shutdown()


class _Bounded:
    """`run` (returning an exit status) in a thread, given RUN_LIMIT_S to finish."""

    def __init__(self, run: Callable[[], int]) -> None:
        self.status: int | None = None
        self.deadline = time.monotonic() + RUN_LIMIT_S
        self.thread = threading.Thread(target=lambda: setattr(self, "status", run()), daemon=True)
        self.thread.start()

    def running(self) -> bool:
        assert time.monotonic() < self.deadline, f"run-batch did not finish within {RUN_LIMIT_S} s"
        return self.thread.is_alive()

    def finish(self) -> int | None:
        self.thread.join(timeout=max(0.0, self.deadline - time.monotonic()))
        assert not self.thread.is_alive(), f"run-batch did not finish within {RUN_LIMIT_S} s"
        return self.status


def _run_batch(requests: Path, output: Path, checkpoint: str, *flags: str) -> list[str]:
    return ["run-batch", "-i", str(requests), "-o", str(output), "--model", checkpoint, *MODEL_FLAGS,
            "--no-progress", *flags]


def test_two_replicas_give_the_records_of_one_engine(checkpoint, tmp_path) -> None:
    """Greedy and seeded sampled rows: the same choices however the rows are spread."""
    requests = write_requests(tmp_path / "in.jsonl", 16)
    assert main(_run_batch(requests, tmp_path / "local.jsonl", checkpoint)) == 0
    on_ray = tmp_path / "ray.jsonl"
    run = _Bounded(lambda: main(_run_batch(requests, on_ray, checkpoint, "--ray", "--replicas", "2",
                                           "--batch-size", "3")))
    assert run.finish() == 0
    assert choices(on_ray) == choices(tmp_path / "local.jsonl")
    assert len(choices(on_ray)) == 16


def _replica_processes() -> list[psutil.Process]:
    """This session's Ray Data actors (workers below the raylet this process started)."""
    return [p for p in psutil.Process().children(recursive=True)
            if any("MapWorker" in part for part in p.cmdline())]


def test_a_replica_that_dies_midway_is_replaced_and_its_rows_rerun(checkpoint, tmp_path) -> None:
    requests = write_requests(tmp_path / "in.jsonl", 24, max_tokens=24)
    output = tmp_path / "out.jsonl"
    run = _Bounded(lambda: main(_run_batch(requests, output, checkpoint, "--ray", "--replicas", "2",
                                           "--batch-size", "2", "--max-num-seqs", "1")))
    while not (output.exists() and output.read_text().count("\n") >= 2):
        assert run.running(), "run-batch ended before two records came"
        time.sleep(0.02)
    victims = _replica_processes()
    assert victims, "no replica process found"
    victims[0].kill()  # SIGKILL: the replica dies with batches in flight
    written_at_kill = output.read_text().count("\n")
    assert run.finish() == 0
    assert written_at_kill < 24
    assert not victims[0].is_running()
    assert main(_run_batch(requests, tmp_path / "local.jsonl", checkpoint)) == 0
    assert choices(output) == choices(tmp_path / "local.jsonl")


def _per_replica(url: str, path: str, replicas: int = 2) -> dict[str, httpx2.Response]:
    """GET `path` until every replica answered once (the proxy picks one per request)."""
    answers: dict[str, httpx2.Response] = {}
    deadline = time.monotonic() + 30
    while len(answers) < replicas:
        assert time.monotonic() < deadline, f"only replicas {set(answers)} answered {path}"
        response = httpx2.get(url + path, timeout=30)
        answers.setdefault(response.headers[REPLICA_HEADER], response)
    return answers


def _generated(metrics: httpx2.Response) -> float:
    line = next(line for line in metrics.text.splitlines() if line.startswith("verispec_generation_tokens_total"))
    return float(line.split()[-1])


def _disconnect_aborts_on_the_replica(url: str, client: openai.OpenAI) -> None:
    """A stream of 32 x 200 tokens left after its first chunk: its replica stops generating
    (requests_running drops to 0) having made far fewer than the 6400 tokens asked for."""
    before = {tag: _generated(r) for tag, r in _per_replica(url, "/metrics").items()}
    stream = client.completions.with_raw_response.create(model=MODEL, prompt="a b", n=32, max_tokens=200,
                                                         stream=True, extra_body={"ignore_eos": True})
    replica = stream.headers[REPLICA_HEADER]
    next(iter(stream.parse()))
    stream.http_response.close()
    deadline = time.monotonic() + 30
    while _per_replica(url, "/health")[replica].json()["requests_running"]:
        assert time.monotonic() < deadline, "the replica still generates for a client that left"
        time.sleep(0.1)
    generated = _generated(_per_replica(url, "/metrics")[replica]) - before[replica]
    assert generated < 6400 / 2


def test_serve_on_two_replicas_answers_openai_streamed_and_not(checkpoint) -> None:
    from ray import serve

    from verispec.config import ServeLimits
    from verispec.serve.on_ray import deploy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kwargs = dict(model=checkpoint, num_speculative_tokens=3, kv_cache_gib=0.002)
    try:
        url = deploy(kwargs, MODEL, ServeLimits(), replicas=2, threads=1, host="127.0.0.1", port=port)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        ask = dict(model=MODEL, messages=[{"role": "user", "content": "why?"}], max_tokens=16, temperature=0,
                   extra_body={"ignore_eos": True})
        replicas, texts = set(), set()
        deadline = time.monotonic() + 60
        while len(replicas) < 2:
            assert time.monotonic() < deadline, f"only replicas {replicas} answered"
            raw = client.chat.completions.with_raw_response.create(**ask)
            replicas.add(raw.headers[REPLICA_HEADER])
            texts.add(raw.parse().choices[0].message.content)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                           client.chat.completions.create(**ask, stream=True) if chunk.choices)
        assert texts == {streamed} and len(streamed) > 0
        page = httpx2.get(url + "/")  # the chat page, from a replica behind the proxy
        assert page.status_code == 200 and f'"model": "{MODEL}"' in page.text and REPLICA_HEADER in page.headers
        traced = [c.choices[0].model_extra.get("speculation") for c in client.chat.completions.create(
            **ask, stream=True, stream_options={"include_speculation": True}) if c.choices]
        assert sum(len(s["tokens"]) for s in traced if s) == 16
        completion = client.completions.create(model=MODEL, prompt="a b c", max_tokens=5, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert completion.usage.completion_tokens == 5
        with pytest.raises(openai.BadRequestError, match="top_p"):
            client.completions.create(model=MODEL, prompt="a", top_p=3.0)
        _disconnect_aborts_on_the_replica(url, client)
    finally:
        serve.shutdown()
