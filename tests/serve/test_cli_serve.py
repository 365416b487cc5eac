"""`verispec serve` on the command line."""

from __future__ import annotations

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


def test_ctrl_c_stops_the_server_with_one_line_and_no_traceback(checkpoint, tmp_path) -> None:
    """SIGINT, as Ctrl-C sends it, to a serving process: a clean shutdown, bounded."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    import httpx2

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "verispec.cli", "serve", "--model", checkpoint, "--port", str(port),
                             "--kv-cache-gib", "0.002"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "VERISPEC_CACHE_DIR": str(tmp_path)})
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if httpx2.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx2.TransportError:
                time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode in (0, 130), err
    assert "Traceback" not in err and "Error" not in err, err
    assert err.strip().splitlines()[-1] == "verispec: server stopped (Ctrl-C)"
