"""Every supported family against transformers' own model classes: tiny random checkpoints
(AutoConfig.for_model, save_pretrained), loaded by verispec. Logits over a prompt longer than
the sliding windows, prefilled at once, in chunks, token by token and in ragged paged batches;
greedy generation token for token; speculative greedy (n-gram, draft model) == plain."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from verispec.config import CacheConfig, EngineConfig, SpeculativeConfig
from verispec.engine.engine import LLMEngine
from verispec.model import llama as llama_module
from verispec.model import load_model
from verispec.model.config import RopeScaling
from verispec.model.linear import STACK_COMPILED, STACK_LINEAR, skinny_rows
from verispec.model.quant import decoder as stack_module
from verispec.model.rotary import RotaryEmbedding
from verispec.sampling_params import SamplingParams
from verispec.spec_decode.draft_model import DraftModelDrafter
from verispec.spec_decode.eagle import EagleDrafter
from verispec.spec_decode.heads import HeadConfig, new_head
from verispec.spec_decode.medusa import MedusaDrafter
from verispec.spec_decode.ngram import NgramDrafter

from ..tiny import run_all, tiny_engine, word_tokenizer
from .conftest import tiny_tokenizer
from .test_llama import LENGTHS, SCHEDULE, hf_logits, run_schedule

VOCAB = 128
WINDOW = 8  # shorter than every prompt below: sliding layers hide keys
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=None,
             pad_token_id=0)
_FACTORS = dict(short_factor=[1.0, 1.1, 1.3, 1.7, 2.0, 2.5, 3.0, 4.0],
                long_factor=[1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 16.0])

# id -> (model_type, options beyond SHAPE): each family with the options it is known for.
FAMILIES = {
    "llama3-rope-biases": ("llama", dict(attention_bias=True, mlp_bias=True, rope_parameters=dict(
        rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=32))),
    "llama-yarn": ("llama", dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=64))),
    "llama-linear-tied": ("llama", dict(tie_word_embeddings=True, rope_parameters=dict(
        rope_type="linear", rope_theta=1e4, factor=2.0))),
    "mistral-sliding": ("mistral", dict(sliding_window=WINDOW)),
    "qwen2-sliding-tied": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW,
                                         max_window_layers=1, tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(tie_word_embeddings=False)),
    "gemma": ("gemma", dict()),
    "gemma2": ("gemma2", dict(sliding_window=WINDOW, query_pre_attn_scalar=24,
                              attn_logit_softcapping=5.0, final_logit_softcapping=30.0)),
    "gemma3": ("gemma3_text", dict(
        sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters=dict(full_attention=dict(rope_type="linear", rope_theta=1e6, factor=4.0),
                             sliding_attention=dict(rope_type="default", rope_theta=1e4)))),
    # Phi3Config's own original_max_position_embeddings (4096) would override the rope's.
    "phi3-longrope-sliding": ("phi3", dict(sliding_window=16, original_max_position_embeddings=64,
                                           rope_parameters=dict(
        rope_type="longrope", rope_theta=1e4, original_max_position_embeddings=64, **_FACTORS))),
}


def make_hf(model_type: str, options: dict, seed: int):
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**SHAPE, **options})
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if param.dim() == 1:  # random norms and biases, so that a swapped one shows
                param.uniform_(3.0, 5.0) if name == "model.norm.weight" else param.uniform_(0.5, 1.5)
    return hf


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(hf target, our target, our draft model) for one family."""
    model_type, options = FAMILIES[request.param]
    loaded = []
    for seed in (0, 1):
        hf = make_hf(model_type, options, seed)
        directory = tmp_path_factory.mktemp(f"{request.param}-{seed}")
        hf.save_pretrained(directory)
        tiny_tokenizer().save(directory)
        loaded.append((hf, load_model(directory, progress=False)[0], directory))
    return SimpleNamespace(name=request.param, hf=loaded[0][0], ours=loaded[0][1],
                           draft=loaded[1][1], directory=loaded[0][2])


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# 24 tokens: more than every window (8, 16) and than MAX_PADDED_QUERY_LEN (16), so the prefill and
# the 19-token chunk (with cached context) are attended on their own, the rest padded.
@pytest.mark.parametrize("schedule", [[[24]], [[4], [1], [19]], [[1]] * 24],
                         ids=["prefill", "chunks", "decode"])
