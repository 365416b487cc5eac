"""The offline LLM API on a tiny random checkpoint: argument checks, chat encoding, shared-engine
consumers (streams and generate calls reading in turn)."""

from __future__ import annotations

import pytest

from verispec import LLM, SamplingParams

from ..model.conftest import write_bos_chat_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return write_bos_chat_checkpoint(tmp_path_factory.mktemp("bos-tiny"))


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(checkpoint, kv_cache_gib=0.001, max_num_batched_tokens=64, progress=False)


def test_chat_prompt_gets_one_bos(llm) -> None:
    assert llm.tokenizer.encode("the")[0] == 0  # the tokenizer adds BOS to plain text
    messages = [{"role": "user", "content": "the winter"}]
    rendered = llm.tokenizer.apply_chat_template(messages)
    (out,) = llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False)
    assert out.prompt == rendered
    assert out.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert out.prompt_token_ids[:2] == [0, 1]  # BOS once, then <|im_start|>


def test_a_bad_prompt_queues_nothing(llm) -> None:
    with pytest.raises(ValueError, match=r"prompts\[2\]=\[99999\] holds 99999 at index 0"):
        llm.generate(["the", "the", [99999]], GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match=r"prompts\[1\]=\{'text': 'the'\} is a dict"):
        llm.generate(["the", {"text": "the"}], GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match=r"prompts is a dict"):  # not read as a list of its keys
        llm.generate({"the": 1}, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    (out,) = llm.generate("the", GREEDY, use_tqdm=False)
    assert out.finish_reason == "length"


def test_interleaved_streams_and_a_generate_each_get_their_whole_text(llm) -> None:
    prompts = ["the winter", "a cat sat", "hello there"]
    alone = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts]
    assert all(len(o.text) > 20 for o in alone)
    streams = [llm.stream(prompts[0], GREEDY), llm.stream(prompts[1], GREEDY)]
    streamed, final, middle = ["", ""], [None, None], None
    rounds = 0
    while None in final:
        for i, stream in enumerate(streams):
            if final[i] is None:
                out = next(stream)
                streamed[i] += out.new_text
                if out.finished:
                    final[i] = out
        rounds += 1
        if rounds == 3:
            (middle,) = llm.generate(prompts[2], GREEDY, use_tqdm=False)
    for i in range(2):
        assert streamed[i] == final[i].text == alone[i].text
        assert final[i].token_ids == alone[i].token_ids
    assert middle.text == alone[2].text and middle.token_ids == alone[2].token_ids
    assert not llm.engine.has_unfinished() and not llm._outboxes


def test_closing_a_stream_cancels_its_request(llm) -> None:
    stream = llm.stream("the winter", GREEDY)
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished() and not llm._outboxes
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


@pytest.mark.parametrize("kwargs,message", [
    (dict(block_size=0), "block_size=0 is invalid"),
    (dict(max_num_seqs=0), "max_num_seqs=0 is invalid"),
    (dict(max_num_batched_tokens=-1), "max_num_batched_tokens=-1 is invalid"),
    (dict(max_model_len=0), "max_model_len=0 is invalid"),
    (dict(num_speculative_tokens=65), "num_speculative_tokens=65 is invalid"),
    (dict(num_speculative_tokens=8, max_num_batched_tokens=8), "max_num_batched_tokens=8 is invalid"),
])
def test_constructor_arguments_are_checked_before_loading(tmp_path, kwargs, message) -> None:
    # No model exists at the path: a message about the argument shows it was checked first.
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path / "missing"), progress=False, **kwargs)


def test_max_model_len_must_fit_the_model(checkpoint) -> None:
    with pytest.raises(ValueError, match="max_model_len=257 is invalid: expected at most 256"):
        LLM(checkpoint, max_model_len=257, kv_cache_gib=0.001, progress=False)
    assert LLM(checkpoint, max_model_len=256, kv_cache_gib=0.001, progress=False).engine.config.max_model_len == 256


def test_zero_speculative_tokens_turns_drafting_off(checkpoint) -> None:
    llm = LLM(checkpoint, num_speculative_tokens=0, kv_cache_gib=0.001, progress=False)
    assert llm.engine.drafter is None
    (out,) = llm.generate("the winter", GREEDY, use_tqdm=False)
    assert len(out.token_ids) == GREEDY.max_tokens and out.stats.num_draft_tokens == 0
