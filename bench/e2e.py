"""End to end on the embedded default model (or --model): verispec against Hugging Face
transformers.

Side by side in one process, on the same weights (the dequantized SmolLM2-135M-Instruct, or the
--model checkpoint directory or GGUF file of any supported family, docs/models.md) and the
same prompts, greedy, for each dtype:
- batch 1, a copy-heavy prompt and an open-ended one: HF `generate`, HF prompt-lookup assisted
  generation, verispec without speculation, verispec with the n-gram drafter;
- batch 1, sampled (temperature 0.8, top-k 50, top-p 0.9) on the open prompt, fixed length:
  HF `generate`, verispec without and with the n-gram drafter;
- batch 16 (and --batch sizes) aggregate throughput: HF `generate` (left-padded batch),
  verispec without and with the n-gram drafter.
Also printed: the weight-bytes floor of one decode step (model bytes / copy bandwidth measured in
the same run) and whether each greedy output equals HF's token for token.

    python bench/e2e.py                       # fp32 and bf16, 2 threads
    python bench/e2e.py --dtype float32 --max-tokens 64
    python bench/e2e.py --model path/to/Qwen2.5-0.5B-Instruct --dtype float32
    python bench/e2e.py --device cuda --dtype bfloat16 --batch 16 64   # on a GPU
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from common import Table, copy_bandwidth, write_json
from transformers import AutoModelForCausalLM

from verispec import SamplingParams
from verispec.engine.llm import LLM, resolve_dtype
from verispec.model.linear import cpu_has_bf16_arithmetic
from verispec.model.loader import converted_checkpoint_dir

COPY_TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow. "
    "The five boxing wizards jump quickly. Jackdaws love my big sphinx of quartz."
)
PROMPTS = {
    "copy": f"Repeat the following text exactly, word for word:\n\n{COPY_TEXT}",
    "open": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
# Sampled rows: a common setting whose filters need the top of each sorted row.
SAMPLED = dict(temperature=0.8, top_k=50, top_p=0.9)
# Batches are distinct prompts (prefix caching would share identical ones): topic x style.
BATCH_STYLES = ["Write three sentences about {}.", "Describe {} to a child.", "List four facts about {}.",
                "Write a short poem about {}."]
BATCH_TOPICS = [
    "the ocean", "volcanoes", "bees", "the moon", "chess", "bread", "rivers", "owls",
    "glaciers", "trains", "tea", "deserts", "whales", "clocks", "maps", "rain",
]


def chat(llm: LLM, text: str) -> list[int]:
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return llm.tokenizer.encode(rendered)


def timed(fn):
    """fn's result and wall seconds, the GPU's queued work included."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def hf_generate(model, prompts: list[list[int]], max_tokens: int, **kwargs) -> tuple[list[list[int]], float]:
    """Greedy unless kwargs say otherwise, left-padded; returns generated ids (up to and
    including EOS) and seconds."""
    kwargs.setdefault("do_sample", False)
    width = max(len(p) for p in prompts)
    pad = model.generation_config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad
    if pad is None:  # a checkpoint without EOS: any id pads, the mask hides it
        pad = model.generation_config.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    with torch.inference_mode():
        out, seconds = timed(lambda: model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
            pad_token_id=pad, **kwargs,
        ))
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    results = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        results.append(row[:cut])
    return results, seconds


def ours(llm: LLM, prompts: list[list[int]], max_tokens: int, fixed_length: bool = False,
         sampled: bool = False) -> tuple[list[list[int]], float, float]:
    mode = dict(SAMPLED, seed=0) if sampled else dict(temperature=0)
    params = SamplingParams(**mode, max_tokens=max_tokens, ignore_eos=fixed_length)
    outs, seconds = timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    stats = [o.stats for o in outs]
    drafted = sum(s.num_draft_tokens for s in stats)
    acceptance = sum(s.num_accepted_tokens for s in stats) / drafted if drafted else 0.0
    return [o.token_ids for o in outs], seconds, acceptance


