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
