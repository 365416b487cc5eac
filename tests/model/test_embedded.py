"""The embedded SmolLM2-135M-Instruct (Q4_1 GGUF) against transformers loading the same file.

transformers dequantizes with the same gguf package and undoes llama.cpp's q/k permutation its
own way, so matching logits and greedy tokens prove our GGUF reading, un-permutation, config and
tokenizer. Loading it in transformers takes ~20 s: one module-scoped load serves every test.
`from_pretrained(gguf_file=...)` would also need `accelerate`, so the reference is assembled from
the same pieces it uses: the GGUF config, and transformers' GGUF tensor conversion.
"""

from __future__ import annotations

import pytest
import torch

from verispec.model import AttentionMetadata, default_model_path

transformers = pytest.importorskip("transformers")
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # noqa: E402

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
STRINGS = [
    "Hello world",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>",
    "Ünïcödé: naïve café, 日本語のテキスト, emoji 🙂👍🏽",
    "code:\n    def f(x):\n        return x ** 2  # 1234\n",
]


@pytest.fixture(scope="module")
def reference():
    path = default_model_path()
    kwargs = {"gguf_file": path.name}
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, **kwargs)
    config = transformers.AutoConfig.from_pretrained(path.parent, **kwargs)
    model = transformers.LlamaForCausalLM(config).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model, tokenizer


def test_tokenizer_matches_transformers(embedded, reference) -> None:
    ours, theirs = embedded[1], reference[1]
    for text in STRINGS:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=True), text
    assert ours.apply_chat_template(PROMPT) == theirs.apply_chat_template(
        PROMPT, tokenize=False, add_generation_prompt=True)


def test_greedy_tokens_match_transformers(embedded, reference) -> None:
    model, tokenizer = embedded
    hf, _ = reference
    prompt = tokenizer.encode(tokenizer.apply_chat_template(PROMPT), add_special_tokens=False)
    steps = 8
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                               output_logits=True, return_dict_in_generate=True)
    hf_tokens = expected.sequences[0, len(prompt):].tolist()

    block_size = 16
    caches = model.allocate_kv_cache(8, block_size)
    table = [[7, 2, 5, 0, 3, 6, 1, 4]]
    tokens, feed, ours_logits = [], prompt, []
    for _ in range(steps):
        seq_len = len(prompt) + len(tokens)
        attn = AttentionMetadata.build([len(feed)], [seq_len], table, block_size)
        logits = model(torch.tensor(feed), attn.positions(), attn, caches,
                       torch.tensor([len(feed) - 1]))
        ours_logits.append(logits[0])
        tokens.append(int(logits[0].argmax()))
        feed = tokens[-1:]
    assert tokens == hf_tokens
    assert "Paris" in tokenizer.decode(tokens)
    torch.testing.assert_close(torch.stack(ours_logits), torch.cat(expected.logits).float(),
                               atol=2e-3, rtol=1e-3)
