"""The training cache survives kills, damage and foreign files; train-drafter checks its inputs
before the slow work and says where Ctrl-C stopped it."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from verispec.cli import main
from verispec.train import command, record as record_module
from verispec.train.command import record_shards
from verispec.train.record import Dataset
from verispec.train.trainer import CHECKPOINT, TrainConfig, train

from .. import learned
from ..damage import flip_middle
from ..tiny import tiny_checkpoint, word_tokenizer


def _prompts(path, n: int) -> str:
    path.write_text("".join(json.dumps({"category": "x", "prompt": f"t{i % 16} t{(i * 7) % 16} t3"}) + "\n"
                            for i in range(n)))
    return str(path)


def _shards(directory) -> list:
    return sorted(directory.glob("shard-*.safetensors"))


def test_a_damaged_shard_is_recorded_again_with_a_warning(tmp_path, capsys) -> None:
    model, tokenizer = learned.target(), word_tokenizer(learned.VOCAB)
    prompts = [" ".join(f"t{(i + j) % 16}" for j in range(3)) for i in range(4)]
    first = record_shards(model, tokenizer, prompts, 6, tmp_path)
    (shard,) = _shards(tmp_path)
    whole = shard.read_bytes()
    for damage in (whole[: len(whole) // 2], b"", b"\x00" * 64, None):
        if damage is None:  # bytes changed in the middle of the features: the file still loads
            shard.write_bytes(whole)
            flip_middle(shard, 256)
        else:
            shard.write_bytes(damage)
        again = record_shards(model, tokenizer, prompts, 6, tmp_path)
        err = capsys.readouterr().err
        assert "warning:" in err and str(shard) in err and "recording it again" in err
        assert torch.equal(again.tokens, first.tokens) and torch.equal(again.offsets, first.offsets)
    assert Dataset.load(shard).tokens.equal(first.tokens)


def test_a_shard_is_never_left_half_written(tmp_path, monkeypatch) -> None:
    data = learned.dataset()
    path = tmp_path / "shard.safetensors"
    import safetensors.torch

    real = safetensors.torch.save_file

    def killed(tensors, filename, metadata=None):
        real(tensors, filename, metadata)
        with open(filename, "r+b") as f:
            f.truncate(100)
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", killed)
    with pytest.raises(KeyboardInterrupt):
        data.save(path)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    data.save(path)
    assert Dataset.load(path).tokens.equal(data.tokens)
    assert sorted(tmp_path.iterdir()) == [path, path.with_name(path.name + ".crc32")]


def test_an_inconsistent_recording_is_refused_naming_the_file(tmp_path) -> None:
    data = learned.dataset()
    path = tmp_path / "shard.safetensors"
    Dataset(data.tokens[:-5], data.features[:-5], data.offsets, data.prompt_lens, data.layers).save(path)
    with pytest.raises(ValueError, match=rf"recording '{path}' is inconsistent"):
        Dataset.load(path)


class _Payload:
    """A pickle that would create a file when unpickled."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.mark.parametrize("content", ["garbage", "code", "flipped"])
def test_a_damaged_or_foreign_checkpoint_is_not_run_and_training_starts_over(tmp_path, capsys, content) -> None:
    config = TrainConfig(epochs=1, batch_tokens=512, lr=3e-2, warmup_steps=2, checkpoint_every=3)
    marker = tmp_path / "ran"
    (tmp_path / "run").mkdir()
    checkpoint = tmp_path / "run" / CHECKPOINT
    if content == "garbage":
        checkpoint.write_bytes(b"PK\x03\x04 not a checkpoint")
    elif content == "flipped":  # a whole checkpoint of this run, bytes changed in its middle
        train(learned.untrained("eagle"), learned.dataset(), config, checkpoint_dir=tmp_path / "run",
              progress=False)
        flip_middle(checkpoint, 64)
    else:
        torch.save({"identity": _Payload(marker)}, checkpoint)
    clean = train(learned.untrained("eagle"), learned.dataset(), config, checkpoint_dir=tmp_path / "clean",
                  progress=False)
    losses = train(learned.untrained("eagle"), learned.dataset(), config, checkpoint_dir=tmp_path / "run",
                   progress=False)
    assert not marker.exists()
    assert losses == clean  # every step, from the start
    assert "is damaged" in capsys.readouterr().err
    assert torch.load(checkpoint, weights_only=True)["step"] == len(clean)  # replaced by a good one


def test_the_checkpoint_holds_only_tensors_and_plain_values(tmp_path) -> None:
    config = TrainConfig(epochs=1, batch_tokens=512, lr=3e-2, warmup_steps=2, checkpoint_every=3)
    train(learned.untrained("medusa"), learned.dataset(), config, checkpoint_dir=tmp_path, progress=False)
    saved = torch.load(tmp_path / CHECKPOINT, weights_only=True)
    assert saved["step"] > 0 and sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT, CHECKPOINT + ".crc32"]
    with pytest.raises(pickle.UnpicklingError):
        torch.save({"x": _Payload(tmp_path / "ran")}, tmp_path / "evil.pt")
        torch.load(tmp_path / "evil.pt", weights_only=True)


def _train_args(tmp_path, prompts: str, *extra: str) -> list[str]:
    return ["train-drafter", "--kind", "medusa", "--model", str(tmp_path / "model"), "--prompts", prompts,
            "--max-tokens", "6", "--eval-tokens", "4", "--draft-vocab", "12", "--epochs", "1",
            "--batch-tokens", "128", "-k", "2", "--cache-dir", str(tmp_path / "cache"), *extra]


@pytest.fixture
def no_model(monkeypatch):
    """Checks that come first: loading the model would fail the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(command, "load_model", refuse)


@pytest.mark.parametrize("n,held_out_every,expected", [
    (0, 25, "holds no prompts"),
    (1, 2, "has 1 prompt(s) and --held-out-every=2 holds out every one of them"),
    (3, 1, "has 3 prompt(s) and --held-out-every=1"),
])
def test_too_few_prompts_are_named_before_loading(tmp_path, capsys, no_model, n, held_out_every, expected) -> None:
    prompts = _prompts(tmp_path / "p.jsonl", n)
    args = _train_args(tmp_path, prompts, "--held-out-every", str(held_out_every),
                       "--out", str(tmp_path / "h.safetensors"))
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("verispec: error: --prompts=") and expected in err[0]


@pytest.mark.parametrize("where", ["under a file", "a directory"])
def test_an_unwritable_out_is_named_before_training(tmp_path, capsys, no_model, where) -> None:
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "head.safetensors" if where == "under a file" else tmp_path
    assert main(_train_args(tmp_path, _prompts(tmp_path / "p.jsonl", 8), "--out", str(out))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"verispec: error: --out={str(out)!r}")


def test_ctrl_c_says_where_it_stopped_and_that_rerunning_resumes(tmp_path, capsys, monkeypatch) -> None:
    tiny_checkpoint(tmp_path / "model", vocab=16)
    real = record_module.record
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(command, "record", interrupted)
    args = _train_args(tmp_path, _prompts(tmp_path / "p.jsonl", 8), "--held-out-every", "4",
                       "--out", str(tmp_path / "h.safetensors"))
    assert main(args) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "interrupted while recording the answers to 6 prompts" in err
    assert str(tmp_path / "cache") in err and "run the same command again to resume" in err
    monkeypatch.setattr(command, "record", real)
    assert main(args) == 0 and calls == [1]
