"""The run-batch command's flow, whatever answers the requests: read and check the input,
skip what the output already holds, write every other line's record as it comes, with a
progress bar on stderr.

A backend is a context manager (entered only when there is work: checks and resuming come
before a model is loaded) yielding `answer(requests) -> records`, one record per request, in
any order.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, ContextManager

from tqdm import tqdm

from .records import BadLine, BatchRequest, ResultsFile, bad_line_record, read_done, read_requests

if TYPE_CHECKING:
    from ..engine.llm import LLM

Answer = Callable[[list[BatchRequest]], Iterator[dict]]


@dataclass(frozen=True)
class BatchSummary:
    """lines: requests in the input; resumed: already in the output before this run;
    answered / failed: records written by this run, with 200 / with an error."""

    lines: int
    resumed: int
    answered: int
    failed: int


class _Meter:
    """Generated tokens per second and draft acceptance, from the records' response bodies."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.tokens = self.drafts = self.accepted = 0

    def add(self, record: dict) -> None:
        body = (record.get("response") or {}).get("body") or {}
        self.tokens += (body.get("usage") or {}).get("completion_tokens", 0)
        stats = body.get("spec_decode_stats") or {}
        self.drafts += stats.get("num_draft_tokens", 0)
        self.accepted += stats.get("num_accepted_tokens", 0)

    def text(self) -> str:
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        acceptance = f"acceptance {self.accepted / self.drafts:.2f}" if self.drafts else "no drafts"
        return f"{rate:.1f} tok/s, {acceptance}"


def run_batch(input_path: str | os.PathLike, output_path: str | os.PathLike,
              backend: Callable[[], ContextManager[Answer]], progress: bool = True) -> BatchSummary:
    items = read_requests(input_path)
    keys = {item.key for item in items}
    done = read_done(output_path)
    foreign = done - keys
    if foreign:
        raise ValueError(f"{output_path} holds {len(foreign)} record(s) of requests not in {input_path} "
                         f"(e.g. custom_id {sorted(foreign)[0]!r}): is it the output of another file?")
    todo = [item for item in items if item.key not in done]
    results = ResultsFile(output_path, done)
    meter = _Meter()
    answered = failed = 0
    bar = tqdm(total=len(items), initial=len(items) - len(todo), desc="run-batch", unit="req", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)

    def write(record: dict) -> None:
        nonlocal answered, failed
        if results.write(record):
            if record["error"] is None:
                answered += 1
            else:
                failed += 1
            meter.add(record)
            bar.update(1)
            bar.set_postfix_str(meter.text(), refresh=False)

    try:
        for item in todo:
            if isinstance(item, BadLine):
                write(bad_line_record(item))
        requests = [item for item in todo if isinstance(item, BatchRequest)]
        if requests:
            with backend() as answer:
                meter.start = time.perf_counter()
                for record in answer(requests):
                    write(record)
    finally:
        bar.close()
        results.close()
    missing = keys - results.written
    if missing:
        raise RuntimeError(f"{len(missing)} request(s) got no record (e.g. {sorted(missing)[0]!r}); "
                           "run the same command again to answer them")
    return BatchSummary(len(items), len(items) - len(todo), answered, failed)


@contextlib.contextmanager
def local_backend(make_llm: Callable[[], LLM], model_name: str, window: int) -> Iterator[Answer]:
    """One engine in this process answering up to `window` requests at once."""
    from .answer import BatchAnswerer

    answerer = BatchAnswerer(make_llm(), model_name)
    try:
        yield lambda requests: answerer.answer(requests, window)
    finally:
        answerer.close()
