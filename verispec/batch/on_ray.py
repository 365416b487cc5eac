"""run-batch over Ray Data: the requests become a dataset, `map_batches` runs them on an actor
pool of N replicas (each one engine, a BatchAnswerer, with T torch threads), and the driver
writes the records as batches come back.

A replica runs two batches at once (max_concurrent_calls_per_actor), so its engine is not left
with only a batch's stragglers. A replica that dies is restarted and its unfinished batches are
run again (Ray Data's default max_restarts / max_task_retries of -1); a batch's records reach the
driver once, and ResultsFile drops any key it already wrote.

Seeded sampling in verispec is a pure function of (seed, step, position) per request, and
greedy is greedy, so records do not depend on N, T or how the rows were batched.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

from ..cluster import ray_session
from .records import BatchRequest
from .run import Answer

_CALLS_PER_REPLICA = 2


class Replica:
    """A Ray Data actor: one engine answering the batches of rows it is given."""

    def __init__(self, llm_kwargs: dict[str, Any], model_name: str, threads: int) -> None:
        import torch

        from ..engine.llm import LLM
        from .answer import BatchAnswerer

        torch.set_num_threads(threads)
        self.answerer = BatchAnswerer(LLM(**llm_kwargs, progress=False), model_name)

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[str]]:
        requests = [to_request(row) for row in batch["request"]]
        records = self.answerer.answer(requests, window=len(requests))
        return {"record": [json.dumps(record) for record in records]}


def to_row(request: BatchRequest) -> str:
    return json.dumps({"line": request.line, "custom_id": request.custom_id, "url": request.url,
                       "body": request.body.decode()})


def to_request(row: str) -> BatchRequest:
    fields = json.loads(row)
    return BatchRequest(fields["line"], fields["custom_id"], fields["url"], fields["body"].encode())


@contextlib.contextmanager
def ray_backend(address: str | None, llm_kwargs: dict[str, Any], model_name: str, replicas: int,
                threads: int, batch_size: int) -> Iterator[Answer]:
    for name, value in (("--replicas", replicas), ("--threads-per-replica", threads), ("--batch-size", batch_size)):
        if value < 1:
            raise ValueError(f"{name}={value} is invalid: expected an integer >= 1")

    def answer(requests: list[BatchRequest]) -> Iterator[dict]:
        import ray

        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False  # run-batch draws its own
        context.print_on_execution_start = False
        dataset = ray.data.from_items([{"request": to_row(r)} for r in requests],
                                      override_num_blocks=-(-len(requests) // batch_size))
        dataset = dataset.map_batches(
            Replica, fn_constructor_kwargs={"llm_kwargs": llm_kwargs, "model_name": model_name, "threads": threads},
            batch_size=batch_size, num_cpus=threads,
            compute=ray.data.ActorPoolStrategy(size=replicas, max_concurrent_calls_per_actor=_CALLS_PER_REPLICA),
        )
        for batch in dataset.iter_batches(batch_size=None, batch_format="numpy"):
            for text in batch["record"]:
                yield json.loads(text)

    with ray_session(address):
        yield answer