def test_logits_match_transformers(family, schedule) -> None:
    ids = _ids(24, 1)
    (logits,) = run_schedule(family.ours, [ids], schedule)
    torch.testing.assert_close(logits, hf_logits(family.hf, ids), atol=1e-4, rtol=1e-4)


def test_ragged_paged_batches_match_transformers(family) -> None:
    prompts = [_ids(n, 10 + i) for i, n in enumerate(LENGTHS)]
    for prompt, logits in zip(prompts, run_schedule(family.ours, prompts, SCHEDULE)):
        torch.testing.assert_close(logits, hf_logits(family.hf, prompt), atol=1e-4, rtol=1e-4)


def test_greedy_and_speculative_generation(family) -> None:
    if family.name in ("llama-yarn", "llama-linear-tied"):
        pytest.skip("rope variants of Llama: their logits tests cover what differs")
    prompt, steps = _ids(12, 2), 16
    expected = list(prompt)
    for _ in range(steps):
        expected.append(int(hf_logits(family.hf, expected)[-1].argmax()))
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    drafters = {"plain": (None, 0), "ngram": (NgramDrafter(1, 3, 3), 3),
                "draft": (DraftModelDrafter(family.draft, num_blocks=64, block_size=4), 3)}
    for name, (drafter, k) in drafters.items():
        engine = tiny_engine(family.ours, drafter, k=k)
        rid = engine.add_request(list(prompt), params)
        assert run_all(engine)[rid].token_ids == expected[len(prompt):], name


@pytest.mark.parametrize("kind,tree", [("eagle", None), ("medusa", (2, 2))],
                         ids=["eagle", "medusa-tree"])
def test_learned_heads_keep_greedy_output(family, kind, tree) -> None:
    """EAGLE / Medusa heads (untrained; chains, and a tree whose rows attend through the
    sliding-window masks) on the families whose embedding, norms, soft caps, windows and ropes
    differ most from Llama: greedy output is still the target's."""
    if family.name not in ("gemma2", "gemma3"):
        pytest.skip("Gemma 2 and 3 cover the options the heads read")
    head = new_head(HeadConfig.for_target(kind, family.ours.config), family.ours,
                    torch.arange(VOCAB))
    drafter = EagleDrafter(head, num_blocks=64, block_size=4) if kind == "eagle" \
        else MedusaDrafter(head)
    prompt = _ids(12, 2)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = []
    for drafter_or_none in (None, drafter):
        spec = SpeculativeConfig(method="none" if drafter_or_none is None else kind,
                                 num_speculative_tokens=3, adaptive=False,
                                 tree=None if drafter_or_none is None else tree)
        config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512,
                              cache=CacheConfig(4, 64), speculative=spec)
        engine = LLMEngine(family.ours, word_tokenizer(VOCAB), config, drafter_or_none)
        rid = engine.add_request(list(prompt), params)
        outputs.append(run_all(engine)[rid].token_ids)
    assert outputs[1] == outputs[0]


