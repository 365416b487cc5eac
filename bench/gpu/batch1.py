"""Batch 1, greedy, a fixed number of new tokens: verispec (no drafter, with its steps replayed
as CUDA graphs and with enforce_eager, and an n-gram drafter that finds nothing on random
weights) against Hugging Face generate, eager and with a static cache, which generate itself
compiles with torch.compile(mode="reduce-overhead") on a GPU (the stock anchor of issue 42; a
forward compiled by hand beside it breaks on the cache's in-place updates), and the weight-bytes
floor of one decode step (weights / copy bandwidth measured in the same run). A system that
fails is reported and left out; the others still run.

Every system runs once untimed (compiles, allocations), then the timed rounds alternate the
systems, and each keeps its fastest round: a system timed first never pays another's warm-up.

    python bench/gpu/batch1.py --model /tmp/ckpt-1b --device cuda --dtype bfloat16
    python bench/gpu/batch1.py --model /tmp/ckpt-tiny --tokens 8 --rounds 1   # a CPU dry run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, CompileConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import copy_bandwidth, write_json  # noqa: E402

from verispec import LLM, SamplingParams  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def timed(fn, device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a checkpoint directory (bench/gpu/make_checkpoint.py)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("-k", type=int, default=5, help="n-gram draft tokens")
    parser.add_argument("--no-compile", action="store_true", help="leave out HF's compiled static-cache row")
    parser.add_argument("--json", type=Path, default=Path("bench/results/batch1.json"))
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    common = dict(dtype=args.dtype, device=args.device, kv_cache_gib=1.0, max_num_seqs=1, progress=False)
    plain = LLM(args.model, draft="none", **common)
    unreplayed = LLM(args.model, draft="none", enforce_eager=True, **common)
    ngram = LLM(args.model, draft="ngram", num_speculative_tokens=args.k, **common)
    prompt = plain.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

    def ours(llm: LLM):
        return lambda: llm.generate([prompt], params, use_tqdm=False)[0].token_ids

    eager = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    ids = torch.tensor([prompt], device=device)

    def hf(model, **kwargs):
        def run():
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                                     pad_token_id=0, **kwargs)
            return out[0, ids.shape[1]:].tolist()
        return run

    systems = {"verispec": ours(plain), "verispec eager": ours(unreplayed), "verispec + n-gram": ours(ngram),
               "HF generate": hf(eager)}
    if not args.no_compile:
        systems["HF static + compile"] = hf(eager, cache_implementation="static",
                                            compile_config=CompileConfig(mode="reduce-overhead"))
    weight_bytes = sum(p.numel() * p.element_size() for p in eager.parameters())
    floor_s = weight_bytes / copy_bandwidth(device)
    tokens, best = {}, {name: float("inf") for name in systems}
    for name, fn in list(systems.items()):
        start = time.perf_counter()
        try:
            for _ in range(2 if name == "HF static + compile" else 1):  # a compile per new shape
                fn()
        except Exception as error:  # noqa: BLE001 - one broken peer must not cost the other rows
            print(f"{name} left out: {type(error).__name__}: {str(error)[:300]}", flush=True)
            del systems[name]
            continue
        print(f"warm {name}: {time.perf_counter() - start:.1f} s", flush=True)
    for _ in range(args.rounds):
        for name, fn in systems.items():
            tokens[name], seconds = timed(fn, device)
            best[name] = min(best[name], seconds)
    rows = []
    print(f"floor {floor_s * 1e3:.2f} ms a step ({1 / floor_s:.0f} tok/s), weights {weight_bytes / 2**30:.2f} GiB")
    for name in systems:
        rate = len(tokens[name]) / best[name]
        row = {"system": name, "tokens": len(tokens[name]), "seconds": best[name], "tok_per_s": rate,
               "of_floor": rate * floor_s, "same_as_hf": tokens[name] == tokens.get("HF generate")}
        rows.append(row)
        print(f"{name:<22} {rate:>9.1f} tok/s {row['of_floor']:>6.1%} of the floor  same as HF: {row['same_as_hf']}")
    write_json(args.json, device, rows, floor_s=floor_s, weight_bytes=weight_bytes, dtype=args.dtype,
               model=args.model)


if __name__ == "__main__":
    main()
