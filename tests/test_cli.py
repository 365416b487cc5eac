"""The command line, end to end on a tiny checkpoint directory."""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers
import torch
from tokenizers.processors import TemplateProcessing

from verispec.cli import build_parser, main
from verispec.engine import llm as llm_module

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
    assert "0 of 7 prompt tokens cached" in err  # a fresh process has nothing cached


def test_the_command_as_a_process_collects_again_once_loaded(checkpoint, tmp_path, capsys) -> None:
    """Run as the `verispec` process (main() reading sys.argv), garbage collection is off through
    start-up and back on once the model is loaded, what was built frozen; the text is main(argv)'s
    in a process that goes on (where collection is never touched)."""
    argv = ["generate", "--model", checkpoint, "--no-chat", "--temperature", "0", "--max-tokens", "6", "t1 t2 t3 t1"]
    script = (f"import gc, sys\nfrom verispec.cli import main\nsys.argv = ['verispec', *{argv!r}]\n"
              "code = main()\nprint('|', code, gc.isenabled(), gc.get_freeze_count() > 0)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "VERISPEC_CACHE_DIR": str(tmp_path)})
    text, _, state = done.stdout.rpartition("|")
    assert state.split() == ["0", "True", "True"], done.stderr
    frozen = gc.get_freeze_count()
    assert main(argv) == 0
    assert gc.isenabled() and gc.get_freeze_count() == frozen
    assert text.split() == capsys.readouterr().out.split()


def test_no_prefix_caching_gives_the_same_text(checkpoint, capsys) -> None:
    texts = []
    for option in ("--prefix-caching", "--no-prefix-caching"):
        assert main(["generate", "--model", checkpoint, "--no-chat", "--temperature", "0", "--max-tokens", "8",
                     option, "t4 t5 t4 t5"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1]


def test_enforce_eager_reaches_the_engine_and_gives_the_same_text(checkpoint, capsys, monkeypatch) -> None:
    texts, built = [], []
    real = llm_module.LLMEngine
    monkeypatch.setattr(llm_module, "LLMEngine", lambda *args: built.append(args[2]) or real(*args))
    for options in ([], ["--enforce-eager"]):
        assert main(["generate", "--model", checkpoint, "--no-chat", "--temperature", "0", "--max-tokens", "8",
                     *options, "t4 t5 t4 t5"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1]
    assert [config.enforce_eager for config in built] == [False, True]


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


# Bad input of every kind reaches the user as one line and exit code 2, never a traceback.

def _error_line(capsys) -> str:
    """The one error line on stderr (after the progress line, if the model began loading)."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line and line != "loading model ..."]
    assert len(lines) == 1 and lines[0].startswith("verispec: error: "), err
    return lines[0]


def _copy(checkpoint: str, target: Path, **config_changes) -> str:
    shutil.copytree(checkpoint, target)
    config = json.loads((target / "config.json").read_text())
    config.update(config_changes)
    for key in [k for k, v in config_changes.items() if v is None]:
        del config[key]
    (target / "config.json").write_text(json.dumps(config))
    return str(target)


def _run(model: str, *options: str) -> int:
    return main(["generate", "--model", model, "--no-chat", "--max-tokens", "2", *options, "t1 t2"])


def test_unavailable_device_is_one_line(checkpoint, capsys) -> None:
    device = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    assert _run(checkpoint, "--device", device) == 2
    line = _error_line(capsys)
    assert f"device={device!r} is unavailable" in line


@pytest.mark.parametrize("threads", ["-1", "0"])
def test_bad_thread_count_is_one_line(checkpoint, capsys, threads) -> None:
    assert _run(checkpoint, "--threads", threads) == 2
    assert f"--threads={threads} is invalid: expected an integer >= 1" in _error_line(capsys)


@pytest.mark.parametrize("changes,expected", [
    ({"hidden_size": None}, "config.json lacks 'hidden_size'"),
    ({"num_hidden_layers": -3}, "invalid config.json: ModelConfig.num_layers=-3"),
    ({"vocab_size": "16"}, "invalid config.json: ModelConfig.vocab_size='16'"),
    ({"num_attention_heads": 0}, "invalid config.json: ModelConfig.num_heads=0"),
    ({"num_hidden_layers": 10**12}, "does not match its config: weights is missing 'model.layers.2.input_layernorm.weight'"),
    ({"hidden_size": 10**9}, r"does not match its config: weights\['model.embed_tokens.weight'\] has shape "
                             r"\(16, 32\), expected \(16, 1000000000\)"),
    ({"intermediate_size": 10**12}, r"mlp.gate_proj.weight'\] has shape \(64, 32\), expected \(1000000000000, 32\)"),
])
def test_bad_config_is_one_line_naming_the_key(checkpoint, capsys, tmp_path, changes, expected) -> None:
    model = _copy(checkpoint, tmp_path / "model", **changes)
    assert _run(model) == 2
    line = _error_line(capsys)
    assert f"model={model!r}" in line and re.search(expected, line), line


def test_config_that_is_not_json_is_one_line(checkpoint, capsys, tmp_path) -> None:
    model = _copy(checkpoint, tmp_path / "model")
    (tmp_path / "model" / "config.json").write_text('{"model_type": "llama",')
    assert _run(model) == 2
    assert "config.json' is not valid UTF-8 JSON" in _error_line(capsys)


@pytest.mark.parametrize("damage", ["truncated", "garbled header"])
def test_corrupt_safetensors_is_one_line(checkpoint, capsys, tmp_path, damage) -> None:
    model = _copy(checkpoint, tmp_path / "model")
    weights = tmp_path / "model" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-100] if damage == "truncated" else data[:8] + b"{oops" + data[13:])
    assert _run(model) == 2
    assert f"{str(weights)!r} is not a valid safetensors file" in _error_line(capsys)


def test_chat_template_error_is_one_line(checkpoint, capsys, tmp_path) -> None:
    model = _copy(checkpoint, tmp_path / "model")
    config_path = tmp_path / "model" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{{ raise_exception('Only user and assistant roles are supported') }}"
    config_path.write_text(json.dumps(config))
    assert main(["generate", "--model", model, "--chat", "t1"]) == 2
    assert "the chat template failed: TemplateError: Only user and assistant" in _error_line(capsys)


def _gguf_with_array(path: Path, count: int) -> None:
    """A GGUF header whose one metadata array claims `count` uint32 items but holds two."""
    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()
    uint32, array = 4, 9  # GGUF value types
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + string("tokenizer.ggml.token_type")
                     + struct.pack("<IIQ", array, uint32, count) + struct.pack("<II", 1, 1))


def test_gguf_with_an_absurd_array_length_is_one_line(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "crafted.gguf"
    _gguf_with_array(path, 2**62)
    assert _run(str(path)) == 2
    line = _error_line(capsys)
    assert f"model={str(path)!r} is not a valid GGUF file" in line and str(2**62) in line


def test_failed_generation_prints_its_reason_and_exits_1(checkpoint, capsys, monkeypatch) -> None:
    # One KV-cache block of 16 tokens: a 40-token prompt can never be scheduled.
    monkeypatch.setattr(llm_module, "kv_blocks_for", lambda model, memory_gib, block_size: 1)
    assert main(["generate", "--model", checkpoint, "--no-chat", "--draft", "none", "--max-tokens", "4",
                 " ".join(["t1"] * 40)]) == 1
    err = capsys.readouterr().err
    assert re.search(r"verispec: generation failed: the request needs \d+ KV-cache blocks .* the cache has 1", err)
    assert "tok/s" not in err


def test_chat_prompt_gets_the_template_bos_only(checkpoint, capsys, tmp_path, monkeypatch) -> None:
    model = _copy(checkpoint, tmp_path / "model")
    directory = tmp_path / "model"
    backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    backend.post_processor = TemplateProcessing(single="t1 $A", special_tokens=[("t1", 1)])  # adds BOS t1
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "t1", "chat_template": "{{ bos_token }} {% for m in messages %}{{ m['content'] }} {% endfor %}"}))
    prompts = []
    stream = llm_module.LLM.stream

    def spy(self, prompt, params=None):
        prompts.append(prompt)
        return stream(self, prompt, params)

    monkeypatch.setattr(llm_module.LLM, "stream", spy)
    assert main(["generate", "--model", model, "--chat", "--max-tokens", "2", "t5 t6"]) == 0
    assert prompts == [[1, 5, 6]]


def test_logprobs_penalties_and_bans_reach_the_request(checkpoint, capsys) -> None:
    code = main(["generate", "--model", checkpoint, "--no-chat", "--temperature", "0", "--max-tokens", "6",
                 "--logprobs", "2", "--ban-token", "5", "--logit-bias", "7=3.5", "--presence-penalty", "0.5",
                 "t1 t2 t3"])
    out, err = capsys.readouterr()
    assert code == 0
    assert "t5" not in out.split()
    lines = [line for line in err.splitlines() if re.match(r"\s*'.*' +-?\d+\.\d{3}", line)]
    assert len(lines) == 6  # one per token: the token, its log-probability, two alternatives
    assert all(len(re.findall(r"-?\d+\.\d{3}", line)) == 3 for line in lines)


def test_a_malformed_logit_bias_is_an_argument_error(checkpoint, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", checkpoint, "--logit-bias", "7:3", "t1"])
    assert exit_info.value.code == 2
    assert "'7:3' is not ID=BIAS" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--logprobs", "21"], "logprobs=21 is invalid"),
    (["--presence-penalty", "3"], "presence_penalty=3.0 is invalid"),
    (["--ban-token", "-1"], "banned_token_ids=[-1] is invalid"),
])
def test_bad_sampler_values_are_one_line(checkpoint, capsys, args: list[str], message: str) -> None:
    assert main(["generate", "--model", checkpoint, "--no-chat", *args, "t1"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def _damaged_head(tmp_path: Path, damage: str) -> Path:
    """The shipped EAGLE head file, damaged as a cut download or a stray file would be."""
    from verispec.spec_decode.heads import shipped_head

    data = shipped_head("eagle").read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"] = [0, 10**12]
    bad_header = json.dumps(header).encode()
    damaged = {
        "truncated": data[: len(data) // 2],
        "empty": b"",
        "random": bytes(range(256)) * 8,
        "huge header length": struct.pack("<Q", 2**62) + data[8:],
        "bad offsets": struct.pack("<Q", len(bad_header)) + bad_header + data[8 + size :],
    }[damage]
    path = tmp_path / "head.safetensors"
    path.write_bytes(damaged)
    return path


HEAD_DAMAGE = ["truncated", "empty", "random", "huge header length", "bad offsets"]


@pytest.mark.parametrize("damage", HEAD_DAMAGE)
@pytest.mark.parametrize("command,prefix", [("generate", ""), ("generate", "ngram+"), ("serve", "")])
def test_a_damaged_head_file_is_one_line(checkpoint, capsys, tmp_path, damage, command, prefix) -> None:
    path = _damaged_head(tmp_path, damage)
    args = ["--model", checkpoint, "--draft", prefix + str(path)]
    code = _run(checkpoint, *args[2:]) if command == "generate" else main(["serve", *args, "--port", "1"])
    assert code == 2
    assert f"draft head file {str(path)!r} is not a valid safetensors file" in _error_line(capsys)


@pytest.mark.parametrize("damage", HEAD_DAMAGE)
def test_llm_names_a_damaged_head_file_in_a_value_error(checkpoint, tmp_path, damage) -> None:
    from verispec import LLM

    path = _damaged_head(tmp_path, damage)
    for draft in (str(path), "ngram+" + str(path)):
        with pytest.raises(ValueError, match=re.escape(str(path))):
            LLM(checkpoint, draft=draft, progress=False)


@pytest.mark.parametrize("args,message", [
    (["generate", "--tree", "3,x", "t1"], "argument --tree: tree '3,x' is invalid"),
    (["generate", "--tree", "dynamic:0", "t1"], "argument --tree:"),
    (["generate", "--max-tokens", "many", "t1"], "argument --max-tokens: invalid int value: 'many'"),
    (["generate"], "the following arguments are required: prompt"),
    (["serve", "--port", "x"], "argument --port: invalid int value: 'x'"),
    (["train-drafter", "--kind", "lstm"], "argument --kind: invalid choice: 'lstm'"),
    (["nonsense"], "argument command: invalid choice: 'nonsense'"),
    (["generate", "--no-such-flag", "t1"], "unrecognized arguments: --no-such-flag"),
])
def test_every_argument_error_is_the_one_error_line(capsys, args, message) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("verispec: error: ") and message in err, err
    assert "usage:" not in err


@pytest.mark.parametrize("flag", ["--max-request-bytes", "--max-choices", "--max-connections",
                                  "--header-timeout", "--body-timeout", "--stall-timeout"])
def test_bad_serve_limits_are_one_line_naming_the_flag(checkpoint, capsys, flag) -> None:
    assert main(["serve", "--model", checkpoint, flag, "0"]) == 2
    assert re.match(rf"verispec: error: {flag}=0(\.0)? is invalid", _error_line(capsys))


def test_structured_output_options_are_checked_before_loading(checkpoint, capsys, tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "objectx"}')
    assert _run(checkpoint, "--json-schema", str(bad)) == 2
    assert "json_schema is invalid: Invalid type: objectx" in _error_line(capsys)
    assert _run(checkpoint, "--json-schema", str(tmp_path / "missing.json")) == 2
    assert "--json-schema" in _error_line(capsys)
    assert _run(checkpoint, "--regex", "(ab") == 2
    assert "regex is invalid" in _error_line(capsys)
    with pytest.raises(SystemExit):
        _run(checkpoint, "--regex", "a", "--json-object")
    assert "not allowed with argument" in capsys.readouterr().err