def test_int8_weights(family, tmp_path, monkeypatch, caplog) -> None:
    """The quantized path runs every family's options: close to the float model, and decoding
    token by token gives the prefill's logits bit for bit (the row-by-row kernel attends, sliding
    windows and soft caps included)."""
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path))
    quantized, _ = load_model(family.directory, quantization="int8", progress=False)
    ids = _ids(24, 1)
    (prefill,) = run_schedule(quantized, [ids], [[24]])
    (decode,) = run_schedule(quantized, [ids], [[1]] * 24)
    (full,) = run_schedule(family.ours, [ids], [[24]])
    # int8 rounding of weights and activations: a few % of the logits' range (Gemma 3's random
    # (1 + w) q/k norms sharpen attention: ~10%); a dropped option would be off by far more.
    assert (prefill - full).abs().max() < 0.15 * full.abs().max()
    if quantized.rowwise_attention:
        assert torch.equal(decode, prefill)
    else:  # not compiled here: SDPA's rounding differs by batch shape, int8 magnifies it
        assert (decode - prefill).abs().max() < 0.02 * prefill.abs().max()
    with caplog.at_level(logging.WARNING, logger="verispec"):
        cached, _ = load_model(family.directory, quantization="int8", progress=False)
    assert "ignoring the cached" not in caplog.text and list(tmp_path.glob("*/model.safetensors"))
    assert cached.config == quantized.config  # read back from the cache: every option kept
    assert torch.equal(run_schedule(cached, [ids], [[24]])[0], prefill)


def test_compiled_layers_equal_the_torch_layers(family, tmp_path, monkeypatch) -> None:
    """The compiled decoder stack (verispec.model.quant.decoder) runs every family's options as
    DecoderLayer's torch operations do: two sequences, one prefilled in chunks (a sliding window
    hides keys), one fed a token at a time, then both as verify rows."""
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path))
    quantized, _ = load_model(family.directory, quantization="int8", progress=False)
    if quantized._compiled_stack() is None:
        pytest.skip("the compiled kernels are not built here")
    assert quantized._compiled_stack().has_head  # the final norm and LM head compiled too
    prompts = [_ids(24, 1), _ids(24, 2)]
    schedule = [[10, 1], [9, 1], [5, 5]] + [[0, 1]] * 17
    compiled = run_schedule(quantized, prompts, schedule)
    quantized.compiled_layers = False
    layers = run_schedule(quantized, prompts, schedule)
    for ours, theirs in zip(compiled, layers):
        # Float rounding inside a layer differs (the norms' sums); int8 activations can turn it
        # into a different rounding of one value. Measured: 0 to 3e-7 of the logits' range,
        # 3e-5 (Gemma 2) and 1.5e-3 (Gemma 3, sharp attention); a bias off by 1 moves them 5%.
        assert (ours - theirs).abs().max() < 5e-3 * theirs.abs().max()


@pytest.mark.parametrize("product", ["compiled", "linear", "skinny"])
def test_float32_compiled_layers_equal_the_torch_layers(family, product, monkeypatch) -> None:
    """A float32 model on the CPU runs the same compiled stack over its dense weights, each
    product as the per-machine choice may pick it (forced here): the torch layers' logits up to
    float rounding. With the compiled product at every row count a row does not depend on the
    others, so decoding token by token gives the prefill's logits bit for bit."""
    model = family.ours
    if model._compiled_stack() is None:
        pytest.skip("the compiled kernels are not built here")
    assert model.rowwise_attention and model._compiled_stack().has_head

    def code(rows: int, shape: tuple[int, int]) -> int:
        return {"compiled": STACK_COMPILED, "linear": STACK_LINEAR}.get(product, skinny_rows(rows))

    monkeypatch.setattr(stack_module, "stack_product", code)
    prompts = [_ids(24, 1), _ids(24, 2)]
    schedule = [[10, 1], [9, 1], [5, 5]] + [[0, 1]] * 17
    compiled = run_schedule(model, prompts, schedule)
    model.compiled_layers = False
    try:
        layers = run_schedule(model, prompts, schedule)
    finally:
        model.compiled_layers = True
    for ours, theirs in zip(compiled, layers):
        # Measured: up to 7e-7 of the logits' range (2e-6 for Gemma 3's sharp attention: the
        # norms' and products' sums run in another order); a dropped bias fails it.
        assert (ours - theirs).abs().max() < 1e-5 * theirs.abs().max()
    if product == "compiled":
        ids = _ids(24, 1)
        assert torch.equal(run_schedule(model, [ids], [[1]] * 24)[0],
                           run_schedule(model, [ids], [[24]])[0])


