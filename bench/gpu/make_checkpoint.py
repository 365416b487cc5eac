"""A random-weight checkpoint shaped like a real model, for timing on a machine that real weights
cannot reach (docs/benchmarks.md, "GPU").

Writes a Hugging Face directory that verispec's loader and transformers both read: config.json
and model.safetensors (hf_checkpoint.write_checkpoint) plus the tokenizer files of --tokenizer
(default: the embedded SmolLM2's converted directory). The vocabulary is the tokenizer's unless
--vocab asks for more rows (Llama 3's 128,256: the extra rows are never produced by the
tokenizer, only sampled). Weights are N(0, 0.02), norms 1: the timing of a step does not depend
on the values, and random text never repeats, so an n-gram drafter finds nothing.

    python bench/gpu/make_checkpoint.py --shape llama-3.2-1b --out /tmp/ckpt-1b --device cuda
    python bench/gpu/make_checkpoint.py --shape tiny --out /tmp/ckpt-tiny     # CPU dry runs
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from verispec.model.config import ModelConfig, RopeScaling
from verispec.model.hf_checkpoint import write_checkpoint
from verispec.model.loader import converted_checkpoint_dir
from verispec.model.tokenizer import Tokenizer

# Llama 3.1's rotary scaling; Llama 3.2 1B stretches it by 32 rather than 8.
_LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                         num_kv_heads=8, head_dim=64, rope_theta=500000.0, tie_word_embeddings=True,
                         max_position_embeddings=131072, rope_scaling=RopeScaling(factor=32.0, **_LLAMA3_ROPE)),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                         num_kv_heads=8, head_dim=128, rope_theta=500000.0, tie_word_embeddings=False,
                         max_position_embeddings=131072, rope_scaling=RopeScaling(factor=8.0, **_LLAMA3_ROPE)),
    # The 1B's structure (GQA 4:1, llama3 rope, tied) at a size the CPU runs in seconds.
    "tiny": dict(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=1,
                 head_dim=32, rope_theta=500000.0, tie_word_embeddings=True, max_position_embeddings=131072,
                 rope_scaling=RopeScaling(factor=32.0, **_LLAMA3_ROPE)),
}


def make_checkpoint(shape: str, out: Path, tokenizer_dir: Path, vocab: int | None, dtype: torch.dtype,
                    device: torch.device, seed: int) -> ModelConfig:
    tokenizer = Tokenizer.from_directory(tokenizer_dir)
    size = tokenizer.backend.get_vocab_size()
    if vocab is not None and vocab < size:
        raise ValueError(f"vocab={vocab} is smaller than the tokenizer's {size}")
    eos = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    config = ModelConfig(vocab_size=vocab or size, bos_token_id=tokenizer.bos_token_id, eos_token_ids=eos,
                         **SHAPES[shape])
    g = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, dims in config.weight_shapes():
        if len(dims) == 1:  # norm weights
            weights[name] = torch.ones(dims, dtype=dtype)
        else:
            weights[name] = (torch.randn(dims, device=device, generator=g) * 0.02).to(dtype).cpu()
    out.mkdir(parents=True, exist_ok=True)
    write_checkpoint(out, config, weights)
    for path in tokenizer_dir.iterdir():
        if path.name.startswith("tokenizer") or path.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(path, out / path.name)
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a directory with tokenizer.json (default: the embedded model's)")
    parser.add_argument("--vocab", type=int, default=None, help="rows of the embedding (default: the tokenizer's)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cpu", help="where the random numbers are drawn (cuda: fast)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tokenizer = args.tokenizer or converted_checkpoint_dir()
    config = make_checkpoint(args.shape, args.out, tokenizer, args.vocab, getattr(torch, args.dtype),
                             torch.device(args.device), args.seed)
    params = sum(torch.Size(s).numel() for _, s in config.weight_shapes())
    print(f"wrote {args.out}: {args.shape}, vocab {config.vocab_size}, {params / 1e9:.2f} B parameters")


if __name__ == "__main__":
    main()