def run_dtype(dtype_name: str, max_tokens: int, k: int, bandwidth: float, model: str | None,
              device: str, batches: list[int]) -> list[dict]:
    dtype = resolve_dtype(dtype_name)
    # The KV cache for the largest batch: ~40 prompt + max_tokens (+ K drafts) tokens each.
    kv_gib = 0.25 if device == "cpu" else 2.0
    common = dict(dtype=dtype, device=device, kv_cache_gib=kv_gib, max_num_seqs=max(batches + [1]),
                  progress=False)
    plain = LLM(model, draft="none", **common)
    ngram = LLM(model, draft="ngram", num_speculative_tokens=k, **common)
    # transformers reads a GGUF file (and the embedded default) as verispec's converted directory.
    directory = converted_checkpoint_dir(model) if model is None or model.endswith(".gguf") else model
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    floor_s = weight_bytes / bandwidth
    print(f"\n== {dtype_name}: weights {weight_bytes / 2**20:.0f} MiB, decode-step floor {floor_s * 1e3:.1f} ms "
          f"({1 / floor_s:.0f} tok/s at batch 1)")
    # One-time costs (cuBLAS handles, Triton compiles, the drafters' and filters' first calls)
    # before any timed row: every path below runs once here.
    warm = chat(plain, "Hi")
    hf_generate(hf, [warm], 4)
    hf_generate(hf, [warm], 4, prompt_lookup_num_tokens=k)
    hf_generate(hf, [warm], 4, do_sample=True, **SAMPLED)
    for llm in (plain, ngram):
        ours(llm, [warm], 4)
        ours(llm, [warm], 4, sampled=True)
    rows = []
    table = Table("prompt", "system", "tokens", "tok/s", "vs HF", "vs HF-PL", "accept", "same as HF", digits=1)
    for name, text in PROMPTS.items():
        prompt = chat(plain, text)
        (hf_ids,), hf_s = hf_generate(hf, [prompt], max_tokens)
        (pl_ids,), pl_s = hf_generate(hf, [prompt], max_tokens, prompt_lookup_num_tokens=k)
        (plain_ids,), plain_s, _ = ours(plain, [prompt], max_tokens)
        (ng_ids,), ng_s, acceptance = ours(ngram, [prompt], max_tokens)
        entries = [
            ("HF generate", hf_ids, hf_s, None),
            ("HF prompt lookup", pl_ids, pl_s, None),
            ("verispec", plain_ids, plain_s, None),
            ("verispec + n-gram", ng_ids, ng_s, acceptance),
        ]
        hf_rate = len(hf_ids) / hf_s
        pl_rate = len(pl_ids) / pl_s
        for system, ids, seconds, acc in entries:
            rate = len(ids) / seconds
            row = {"dtype": dtype_name, "prompt": name, "batch": 1, "system": system, "tokens": len(ids),
                   "seconds": seconds, "tok_per_s": rate, "vs_hf": rate / hf_rate, "vs_hf_prompt_lookup": rate / pl_rate,
                   "acceptance": acc, "same_as_hf": ids == hf_ids, "floor_tok_per_s": 1 / floor_s}
            rows.append(row)
            table.row(name, system, len(ids), rate, f"{rate / hf_rate:.2f}x", f"{rate / pl_rate:.2f}x",
                      "" if acc is None else f"{acc:.2f}", ids == hf_ids)
    # Sampled, fixed length (EOS ignored): the cost of the filters in every step.
    prompt = chat(plain, PROMPTS["open"])
    (hf_ids,), hf_s = hf_generate(hf, [prompt], max_tokens, do_sample=True, min_new_tokens=max_tokens, **SAMPLED)
    hf_rate = len(hf_ids) / hf_s
    entries = [("HF generate", hf_ids, hf_s, None)]
    for system, llm in (("verispec", plain), ("verispec + n-gram", ngram)):
        (ids,), seconds, acc = ours(llm, [prompt], max_tokens, fixed_length=True, sampled=True)
        entries.append((system, ids, seconds, acc if llm is ngram else None))
    for system, ids, seconds, acc in entries:
        rate = len(ids) / seconds
        rows.append({"dtype": dtype_name, "prompt": "open, sampled", "batch": 1, "system": system,
                     "tokens": len(ids), "seconds": seconds, "tok_per_s": rate, "vs_hf": rate / hf_rate,
                     "acceptance": acc, "sampling": SAMPLED})
        table.row("sample", system, len(ids), rate, f"{rate / hf_rate:.2f}x", "", "" if acc is None else f"{acc:.2f}",
                  "")
    # Throughput: every request generates exactly max_tokens (EOS ignored), as throughput
    # benchmarks usually fix output lengths, so no system is measured on a lone straggler.
    texts = [style.format(topic) for style in BATCH_STYLES for topic in BATCH_TOPICS]
    (first,), first_s, _ = ours(plain, [chat(plain, texts[0])], max_tokens, fixed_length=True)
    single = len(first) / first_s
    for batch in batches:
        prompts = [chat(plain, text) for text in texts[:batch]]
        hf_out, hf_s = hf_generate(hf, prompts, max_tokens, min_new_tokens=max_tokens)
        for system, (ids, seconds) in (
            ("HF generate", (hf_out, hf_s)),
            ("verispec", ours(plain, prompts, max_tokens, fixed_length=True)[:2]),
            ("verispec + n-gram", ours(ngram, prompts, max_tokens, fixed_length=True)[:2]),
        ):
            total = sum(len(x) for x in ids)
            rate = total / seconds
            rows.append({"dtype": dtype_name, "prompt": f"{batch} topics", "batch": batch, "system": system,
                         "tokens": total, "seconds": seconds, "tok_per_s": rate,
                         "vs_hf": rate / (sum(len(x) for x in hf_out) / hf_s), "vs_own_batch1": rate / single})
            table.row(f"b={batch}", system, total, rate, f"{rows[-1]['vs_hf']:.2f}x", "", "",
                      f"({rate / single:.1f}x our batch-1 tok/s, first prompt alone)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("-k", type=int, default=5, help="draft tokens per step, ours and HF prompt lookup")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--batch", type=int, nargs="+", default=[16], choices=range(2, 65), metavar="N",
                        help="batch sizes of the throughput rows, 2..64 (default: 16)")
    parser.add_argument("--json", type=Path, default=Path("bench/results/e2e.json"))
    parser.add_argument("--model", default=None,
                        help="a checkpoint directory or .gguf file (default: the embedded SmolLM2-135M)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device)
    capability = torch.backends.cpu.get_cpu_capability()
    bf16_arithmetic = cpu_has_bf16_arithmetic()
    where = (torch.cuda.get_device_name(device) if device.type == "cuda" else
             f"cpu={capability} bf16 arithmetic="
             f"{'yes' if bf16_arithmetic else 'no (bf16 products of 2+ rows widened to fp32)'}")
    print(f"threads={args.threads} copy bandwidth={bandwidth / 1e9:.1f} GB/s {where}")
    rows = [dict(row, model=args.model or "embedded SmolLM2-135M-Instruct")
            for dtype in args.dtype
            for row in run_dtype(dtype, args.max_tokens, args.k, bandwidth, args.model, args.device, args.batch)]
    write_json(args.json, device, rows, copy_bandwidth_bytes_per_s=bandwidth,
               cpu_capability=capability, cpu_bf16_arithmetic=bf16_arithmetic)

if __name__ == "__main__":
    main()
