"""The cost of classifier-free guidance, on the embedded default model, greedy.

Side by side in one run: verispec without CFG and with CFG (gamma = 1.5, negative prompt), at
batch 1 and batch 16, without and with n-gram speculation; and, at batch 1, Hugging Face
`generate` with its unbatched CFG processor (the only CFG it offers for decoder-only models;
it cannot be combined with assisted generation).

    python bench/cfg.py
    python bench/cfg.py --dtype bfloat16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from common import Table, write_json
from transformers import AutoModelForCausalLM

from verispec import SamplingParams
from verispec.engine.llm import LLM, resolve_dtype
from verispec.model.loader import converted_checkpoint_dir

NEGATIVE = "Answer rudely and briefly."
TOPICS = [
    "the ocean", "volcanoes", "bees", "the moon", "chess", "bread", "rivers", "owls",
    "glaciers", "trains", "tea", "deserts", "whales", "clocks", "maps", "rain",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--scale", type=float, default=1.5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path("bench/results/cfg.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype)
    engines = {
        "verispec": LLM(draft="none", dtype=dtype, kv_cache_gib=0.25, progress=False),
        "verispec + n-gram": LLM(draft="ngram", dtype=dtype, kv_cache_gib=0.25, progress=False),
    }
    tok = engines["verispec"].tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Tell me about {t}."}]) for t in TOPICS]
    negative = tok.apply_chat_template([{"role": "user", "content": NEGATIVE}])
    rows = []
    table = Table("system", "batch", "CFG", "tokens", "tok/s", "CFG cost", digits=1)
    for name, llm in engines.items():
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        for batch in (1, 16):
            rates = {}
            for scale in (1.0, args.scale):
                params = SamplingParams(temperature=0, max_tokens=args.max_tokens, guidance_scale=scale,
                                        negative_prompt=negative if scale != 1 else None)
                start = time.perf_counter()
                outs = llm.generate(prompts[:batch], params, use_tqdm=False)
                seconds = time.perf_counter() - start
                tokens = sum(len(o.token_ids) for o in outs)
                rates[scale] = tokens / seconds
                cost = rates[1.0] / rates[scale]
                rows.append({"system": name, "batch": batch, "guidance_scale": scale, "tokens": tokens,
                             "seconds": seconds, "tok_per_s": rates[scale], "slowdown_vs_no_cfg": cost})
                table.row(name, batch, scale, tokens, rates[scale], f"{cost:.2f}x")
    hf = AutoModelForCausalLM.from_pretrained(converted_checkpoint_dir(), dtype=dtype).eval()
    ids = torch.tensor([tok.encode(prompts[0])])
    neg = torch.tensor([tok.encode(negative)])
    rates = {}
    for scale in (1.0, args.scale):
        extra = {"guidance_scale": scale, "negative_prompt_ids": neg} if scale != 1 else {}
        with torch.inference_mode():
            start = time.perf_counter()
            out = hf.generate(ids, do_sample=False, max_new_tokens=args.max_tokens, **extra)
            seconds = time.perf_counter() - start
        tokens = out.shape[1] - ids.shape[1]
        rates[scale] = tokens / seconds
        rows.append({"system": "HF generate", "batch": 1, "guidance_scale": scale, "tokens": tokens,
                     "seconds": seconds, "tok_per_s": rates[scale], "slowdown_vs_no_cfg": rates[1.0] / rates[scale]})
        table.row("HF generate", 1, scale, tokens, rates[scale], f"{rates[1.0] / rates[scale]:.2f}x")
    write_json(args.json, torch.device("cpu"), rows, dtype=args.dtype)


if __name__ == "__main__":
    main()
