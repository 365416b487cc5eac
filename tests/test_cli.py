"""The command line, end to end on a tiny checkpoint directory."""

from __future__ import annotations

import pytest

from verispec.cli import build_parser, main

from .tiny import tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("cli-model")
    tiny_checkpoint(directory)
    return str(directory)


def test_generate_streams_text_and_prints_a_summary(checkpoint, capsys) -> None:
    code = main(["generate", "--model", checkpoint, "--no-chat", "--temperature", "0", "--max-tokens", "12",
                 "-k", "3", "t1 t2 t3 t1 t2 t3 t1"])
    out, err = capsys.readouterr()
    assert code == 0
    assert len(out.split()) == 12 and all(w.startswith("t") for w in out.split())
    assert "12 tokens in" in err and "tok/s" in err and "finish: length" in err


def test_speculation_does_not_change_greedy_text(checkpoint, capsys) -> None:
    texts = []
    for draft in ("ngram", "none", checkpoint):
        assert main(["generate", "--model", checkpoint, "--draft", draft, "--no-chat", "--temperature", "0",
                     "--max-tokens", "16", "t4 t5 t4 t5"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] == texts[2]


def test_cfg_options_run(checkpoint, capsys) -> None:
    assert main(["generate", "--model", checkpoint, "--no-chat", "--seed", "3", "--max-tokens", "8",
                 "--guidance-scale", "1.5", "--negative-prompt", "t9", "--top-p", "0.9", "t1 t2"]) == 0
    assert "8 tokens" in capsys.readouterr().err


def test_bad_values_are_reported_with_the_argument(checkpoint, capsys) -> None:
    assert main(["generate", "--model", checkpoint, "--top-p", "1.5", "t1"]) == 2
    assert "top_p=1.5 is invalid" in capsys.readouterr().err
    assert main(["generate", "--model", "/no/such/model", "t1"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_help_explains_the_options() -> None:
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--help"])
