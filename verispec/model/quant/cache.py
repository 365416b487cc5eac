"""A quantized model's prepared weights on disk, so that its second load reads one file.

Reading a GGUF file's blocks (its metadata parser alone takes seconds for a 49K-token
vocabulary) or rounding a float checkpoint to int4 (seconds more) happens once; the result is
saved under the loader's cache directory as one safetensors file, its tensors beside a JSON
skeleton of what holds them (config, layouts, which tensor is which part), and read back memory-
mapped: tensors and plain values only, nothing to execute, and ~7 ms for the embedded model's 423
tensors where torch.load's pickle took ~35 ms. Written to a temporary name and renamed
(verispec.files), so a killed run leaves no cut file; each file's checksum is written beside it
and checked on another thread while this one reads the file (zlib releases the GIL; the pages it
brings in are the ones the first forward pass reads), so a damaged file is reported in one line
and rebuilt, as is a file that does not load.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from verispec.files import atomic_path, damaged_later, seal
from verispec.model.config import ModelConfig
from verispec.model.llama import LlamaModel
from verispec.model.quant.formats import PanelWeight, QuantizedWeight
from verispec.model.quant.linear import QuantLinear
from verispec.model.tokenizer import Tokenizer

# Bump when what is saved changes meaning.
FORMAT = 5  # 3: panels of 16 columns; 4: a tied embedding stored once, as the LM head; 5: safetensors
MODEL_FILE = "model.safetensors"
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


def _skeleton(value: object, path: str, tensors: dict[str, torch.Tensor]) -> object:
    """`value` with every tensor moved into `tensors` under its path and replaced by
    {"tensor": path}: a skeleton JSON can hold."""
    if isinstance(value, torch.Tensor):
        tensors[path] = value.detach().clone()  # its own storage: safetensors refuses shared ones
        return {"tensor": path}
    if isinstance(value, dict):
        return {key: _skeleton(item, f"{path}.{key}", tensors) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_skeleton(item, f"{path}.{i}", tensors) for i, item in enumerate(value)]
    return value


def _flesh(value: object, tensors: dict[str, torch.Tensor]) -> object:
    """The inverse of _skeleton."""
    if isinstance(value, dict):
        if value.keys() == {"tensor"}:
            return tensors[value["tensor"]]
        return {key: _flesh(item, tensors) for key, item in value.items()}
    if isinstance(value, list):
        return [_flesh(item, tensors) for item in value]
    return value


def save(model: LlamaModel, tokenizer: Tokenizer, directory: Path) -> None:
    """The model's prepared weights, config and tokenizer into `directory` (created)."""
    linears = {name: [_pack(p) for p in module.parts] for name, module in model.named_modules()
               if isinstance(module, QuantLinear)}
    state = {"format": FORMAT, "config": model.config.to_dict(),
             "embed": {"layout": "lm_head"} if model.embedding_is_lm_head else _pack(model.embed_quantized),
             "linears": linears,
             "parameters": dict(model.named_parameters())}
    tensors: dict[str, torch.Tensor] = {}
    skeleton = json.dumps(_skeleton(state, "", tensors))
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(directory)
    for name in TOKENIZER_FILES:
        seal(directory / name)
    with atomic_path(directory / MODEL_FILE, sealed=True) as path:
        save_file(tensors, path, metadata={"verispec": skeleton})
    for stale in ("model.pt", "model.pt.crc32"):  # format 4 and older, in the same entry
        (directory / stale).unlink(missing_ok=True)


def _read(directory: Path) -> tuple[LlamaModel, Tokenizer] | None:
    """The saved model, or None when it is of another format; what a damaged file makes torch,
    safetensors, the config or the tokenizer raise, raised."""
    with safe_open(directory / MODEL_FILE, framework="pt") as f:
        skeleton = json.loads(f.metadata()["verispec"])
        if skeleton.get("format") != FORMAT:
            return None
        state = _flesh(skeleton, {key: f.get_tensor(key) for key in f.keys()})
    config = ModelConfig.from_dict(state["config"])
    model = LlamaModel(config, quantized=True)
    modules = dict(model.named_modules())
    for name, parts in state["linears"].items():
        modules[name].load_prepared([_unpack(p) for p in parts])
    shared = state["embed"]["layout"] == "lm_head"
    model.embed_quantized = model.lm_head.parts[0] if shared else _unpack(state["embed"])
    model.load_state_dict(state["parameters"], strict=False)
    eos = config.eos_token_ids[0] if config.eos_token_ids else None
    return model.eval(), Tokenizer.from_directory(directory, config.bos_token_id, eos)


def load(directory: Path) -> tuple[LlamaModel, Tokenizer] | None:
    """The model saved by `save`, or None when there is none, it is damaged or it does not load.
    Nothing read is returned before the checksums have been found right."""
    if not (directory / MODEL_FILE).is_file():
        return None
    damaged = damaged_later([directory / name for name in (MODEL_FILE, *TOKENIZER_FILES)])
    failure = None  # the message only: the exception's traceback would hold what _read had read
    try:
        loaded = _read(directory)
    # A damaged or foreign file: whatever torch, safetensors, the config or the tokenizer raises.
    except Exception as error:  # noqa: BLE001
        loaded, failure = None, str(error)
    names = [path.name for path in damaged()]
    if names:
        _log.warning("verispec: the cached quantized model in %s is damaged (%s: not the bytes written); "
                     "preparing it again", directory, ", ".join(names))
        return None
    if failure is not None:
        _log.warning("verispec: ignoring the cached quantized model in %s (%s)", directory, failure)
    return loaded
