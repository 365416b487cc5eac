"""A quantized model's prepared weights on disk, so that its second load reads one file.

Reading a GGUF file's blocks (its metadata parser alone takes seconds for a 49K-token
vocabulary) or rounding a float checkpoint to int4 (seconds more) happens once; the result is
saved under the loader's cache directory with torch.save and read back with
torch.load(weights_only=True, mmap=True): tensors and plain values only, nothing to execute.
Written to a temporary name and renamed (verispec.files), so a killed run leaves no cut file;
each file's checksum is written beside it and checked before loading (the check reads the ~100
MB once; the pages it brings in are the ones the first forward pass reads), so a damaged file is
reported in one line and rebuilt, as is a file that does not load.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from verispec.files import atomic_path, intact, seal
from verispec.model.config import ModelConfig
from verispec.model.llama import LlamaModel
from verispec.model.quant.formats import PanelWeight, QuantizedWeight
from verispec.model.quant.linear import QuantLinear
from verispec.model.tokenizer import Tokenizer

# Bump when what is saved changes meaning.
FORMAT = 4  # 3: panels of 16 columns; 4: a tied embedding stored once, as the LM head
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # what Tokenizer.save writes
_log = logging.getLogger("verispec")
Weight = QuantizedWeight | PanelWeight | torch.Tensor


def _pack(weight: Weight) -> dict:
    if isinstance(weight, torch.Tensor):
        return {"layout": "float", "tensor": weight}
    out = {"layout": "panels" if isinstance(weight, PanelWeight) else "rows",
           "packed": weight.packed, "d": weight.d, "bits": weight.bits,
           "zero_point": weight.zero_point, "kind": weight.kind, "shape": list(weight.shape)}
    if weight.m is not None:
        out["m"] = weight.m
    return out


def _unpack(saved: dict) -> Weight:
    if saved["layout"] == "float":
        return saved["tensor"]
    if saved["layout"] == "rows":
        return QuantizedWeight(saved["packed"], saved["d"], saved.get("m"), saved["bits"],
                               saved["zero_point"], saved["kind"])
    return PanelWeight(saved["packed"], saved["d"], saved.get("m"), saved["bits"],
                       saved["zero_point"], saved["kind"], saved["shape"])


def save(model: LlamaModel, tokenizer: Tokenizer, directory: Path) -> None:
    """The model's prepared weights, config and tokenizer into `directory` (created)."""
    linears = {name: [_pack(p) for p in module.parts] for name, module in model.named_modules()
               if isinstance(module, QuantLinear)}
    state = {"format": FORMAT, "config": model.config.to_dict(),
             "embed": {"layout": "lm_head"} if model.embedding_is_lm_head else _pack(model.embed_quantized),
             "linears": linears,
             "parameters": dict(model.named_parameters())}
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(directory)
    for name in TOKENIZER_FILES:
        seal(directory / name)
    with atomic_path(directory / "model.pt", sealed=True) as path:
        torch.save(state, path)


def load(directory: Path) -> tuple[LlamaModel, Tokenizer] | None:
    """The model saved by `save`, or None when there is none or it does not load."""
    path = directory / "model.pt"
    if not path.is_file():
        return None
    damaged = [name for name in ("model.pt", *TOKENIZER_FILES) if not intact(directory / name)]
    if damaged:
        _log.warning("verispec: the cached quantized model in %s is damaged (%s: not the bytes written); "
                     "preparing it again", directory, ", ".join(damaged))
        return None
    try:
        state = torch.load(path, weights_only=True, mmap=True)
        if state.get("format") != FORMAT:
            return None
        config = ModelConfig.from_dict(state["config"])
        model = LlamaModel(config, quantized=True)
        modules = dict(model.named_modules())
        for name, parts in state["linears"].items():
            modules[name].load_prepared([_unpack(p) for p in parts])
        shared = state["embed"]["layout"] == "lm_head"
        model.embed_quantized = model.lm_head.parts[0] if shared else _unpack(state["embed"])
        model.load_state_dict(state["parameters"], strict=False)
        eos = config.eos_token_ids[0] if config.eos_token_ids else None
        tokenizer = Tokenizer.from_directory(directory, config.bos_token_id, eos)
    # A damaged or foreign file: whatever torch, the config or the tokenizer raises about it.
    except Exception as error:  # noqa: BLE001
        _log.warning("verispec: ignoring the cached quantized model in %s (%s)", directory, error)
        return None
    return model.eval(), tokenizer