def test_long_float32_chunks_attend_with_sdpa_over_an_unfilled_cache(family, monkeypatch) -> None:
    """A float32 chunk of more than FLOAT_ROWWISE_MAX_QUERY new tokens is attended by SDPA in
    the torch layers (the row-by-row kernel's cost grows with the square of the chunk): the
    same logits up to rounding, reading only written slots of the unfilled cache (poisoned with
    NaN here), with and without cached context."""
    model = family.ours
    if not model.rowwise_attention:
        pytest.skip("the compiled kernels are not built here")
    # Chunks of 20 (no cached context), 17 and 23 (with): above MAX_PADDED_QUERY_LEN, below
    # which every sequence is attended row by row.
    prompts = [_ids(48, 1), _ids(48, 2)]
    schedule = [[20, 1], [17, 1], [11, 23]] + [[0, 1]] * 23
    rowwise = run_schedule(model, prompts, schedule)  # every chunk within the limit
    monkeypatch.setattr(llama_module, "FLOAT_ROWWISE_MAX_QUERY", 16)
    allocate = model.allocate_kv_cache
    monkeypatch.setattr(model, "allocate_kv_cache",
                        lambda blocks, size: [c.fill_(float("nan")) for c in allocate(blocks, size)])
    sdpa = run_schedule(model, prompts, schedule)
    for ours, theirs in zip(sdpa, rowwise):
        assert torch.isfinite(ours).all()
        # Measured: up to 5e-7 of the logits' range (1.3e-6 for Gemma 3): SDPA sums in another
        # order.
        assert (ours - theirs).abs().max() < 1e-5 * theirs.abs().max()


def test_the_stack_names_bad_products(family) -> None:
    stack = family.ours._compiled_stack()
    if stack is None:
        pytest.skip("the compiled kernels are not built here")
    hidden = torch.zeros(3, family.ours.config.hidden_size)
    with pytest.raises(RuntimeError, match="product 2 cannot run 3 rows"):
        stack.logits(hidden, torch.arange(3), 2)
    with pytest.raises(RuntimeError, match="products has 3 entries: expected 4"):
        stack.forward(hidden, 0, 0, [], [], family.ours.allocate_kv_cache(1, 16),
                      torch.zeros(3, dtype=torch.int64), [], [0, 0, 0])


def test_sliding_window_is_config(family) -> None:
    """The tests above exercise the window: the configs of sliding families carry it."""
    config = family.ours.config
    windows = [config.window_of(i) for i in range(config.num_layers)]
    expected = {"mistral-sliding": [WINDOW] * 2, "qwen2-sliding-tied": [None, WINDOW],
                "gemma2": [WINDOW, None], "gemma3": [WINDOW, None],
                "phi3-longrope-sliding": [16, 16]}.get(family.name, [None, None])
    assert windows == expected


ROPES = {
    "linear": dict(factor=2.0),
    "llama3": dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32),
    "yarn": dict(factor=4.0, original_max_position_embeddings=64, beta_fast=16.0),
    "yarn-mscale": dict(factor=4.0, original_max_position_embeddings=64, mscale=1.0,
                        mscale_all_dim=0.5),
    "longrope": dict(original_max_position_embeddings=64, **_FACTORS),
    "dynamic": dict(factor=3.0),
}


