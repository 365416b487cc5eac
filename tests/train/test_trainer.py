"""Self-distillation on a tiny random target: recording, training, resuming, evaluating, and
`verispec train-drafter` end to end."""

from __future__ import annotations

import json

import pytest
import torch

from verispec import LLM, SamplingParams
from verispec.cli import main
from verispec.runtime.kv_cache import BlockManager
from verispec.runtime.runner import Feed, ModelRunner
from verispec.spec_decode.heads import head_config, load_head
from verispec.train import trainer
from verispec.train.command import acceptance, answer_params, draft_vocabulary
from verispec.train.trainer import TrainConfig, train

from .. import learned
from ..tiny import tiny_checkpoint, word_tokenizer


def test_recording_holds_each_answer_and_the_targets_hidden_states() -> None:
    data, target = learned.dataset(), learned.target()
    assert len(data) == 48
    assert data.layers == (1, 2)  # a fused head's layers and the last, of a 2-layer target
    for layers in ((2,), (1, 2), (2, 1)):
        selected = data.select(layers)
        for i in (0, 1, 17):
            tokens, features, prompt_len = selected.sequence(i)
            assert tokens[:prompt_len].tolist() == learned.prompts(48, seed=0)[i]
            assert tokens.numel() == prompt_len + 32  # the whole answer, its last token without a feature
            blocks = BlockManager(64, 4)
            blocks.allocate("s", tokens.numel() - 1)
            _, hidden = ModelRunner(target, blocks).forward_hidden([Feed("s", tokens[:-1].tolist(), 0, 1)], layers)
            torch.testing.assert_close(features[:-1], hidden, atol=1e-4, rtol=1e-4)
            assert not features[-1].any()
    with pytest.raises(ValueError, match=r"layers \[3\] were not recorded"):
        data.select((3,))


@pytest.mark.parametrize("kind", ["eagle", "medusa", "eagle-fused"])
def test_training_lowers_the_loss_and_raises_held_out_acceptance(kind: str) -> None:
    head, losses = learned.training(kind)
    assert sum(losses[-4:]) / 4 < 0.8 * sum(losses[:4]) / 4
    held_out = learned.prompts(12, seed=7)
    tokenizer = word_tokenizer(learned.VOCAB)
    before = acceptance(learned.target(), tokenizer, learned.untrained(kind), held_out, 3, 24)
    after = acceptance(learned.target(), tokenizer, head, held_out, 3, 24)
    assert after > before


def test_an_interrupted_run_resumes_to_the_same_head(tmp_path, monkeypatch) -> None:
    config = TrainConfig(epochs=2, batch_tokens=512, lr=3e-2, warmup_steps=2, checkpoint_every=3)
    whole = learned.untrained("eagle")
    full_losses = train(whole, learned.dataset(), config, checkpoint_dir=tmp_path / "whole", progress=False)

    interrupted = learned.untrained("eagle")
    real_loss = trainer._eagle_loss
    calls = []

    def failing(*args):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real_loss(*args)

    monkeypatch.setattr(trainer, "_eagle_loss", failing)
    with pytest.raises(KeyboardInterrupt):
        train(interrupted, learned.dataset(), config, checkpoint_dir=tmp_path / "cut", progress=False)
    monkeypatch.setattr(trainer, "_eagle_loss", real_loss)
    resumed = learned.untrained("eagle")
    rest = train(resumed, learned.dataset(), config, checkpoint_dir=tmp_path / "cut", progress=False)
    assert 0 < len(rest) < len(full_losses) - 1  # at least one finished step was lost with the crash
    for name, p in whole.own_state().items():
        torch.testing.assert_close(resumed.own_state()[name], p)
    # A finished run's checkpoint leaves nothing to do.
    assert train(learned.untrained("eagle"), learned.dataset(), config, checkpoint_dir=tmp_path / "whole",
                 progress=False) == []


def test_draft_vocabulary_is_the_most_used_output_tokens() -> None:
    data = learned.dataset()
    vocab = draft_vocabulary(data, 8, always=(31,))
    assert vocab.tolist() == sorted(vocab.tolist()) and 31 in vocab.tolist() and len(vocab) == 8
    outputs = torch.cat([data.sequence(i)[0][data.sequence(i)[2]:] for i in range(len(data))])
    counts = torch.bincount(outputs, minlength=learned.VOCAB)
    chosen = [t for t in vocab.tolist() if t != 31]
    others = [t for t in range(learned.VOCAB) if t not in vocab.tolist()]
    assert min(counts[chosen]) >= max(counts[others])


