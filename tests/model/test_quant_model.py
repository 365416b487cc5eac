"""The embedded model run as its GGUF file stores it (4-bit layers, 8-bit embedding and LM head):
the same weights as the widened float32 model, close logits, and speculation on it exact."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verispec import LLM, SamplingParams
from verispec.files import intact
from verispec.runtime.kv_cache import BlockManager
from verispec.runtime.runner import Feed, ModelRunner
from verispec.model import load_model
from verispec.model.attention import AttentionMetadata
from verispec.model.quant.kernels import default_kernel

from ..damage import flip_middle

TEXT = ("<|im_start|>user\nExplain how a rainbow forms, for a child.<|im_end|>\n<|im_start|>"
        "assistant\nA rainbow forms when sunlight passes through raindrops. The light bends, "
        "splits into colours and reflects back to your eyes.")


@pytest.fixture(scope="module")
def stored():
    return load_model(quantization="gguf", progress=False)


def _logits(model, ids: list[int]) -> torch.Tensor:  # [len(ids), V]
    blocks = BlockManager(64, 16)
    blocks.allocate("s", len(ids))
    return ModelRunner(model, blocks).forward([Feed("s", ids, 0, len(ids))])


def test_stored_blocks_are_the_widened_models_weights(stored, embedded) -> None:
    model, _ = stored
    widened, _ = embedded
    assert model.quantized and model.embed_quantized is model.lm_head.parts[0]  # tied: one table
    assert [p.kind for p in model.lm_head.parts] == ["Q8_0"]
    ids = torch.tensor([0, 5, 49151, 1234])
    assert torch.equal(model.embed(ids), widened.embed_tokens[ids])
    for layer, float_layer in ((model.layers[i], widened.layers[i]) for i in (0, 29)):
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            parts = getattr(layer, name).parts
            assert [p.kind for p in parts] == ["Q4_1"]  # q, k, v stacked into one product
            # q and k rows un-permuted as the float path does.
            assert torch.equal(parts[0].dequantize(), getattr(float_layer, name).weight)
    assert torch.equal(model.lm_head_rows(ids), widened.lm_head.weight[ids])


def test_stored_logits_are_close_to_the_widened_models(stored, embedded) -> None:
    model, tokenizer = stored
    ids = tokenizer.encode(TEXT)
    ours, wide = _logits(model, ids), _logits(embedded[0], ids)
    agreement = (ours.argmax(-1) == wide.argmax(-1)).float().mean()
    kl = torch.nn.functional.kl_div(ours.log_softmax(-1), wide.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1).mean()
    # Measured: agreement 0.94, KL 0.003 (int8 activations are the only difference).
    assert agreement >= 0.85 and kl < 0.02


def test_a_row_of_a_verify_pass_equals_the_same_row_decoded_alone(stored) -> None:
    """Quantized products and the row-by-row attention make every row independent of the
    others: what keeps greedy speculation on int8 activations equal to plain decoding."""
    model, tokenizer = stored
    ids = tokenizer.encode(TEXT)[:24]

    def runner() -> ModelRunner:
        blocks = BlockManager(64, 16)
        blocks.allocate("s", len(ids))
        run = ModelRunner(model, blocks)
        run.forward([Feed("s", ids[:-5], 0, 1)])
        return run

    verify = runner().forward([Feed("s", ids[-5:], len(ids) - 5, 5)])
    decode = runner()
    rows = [decode.forward([Feed("s", [token], len(ids) - 5 + i, 1)])[0]
            for i, token in enumerate(ids[-5:])]
    assert torch.equal(torch.stack(rows), verify)


@pytest.mark.parametrize("draft", ["ngram", "eagle", "int8"])
def test_greedy_speculation_on_stored_weights_equals_plain_decoding(draft) -> None:
    params = SamplingParams(temperature=0, max_tokens=40)
    prompts = [[{"role": "user", "content": "Repeat after me: one two three, one two three."}],
               [{"role": "user", "content": "Name three colours."}]]
    plain = LLM(draft="none", progress=False).chat(prompts, params, use_tqdm=False)
    spec = LLM(draft=draft, num_speculative_tokens=4, adaptive=False,
               progress=False).chat(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.stats.num_accepted_tokens for o in spec) > 0


def test_bad_quantization_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"quantization='int3' is invalid: expected None or one "
                                         r"of \('gguf', 'int8', 'int4'\)"):
        LLM(quantization="int3", progress=False)
    with pytest.raises(ValueError, match=r"dtype='bfloat16' is invalid with quantization='int4'"):
        LLM(dtype="bfloat16", quantization="int4", progress=False)
    with pytest.raises(ValueError, match="group_size=48 is invalid"):
        load_model(quantization="int4", group_size=48, progress=False)


def test_a_quantized_model_is_cached_and_a_damaged_cache_rebuilt(tmp_path, monkeypatch,
                                                                   tiny_checkpoint) -> None:
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path))
    _, directory = tiny_checkpoint
    ids = list(range(10))

    def load():
        model, _ = load_model(str(directory), quantization="int4", progress=False)
        return _logits(model, ids)

    first = load()
    (entry,) = tmp_path.glob("*-int4-g32")
    saved = (entry / "model.safetensors").stat().st_mtime_ns
    assert torch.equal(load(), first)  # read back from the cache, not rebuilt
    assert (entry / "model.safetensors").stat().st_mtime_ns == saved
    (entry / "model.safetensors").write_bytes(b"not a model")
    assert torch.equal(load(), first)  # ignored, rebuilt and rewritten
    assert (entry / "model.safetensors").stat().st_size > 100
    (entry / "model.safetensors").unlink()  # an entry as format 4 and older left it
    (entry / "model.pt").write_bytes(b"a torch.save pickle")
    assert torch.equal(load(), first)
    assert not (entry / "model.pt").exists()


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json"])
def test_bytes_changed_in_the_cached_quantized_model_are_caught_and_rebuilt(tmp_path, monkeypatch, caplog,
                                                                          tiny_checkpoint, name) -> None:
    """Changed bytes that still load (weights read as other weights) are a damaged cache too."""
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path))
    _, directory = tiny_checkpoint
    ids = list(range(10))

    def load():
        model, tokenizer = load_model(str(directory), quantization="int4", progress=False)
        return _logits(model, ids), tokenizer.encode("the answer is 42")

    first = load()
    (entry,) = tmp_path.glob("*-int4-g32")
    flip_middle(entry / name, 4096)
    with caplog.at_level(logging.WARNING, logger="verispec"):
        again = load()
    assert torch.equal(again[0], first[0]) and again[1] == first[1]
    (line,) = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert str(entry) in line and name in line and "preparing it again" in line
    assert intact(entry / name)


def test_compiled_layers_give_the_torch_layers_logits_and_hidden_states(stored) -> None:
    """The stored model runs its decoder layers as one compiled call (verispec.model.quant.
    decoder); the torch operations of DecoderLayer give the same logits and the hidden states a
    learned drafter reads, up to float rounding that int8 activations amplify layer by layer."""
    model, tokenizer = stored
    if model._compiled_stack() is None:
        pytest.skip("the compiled kernels are not built here")
    ids = tokenizer.encode(TEXT)
    attn = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(4))], 16)
    rows = torch.arange(len(ids))

    def run(compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        model.compiled_layers = compiled
        try:
            return model.forward_hidden(torch.tensor(ids), attn.positions(), attn,
                                        model.allocate_kv_cache(4, 16), rows, (2, 15, 30))
        finally:
            model.compiled_layers = True

    (logits, hidden), (torch_logits, torch_hidden) = run(True), run(False)
    stack = model._compiled_stack()
    assert stack.has_head  # the final norm and the LM head too (torch: rms_norm, QuantLinear)
    with pytest.raises(RuntimeError, match="row 9 is not within"):
        stack.logits(torch.zeros(9, model.config.hidden_size), torch.tensor([9]), 0)
    width = model.config.hidden_size
    for i in range(3):
        ours, theirs = (h[:, i * width:(i + 1) * width] for h in (hidden, torch_hidden))
        # Measured: 8e-4, 4e-5 and 2.5e-3 of the largest value (layers 2, 15, 30).
        assert (ours - theirs).abs().max() < 1e-2 * theirs.abs().max()
    kl = torch.nn.functional.kl_div(logits.log_softmax(-1), torch_logits.log_softmax(-1),
                                    log_target=True, reduction="none").sum(-1).mean()
    # Measured: top-1 agreement 0.91, KL 0.004: as far apart as either is from the widened
    # float32 model (test above), where int8 activations are the only difference.
    assert (logits.argmax(-1) == torch_logits.argmax(-1)).float().mean() >= 0.8 and kl < 0.02


def test_captured_hidden_states_change_nothing_and_are_checked(stored) -> None:
    """The compiled stack copies the hidden states a learned drafter reads out of its one call
    (DecoderStack.forward's capture_after): the logits are those of a pass without capture, bit
    for bit, and a layer's states the same whichever other layers are captured beside it."""
    model, tokenizer = stored
    stack = model._compiled_stack()
    if stack is None:
        pytest.skip("the compiled kernels are not built here")
    ids = tokenizer.encode(TEXT)[:12]
    attn = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(4))], 16)
    rows = torch.arange(len(ids))

    def run(layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        return model.forward_hidden(torch.tensor(ids), attn.positions(), attn, model.allocate_kv_cache(4, 16),
                                    rows, layers)

    plain, _ = run(())
    logits, hidden = run((2, 15, 30))
    alone, hidden_15 = run((15,))
    width = model.config.hidden_size
    assert torch.equal(logits, plain) and torch.equal(alone, plain)
    assert torch.equal(hidden[:, width:2 * width], hidden_15)
    assert not torch.equal(hidden[:, :width], hidden_15)  # each layer its own states
    empty = torch.zeros(0, width)
    caches = model.allocate_kv_cache(1, 16)
    call = dict(hidden=empty, begin=0, end=model.config.num_layers, cos=[], sin=[], kv_caches=caches,
                slot_mapping=torch.zeros(0, dtype=torch.int64), plans=[], products=[0, 0, 0, 0])
    with pytest.raises(RuntimeError, match=r"capture_after must increase within \(0, 30\): 30"):
        stack.forward(**call, capture_after=[30], captured=[empty])
    with pytest.raises(RuntimeError, match="capture_after has 1 layer numbers and captured 0"):
        stack.forward(**call, capture_after=[2], captured=[])
    with pytest.raises(RuntimeError, match=r"captured\[0\] must be a contiguous \[0, 576\]"):
        stack.forward(**call, capture_after=[2], captured=[torch.zeros(0, 3)])


def test_the_portable_compiled_layers_give_the_same_logits_bit_for_bit(stored, tmp_path) -> None:
    """VERISPEC_CPU_KERNEL=generic (read once per process) runs the compiled layers with the
    scalar products, the portable attention and float16 conversions: every path performs the
    same operations, so the logits are those of the fastest path, bit for bit."""
    model, tokenizer = stored
    if model._compiled_stack() is None or default_kernel() == "generic":
        pytest.skip("no compiled kernels, or the portable ones are the only ones here")
    ids = tokenizer.encode(TEXT)[:12]
    out = tmp_path / "portable.pt"
    script = ("import sys, torch; sys.path.insert(0, '.'); "
              "from tests.model.test_quant_model import _logits; "
              "from verispec.model import load_model; "
              "model, _ = load_model(quantization='gguf', progress=False); "
              f"torch.save(_logits(model, {ids!r}), sys.argv[1])")
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", script, str(out)], check=True, timeout=300, cwd=root,
                   env=dict(os.environ, VERISPEC_CPU_KERNEL="generic"))
    assert torch.equal(torch.load(out), _logits(model, ids))