@pytest.mark.parametrize("name", list(ROPES))
def test_rope_scaling_matches_transformers(name) -> None:
    """Frequencies and cos/sin factor of every scaling type against transformers' own
    functions, at a length inside the trained context and one beyond it (per token here)."""
    rope_type = name.split("-")[0]
    params = dict(rope_type=rope_type, rope_theta=1e4, **ROPES[name])
    config = AutoConfig.for_model("llama", **{**SHAPE, "rope_parameters": params})
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in ROPES[name].items()}
    if rope_type == "longrope":
        fields["factor"] = 256 / 64
    ours = RotaryEmbedding(16, 1e4, torch.float32, torch.device("cpu"),
                           RopeScaling(rope_type, **fields), max_position_embeddings=256)
    for length in (40, 300):
        inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, seq_len=length)
        position = length - 1  # the last token of a sequence of `length` tokens
        angles = position * inv_freq.float()
        cos, sin = ours.angles(torch.tensor([position]))
        torch.testing.assert_close(cos[0, 0], torch.cat([angles.cos(), angles.cos()]) * factor,
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sin[0, 0], torch.cat([-angles.sin(), angles.sin()]) * factor,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", [None, "yarn-mscale", "dynamic"])
def test_the_angles_table_holds_the_angles_computed_for_the_step(name) -> None:
    """RotaryEmbedding.angles reads position-only angles from a table on the CPU: bit for bit
    what computing them for the step's positions gives, after the table grows too (yarn's
    attention factor included); per-token scaling (dynamic) computes them every time."""
    scaling = None if name is None else RopeScaling(name.split("-")[0], **{
        k: tuple(v) if isinstance(v, list) else v for k, v in ROPES[name].items()})
    rotary = RotaryEmbedding(16, 1e4, torch.float32, torch.device("cpu"), scaling, max_position_embeddings=256)
    for positions in (torch.tensor([3, 0, 200]), torch.tensor([1000, 7, 300, 299])):
        cos, sin = rotary.angles(positions)
        expected_cos, expected_sin = rotary._computed(positions)
        assert torch.equal(cos, expected_cos) and torch.equal(sin, expected_sin)
        assert cos.is_contiguous() and sin.is_contiguous() and cos.shape == (len(positions), 1, 16)
    assert (rotary._table is None) == (name == "dynamic")
    assert rotary._table is None or rotary._table[0].shape[0] >= 1001


def test_several_eos_ids_and_generation_config(tmp_path) -> None:
    """config.json's eos_token_id list and generation_config.json's join, in order."""
    hf = make_hf("qwen3", dict(eos_token_id=[2, 3]), seed=0)
    hf.save_pretrained(tmp_path)
    tiny_tokenizer().save(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 5]}))
    model, tokenizer = load_model(tmp_path, progress=False)
    assert model.config.eos_token_ids == (2, 3, 5)


def test_gemmas_legacy_gelu_is_the_tanh_form(tmp_path) -> None:
    """Gemma's first config.json files say hidden_act="gelu"; transformers runs the tanh form."""
    hf = make_hf("gemma", dict(hidden_act="gelu"), seed=0)
    assert hf.config.hidden_act == "gelu_pytorch_tanh"
    hf.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "hidden_act": "gelu"}))
    tiny_tokenizer().save(tmp_path)
    model, _ = load_model(tmp_path, progress=False)
    assert model.config.hidden_act == "gelu_pytorch_tanh"


def test_transformers_4_rope_keys(tmp_path) -> None:
    """Files written before transformers 5: rope_theta + rope_scaling (Phi-3's early "su" type,
    original_max_position_embeddings at the top level) read as rope_parameters are."""
    model_type, options = FAMILIES["phi3-longrope-sliding"]
    hf = make_hf(model_type, options, seed=0)
    hf.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw.update(rope_theta=rope["rope_theta"], original_max_position_embeddings=64,
               rope_scaling=dict(type="su", short_factor=rope["short_factor"],
                                 long_factor=rope["long_factor"]))
    (tmp_path / "config.json").write_text(json.dumps(raw))
    tiny_tokenizer().save(tmp_path)
    model, _ = load_model(tmp_path, progress=False)
    ids = _ids(40, 1)
    torch.testing.assert_close(run_schedule(model, [ids], [[40]])[0], hf_logits(hf, ids),
                               atol=1e-4, rtol=1e-4)