def test_train_drafter_command_writes_a_head_the_cli_and_llm_use(tmp_path, capsys) -> None:
    tiny_checkpoint(tmp_path / "model", vocab=16)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"category": "x", "prompt": " ".join(f"t{(i * 7 + j) % 16}" for j in range(4))})
                               + "\n" for i in range(20)))
    out = tmp_path / "medusa.safetensors"
    args = ["train-drafter", "--kind", "medusa", "--model", str(tmp_path / "model"), "--prompts", str(prompts),
            "--max-tokens", "12", "--eval-tokens", "8", "--held-out-every", "5", "--draft-vocab", "12",
            "--epochs", "2", "--batch-tokens", "256", "-k", "2", "--cache-dir", str(tmp_path / "cache"),
            "--out", str(out)]
    assert main(args) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["prompts"] == 16 and report["held_out_prompts"] == 4 and report["draft_vocab"] == 12
    assert head_config(out).kind == "medusa"
    assert "held-out mean acceptance length at K=2" in capsys.readouterr().out
    # Running again resumes from the cache: nothing is recorded twice.
    assert main(args) == 0
    assert "recording prompts" not in capsys.readouterr().out
    llm = LLM(model=str(tmp_path / "model"), draft=str(out), progress=False)
    assert load_head(out, llm.model).draft_vocab.numel() == 12
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    plain = LLM(model=str(tmp_path / "model"), draft="none", progress=False)
    assert llm.generate("t1 t2", params)[0].token_ids == plain.generate("t1 t2", params)[0].token_ids
    assert main(["generate", "--model", str(tmp_path / "model"), "--draft", str(out), "--temperature", "0",
                 "--max-tokens", "6", "--no-chat", "t3 t4"]) == 0
    assert main(args[:-2] + ["--out", str(out), "--draft-vocab", "99"]) == 2
    assert "--draft-vocab=99 is invalid" in capsys.readouterr().err
    # A second answer per prompt records only the new answers and trains on both.
    assert main(args + ["--answers-per-prompt", "2"]) == 0
    printed = capsys.readouterr().out
    assert "answer 2 of 2" in printed and "answer 1 of 2" not in printed
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["answers_per_prompt"] == 2 and report["answers"] == 32
    assert main(args + ["--answers-per-prompt", "0"]) == 2
    assert "--answers-per-prompt=0 is invalid" in capsys.readouterr().err


def test_train_drafter_command_trains_a_fused_eagle_head(tmp_path, capsys) -> None:
    tiny_checkpoint(tmp_path / "model", vocab=16)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"category": "x", "prompt": f"t{i % 16} t{(i * 5) % 16}"}) + "\n"
                               for i in range(12)))
    out = tmp_path / "eagle.safetensors"
    args = ["train-drafter", "--kind", "eagle", "--model", str(tmp_path / "model"), "--prompts", str(prompts),
            "--max-tokens", "10", "--eval-tokens", "8", "--held-out-every", "4", "--draft-vocab", "12",
            "--epochs", "1", "--batch-tokens", "128", "-k", "2", "--cache-dir", str(tmp_path / "cache"),
            "--fused", "--unroll", "3", "--out", str(out)]
    assert main(args) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["fused_layers"] == [1, 2] and report["train_config"]["unroll"] == 3
    assert head_config(out).fused_layers == (1, 2)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    drafted = LLM(model=str(tmp_path / "model"), draft=str(out), progress=False).generate("t1 t2", params)[0]
    plain = LLM(model=str(tmp_path / "model"), draft="none", progress=False).generate("t1 t2", params)[0]
    assert drafted.token_ids == plain.token_ids and drafted.stats.num_draft_tokens > 0
    capsys.readouterr()
    assert main([*args[:1], "--kind", "medusa", *args[3:]]) == 2
    assert "--fused and --unroll are for --kind eagle, not --kind medusa" in capsys.readouterr().err


def test_train_drafter_init_starts_from_a_head_file(tmp_path, capsys) -> None:
    """--init: the head file's architecture, draft vocabulary and weights are where training
    starts (with a negligible learning rate the trained head is the initial one)."""
    tiny_checkpoint(tmp_path / "model", vocab=16)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"category": "x", "prompt": f"t{i % 16} t{(i * 3) % 16}"}) + "\n"
                               for i in range(12)))
    first, second = tmp_path / "first.safetensors", tmp_path / "second.safetensors"
    common = ["train-drafter", "--kind", "eagle", "--model", str(tmp_path / "model"), "--prompts", str(prompts),
              "--max-tokens", "10", "--eval-tokens", "8", "--held-out-every", "4", "--epochs", "1",
              "--batch-tokens", "128", "-k", "2", "--cache-dir", str(tmp_path / "cache")]
    assert main(common + ["--draft-vocab", "12", "--fused", "--out", str(first)]) == 0
    assert main(common + ["--init", str(first), "--lr", "1e-12", "--out", str(second)]) == 0
    assert "initial" in capsys.readouterr().out
    report = json.loads(second.with_suffix(".json").read_text())
    assert report["init"] == str(first) and report["draft_vocab"] == 12
    assert "mean_acceptance_length_initial" in report and "mean_acceptance_length_untrained" not in report
    assert head_config(second) == head_config(first)
    model = LLM(model=str(tmp_path / "model"), draft="none", progress=False).model
    start, trained = load_head(first, model), load_head(second, model)
    assert torch.equal(start.draft_vocab, trained.draft_vocab)
    for (name, a), b in zip(start.own_state().items(), trained.own_state().values()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0, msg=name)
    assert main(common + ["--init", str(first), "--draft-vocab", "12", "--out", str(second)]) == 2
    assert "with --init the head file gives them" in capsys.readouterr().err
    assert main([*common[:1], "--kind", "medusa", *common[3:], "--init", str(first), "--out", str(second)]) == 2
    assert f"--init={str(first)!r} is an eagle head: expected a medusa head" in capsys.readouterr().err
    assert main(common + ["--init", str(tmp_path / "missing"), "--out", str(second)]) == 2
    assert "expected a head file or one of ('eagle', 'medusa')" in capsys.readouterr().err


def test_each_prompt_gets_a_greedy_and_a_sampled_answer_first_then_sampled_ones() -> None:
    for index in range(4):
        params = [answer_params(index, answer, 0, 8) for answer in range(4)]
        assert sorted(p.temperature for p in params[:2]) == [0.0, 0.7]
        assert all(p.temperature == 0.7 and p.top_p == 0.9 for p in params[2:])
    seeds = {answer_params(index, answer, seed, 8).seed for index in range(100) for answer in range(3) for seed in range(2)}
    assert len(seeds) == 600
