"""A real server (uvicorn on 127.0.0.1, a free port, in a thread) over a tiny random checkpoint
with a chat template, and OpenAI's client pointed at it."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import openai
import pytest
import uvicorn

from verispec import LLM
from verispec.config import ServeLimits
from verispec.serve import build_app
from verispec.serve.limits import server_config

from ..model.conftest import write_bos_chat_checkpoint

MODEL = "tiny"


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> str:
    return write_bos_chat_checkpoint(tmp_path_factory.mktemp("serve-tiny"))


def make_llm(checkpoint: str, adaptive: bool = True) -> LLM:
    """The tiny checkpoint as `verispec serve` runs it (adaptive: False drafts K = 3 whatever
    the drafts are worth)."""
    return LLM(checkpoint, num_speculative_tokens=3, kv_cache_gib=0.002, max_num_batched_tokens=256,
               adaptive=adaptive, progress=False)


@contextlib.contextmanager
def serving(llm: LLM, model_name: str, limits: ServeLimits = ServeLimits(), web_ui: bool = True) -> Iterator[str]:
    """Serves `llm` under `limits` on 127.0.0.1 and a free port in a thread, as `verispec serve`
    does (`web_ui`: with the chat page); yields the base url; always shuts the server down."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(server_config(build_app(llm, model_name, limits, web_ui), "127.0.0.1", port, limits,
                                         log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="session")
def server(checkpoint):
    """(base url, the LLM the server runs); the server is shut down at the end of the session.
    Its K is fixed: a random model's n-gram drafts rarely pay, so the adaptive K would stop
    drafting, and the tests of speculation marks need steps that verify drafts."""
    llm = make_llm(checkpoint, adaptive=False)
    with serving(llm, MODEL) as url:
        yield url, llm


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def reference(checkpoint) -> LLM:
    """A second LLM of the same checkpoint, run directly (offline API), as the server's."""
    return make_llm(checkpoint, adaptive=False)
