"""`verispec serve` on the command line."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx2
import pytest

from verispec.cli import build_parser


def test_serve_help_teaches_the_endpoints(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for expected in ("--served-model-name", "--max-num-seqs", "/v1/chat/completions", "/metrics",
                     "num_speculative_tokens", "base_url"):
        assert expected in text


def test_serve_defaults() -> None:
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.served_model_name, args.draft) == ("127.0.0.1", 8000, "verispec", "ngram")


def test_serve_limits_default_to_serve_limits() -> None:
    from verispec.cli import serve_limits
    from verispec.config import ServeLimits

    args = build_parser().parse_args(["serve"])
    assert serve_limits(args) == ServeLimits()
    args = build_parser().parse_args(["serve", "--max-choices", "4", "--max-request-bytes", "1000",
                                      "--header-timeout", "2", "--body-timeout", "3", "--max-connections", "9",
                                      "--stall-timeout", "5"])
    assert serve_limits(args) == ServeLimits(1000, 4, 2.0, 3.0, 9, 5.0)


@pytest.mark.parametrize("flags, message", [
    (["--address", "auto"], "--address=auto needs --ray-replicas"),
    (["--ray-replicas", "0"], "--ray-replicas=0 is invalid"),
    (["--ray-replicas", "2", "--threads", "0"], "--threads=0 is invalid"),
])
def test_ray_flags_are_checked_before_anything_starts(flags, message, capsys) -> None:
    from verispec.cli import main

    assert main(["serve", "--model", "/nonexistent", *flags]) == 2
    assert message in capsys.readouterr().err


def test_the_chat_page_is_served_unless_no_web_ui(checkpoint) -> None:
    assert build_parser().parse_args(["serve"]).web_ui
    for flags, page_status in (([], 200), (["--no-web-ui"], 404)):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = subprocess.Popen([sys.executable, "-m", "verispec.cli", "serve", "--model", checkpoint,
                                   "--port", str(port), "--kv-cache-gib", "0.002", "--threads", "1", *flags],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 120
            while True:
                assert server.poll() is None, "verispec serve exited"
                assert time.monotonic() < deadline, "verispec serve did not start"
                try:
                    if httpx2.get(url + "/health").status_code == 200:
                        break
                except httpx2.TransportError:
                    time.sleep(0.2)
            assert httpx2.get(url + "/").status_code == page_status
            assert httpx2.get(url + "/v1/models").status_code == 200
        finally:
            server.terminate()
            server.wait(timeout=30)
