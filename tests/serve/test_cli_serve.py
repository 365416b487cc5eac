"""`verispec serve` on the command line."""

from __future__ import annotations

import os
import signal
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


def _serve(checkpoint: str, *flags: str, **popen) -> tuple[subprocess.Popen, str]:
    """A `verispec serve` process on a free port of 127.0.0.1, once it answers /health (120 s at most)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "verispec.cli", "serve", "--model", checkpoint,
                               "--port", str(port), "--kv-cache-gib", "0.002", "--threads", "1", *flags], **popen)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise AssertionError("verispec serve did not start")
        try:
            if httpx2.get(url + "/health", timeout=1).status_code == 200:
                return server, url
        except httpx2.TransportError:
            time.sleep(0.1)


def test_the_chat_page_is_served_unless_no_web_ui(checkpoint) -> None:
    assert build_parser().parse_args(["serve"]).web_ui
    for flags, page_status in (([], 200), (["--no-web-ui"], 404)):
        server, url = _serve(checkpoint, *flags, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            assert httpx2.get(url + "/").status_code == page_status
            assert httpx2.get(url + "/v1/models").status_code == 200
        finally:
            server.terminate()
            server.wait(timeout=30)


def test_ctrl_c_stops_the_server_with_one_line_and_no_traceback(checkpoint, tmp_path) -> None:
    """SIGINT, as Ctrl-C sends it, to a serving process: a clean shutdown, bounded."""
    proc, _ = _serve(checkpoint, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                     env={**os.environ, "VERISPEC_CACHE_DIR": str(tmp_path)})
    try:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode in (0, 130), err
    assert "Traceback" not in err and "Error" not in err, err
    assert err.strip().splitlines()[-1] == "verispec: server stopped (Ctrl-C)"
