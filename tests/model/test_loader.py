"""load_model on GGUF files and Hugging Face directories: weights, config, tokenizer, the
dequantization cache, and errors that name the bad argument."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from verispec.model import AttentionMetadata, gguf_file, load_model
from verispec.model.chat_template import CHATML_TEMPLATE
from verispec.files import intact
from verispec.model.loader import converted_checkpoint_dir

from ..damage import flip_middle

from .conftest import (TINY_CONFIG, llama_cpp_permute, make_hf_tiny, tiny_tokenizer, tiny_vocab, write_shape,
                       write_tiny_vocab)

_GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _tiny_vocab_without_bos(writer) -> None:
    write_tiny_vocab(writer)
    writer.add_add_bos_token(False)


def write_tiny_gguf(path: Path, hf, write_vocab=_tiny_vocab_without_bos) -> None:
    """The HF model as llama.cpp would convert it (float32 tensors, q/k permuted), with the
    tokenizer.* metadata write_vocab(writer) adds."""
    cfg = hf.config
    writer = gguf.GGUFWriter(str(path), "llama")
    write_shape(writer, cfg)
    writer.add_rope_freq_base(TINY_CONFIG["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    write_vocab(writer)
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array = tensor.numpy().copy()
        if name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, cfg.num_key_value_heads)
        if name.startswith("model.layers."):
            _, _, layer, *rest = name.split(".")
            gguf_name = f"blk.{layer}.{_GGUF_NAMES['.'.join(rest[:-1])]}.weight"
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight",
                         "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]
        writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def tiny_gguf(request, tmp_path_factory):
    hf = make_hf_tiny(tied=request.param, seed=5)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, hf)
    return hf, path


def _all_logits(model, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]
    attn = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(-(-len(ids) // 8)))], 8)
    caches = model.allocate_kv_cache(-(-len(ids) // 8), 8)
    return model(torch.tensor(ids), attn.positions(), attn, caches, torch.arange(len(ids)))


def test_gguf_loads_like_hf_and_is_cached(tiny_gguf, tmp_path, monkeypatch) -> None:
    hf, path = tiny_gguf
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path / "cache"))
    model, tokenizer = load_model(str(path), progress=False)
    assert model.config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert model.config.rope_theta == TINY_CONFIG["rope_theta"]
    assert model.config.eos_token_ids == (2,) and model.config.bos_token_id == 1
    ids = list(range(3, 40))
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_all_logits(model, ids), expected, atol=2e-5, rtol=1e-5)

    text = "<|im_start|>user\nthe answer is 42<|im_end|>"
    assert tokenizer.encode(text) == tiny_tokenizer().encode(text)
    assert tokenizer.chat_template == CHATML_TEMPLATE
    assert tokenizer.eos_token_id == 2

    # The second load reads the cached checkpoint directory, not the GGUF file.
    # (Beside it, cpu-products.json where this process timed its float32 products first.)
    (entry,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert entry == converted_checkpoint_dir(str(path))
    monkeypatch.setattr(gguf_file, "_BoundedReader", None)
    again, _ = load_model(path, progress=False)
    torch.testing.assert_close(_all_logits(again, ids), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
def test_bytes_changed_in_the_converted_checkpoint_are_caught_and_it_is_converted_again(
        tiny_gguf, tmp_path, monkeypatch, caplog, name) -> None:
    hf, path = tiny_gguf
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path / "cache"))
    ids = list(range(3, 40))
    clean = _all_logits(load_model(str(path), progress=False)[0], ids)
    entry = converted_checkpoint_dir(str(path))
    flip_middle(entry / name, 16)
    with caplog.at_level(logging.WARNING, logger="verispec"):
        model, tokenizer = load_model(str(path), progress=False)
    (line,) = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert str(entry) in line and name in line and "converting tiny.gguf again" in line
    assert torch.equal(_all_logits(model, ids), clean) and tokenizer.eos_token_id == 2
    assert all(intact(f) for f in entry.iterdir() if f.suffix != ".crc32")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()) == [entry.name]


def test_gguf_without_writable_cache_still_loads(tiny_gguf, tmp_path, monkeypatch) -> None:
    hf, path = tiny_gguf
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(blocker))
    with pytest.warns(UserWarning, match="could not cache"):
        model, _ = load_model(str(path), progress=False)
    ids = [5, 9, 11]
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_all_logits(model, ids), expected, atol=2e-5, rtol=1e-5)


def test_hf_directory_config(tiny_checkpoint) -> None:
    hf, directory = tiny_checkpoint
    model, tokenizer = load_model(directory, progress=False)
    cfg = model.config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert cfg.rope_theta == TINY_CONFIG["rope_theta"]
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    assert cfg.eos_token_ids == (2,)
    assert tokenizer.bos_token_id == 1 and tokenizer.eos_token_id == 2


def test_bad_model_argument(tmp_path) -> None:
    with pytest.raises(ValueError, match="model=.*no such file"):
        load_model(str(tmp_path / "missing.gguf"), progress=False)
    with pytest.raises(ValueError, match="model=.*config.json"):
        load_model(str(tmp_path), progress=False)
    with pytest.raises(TypeError, match="model=42"):
        load_model(42, progress=False)


def test_bad_dtype_and_device(tiny_checkpoint) -> None:
    _, directory = tiny_checkpoint
    with pytest.raises(ValueError, match="dtype=torch.float64"):
        load_model(directory, dtype=torch.float64, progress=False)
    with pytest.raises(ValueError, match="device='gpu0'"):
        load_model(directory, device="gpu0", progress=False)


def _edited_copy(directory: Path, target: Path, **changes) -> Path:
    shutil.copytree(directory, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("changes,match", [
    ({"model_type": "falcon", "architectures": ["FalconForCausalLM"]},
     "model_type='falcon', expected one of llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3_text, phi3"),
    ({"attention_bias": True}, "missing 'model.layers.0.self_attn.q_proj.bias'"),
    ({"rope_parameters": {"rope_type": "mrope", "rope_theta": 5e5}}, "rope type='mrope'"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5"),
    ({"hidden_act": "relu"}, "hidden_act='relu'"),
])
def test_unsupported_architecture(tiny_checkpoint, tmp_path, changes, match) -> None:
    _, directory = tiny_checkpoint
    edited = _edited_copy(directory, tmp_path / "edited", **changes)
    with pytest.raises(ValueError, match=f"model=.*{match}"):
        load_model(edited, progress=False)


def test_missing_tensor_is_named(tiny_checkpoint, tmp_path) -> None:
    _, directory = tiny_checkpoint
    edited = _edited_copy(directory, tmp_path / "edited")
    weights = load_file(str(edited / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(edited / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(edited, progress=False)


def test_truncated_gguf_is_named(tiny_gguf, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path / "cache"))
    _, path = tiny_gguf
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[:-5000])
    with pytest.raises(ValueError, match=f"model='{truncated}' is not a valid GGUF file"):
        load_model(truncated, progress=False)


def test_gguf_metadata_of_the_wrong_type_is_named(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "typed.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("llama.embedding_length", "64")
    writer.add_token_list(tiny_vocab()[0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="has GGUF metadata llama.embedding_length='64': expected int"):
        load_model(path, progress=False)


def test_device_without_cuda_is_named(tiny_checkpoint, monkeypatch) -> None:
    _, directory = tiny_checkpoint
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device='cuda' is unavailable"):
        load_model(directory, device="cuda", progress=False)
    with pytest.raises(ValueError, match="device='meta' is not supported"):
        load_model(directory, device="meta", progress=False)
