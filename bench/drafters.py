"""Drafters side by side on the embedded model: none / n-gram / Medusa / EAGLE, and each head
behind prompt lookup (ngram+medusa / ngram+eagle: spec_decode/hybrid.py).

On the evaluation prompts (bench/prompts/spec_bench.jsonl: conversation, translation,
summarization, qa, math, rag; never trained on), chat-rendered, fp32, in one process on the
same weights:
- batch 1, greedy and temperature 0.7 (seeded): for each drafter, mean tokens emitted per
  verify step (accepted drafts + 1) and output tokens per second over the whole set, with the
  ratio to no speculation; per category too (JSON);
- batch 16 (every prompt at once, in batches of 16), greedy: aggregate output tok/s, with the
  engine's adaptive K (for trees: its tree-or-nothing gate), whose job is never to make
  speculation slower than none;
- with --adaptive-batch1, batch 1 greedy with the adaptive K too;
- with --trees, Medusa and EAGLE also draft those trees (spec_decode/trees.py) in every run;
- with --heads NAME=FILE, more head files run beside the shipped heads (e.g. an older head,
  or one just trained), named NAME in the table;
- with --control, a second engine without drafts ("none control") runs beside the first: its
  ratio to none is the run's noise floor (on a shared 2-core machine, batch-16 ratios of two
  identical engines have been seen 15-20% apart).
Batch-1 rows use a fixed K (adaptive K off) so that acceptance is measured at that K. Engines
take turns prompt by prompt (batch by batch), so drift in the machine's speed hits all alike.

    python bench/drafters.py                        # 2 prompts per category, K = 4
    python bench/drafters.py --per-category 10 --max-tokens 128
    python bench/drafters.py --threads 1 --adaptive-batch1
    python bench/drafters.py --trees 3 4,1    # learned drafters with trees beside their chains
    python bench/drafters.py --heads old=eagle-old.safetensors
    python bench/drafters.py --drafters ngram eagle ngram+eagle
    python bench/drafters.py --classes --max-tokens 128 --k-scan 0 1 2 3 4 5   # issue 46's table
    python bench/drafters.py --classes --control   # with the noise floor: a second engine without drafts
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from common import Table, write_json

from verispec import SamplingParams
from verispec.config import parse_tree
from verispec.engine.llm import LLM
from verispec.spec_decode.metrics import SpecDecodeStats

PROMPTS = Path(__file__).parent / "prompts" / "spec_bench.jsonl"
CLASSES = Path(__file__).parent / "prompts" / "classes.jsonl"
DRAFTERS = ("none", "ngram", "medusa", "eagle", "ngram+medusa", "ngram+eagle")
CLASS_DRAFTERS = ["none", "ngram", "eagle", "ngram+eagle"]  # --classes without --drafters
KV_GIB = 0.5  # per tree engine: enough for 16 requests, and a dozen engines fit in memory


def load(per_category: int, path: Path = PROMPTS) -> list[dict[str, str]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    taken: dict[str, int] = defaultdict(int)
    chosen = []
    for row in rows:
        if taken[row["category"]] < per_category:
            taken[row["category"]] += 1
            chosen.append(row)
    return chosen


def engines(drafters: list[str], k: int, adaptive: bool, trees: list[str], heads: dict[str, str],
            control: bool) -> dict[str, LLM]:
    """One engine per drafter and per extra head file (and the control), and per tree shape one
    per learned drafter ("eagle tree 3")."""
    drafts = {name: name for name in drafters} | heads | ({"none control": "none"} if control else {})
    llms = {name: LLM(draft=draft, num_speculative_tokens=k, adaptive=adaptive, progress=False)
            for name, draft in drafts.items()}
    for text in trees:
        for name in [d for d in drafters if d.endswith(("medusa", "eagle"))]:
            llms[f"{name} tree {text}"] = LLM(draft=name, tree=parse_tree(text), adaptive=adaptive,
                                              kv_cache_gib=KV_GIB, progress=False)
    return llms


def chat_ids(llm: LLM, text: str) -> list[int]:
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return llm.tokenizer.encode(rendered, add_special_tokens=False)


def run_batch1(llms: dict[str, LLM], prompts: list[dict[str, str]], params: SamplingParams,
               seeded: bool = True) -> dict[str, dict]:
    """Prompt by prompt, every engine in turn (so drift in the machine's speed hits all alike).
    rows_per_step: verify rows per step with drafts (drafts + 1), as vLLM counts acceptance.
    seeded: sampled requests carry a seed (their K then comes from the declared costs,
    SpeculativeConfig.learn_costs); unseeded ones are priced with the learned costs."""
    stats = {name: defaultdict(SpecDecodeStats) for name in llms}
    tokens = dict.fromkeys(llms, 0)
    seconds = dict.fromkeys(llms, 0.0)
    by_class = {name: defaultdict(lambda: [0, 0.0]) for name in llms}  # category -> [tokens, seconds]
    outputs: dict[str, list[list[int]]] = {name: [] for name in llms}
    for i, row in enumerate(prompts):
        p = dataclasses.replace(params, seed=i) if params.temperature > 0 and seeded else params
        for name, llm in llms.items():
            ids = chat_ids(llm, row["prompt"])
            start = time.perf_counter()
            out = llm.generate(ids, p, use_tqdm=False)[0]
            elapsed = time.perf_counter() - start
            seconds[name] += elapsed
            tokens[name] += len(out.token_ids)
            by_class[name][row["category"]][0] += len(out.token_ids)
            by_class[name][row["category"]][1] += elapsed
            stats[name][row["category"]].merge(out.stats)
            outputs[name].append(out.token_ids)
    results = {}
    for name in llms:
        total = SpecDecodeStats()
        for s in stats[name].values():
            total.merge(s)
        results[name] = {"tokens": tokens[name], "seconds": seconds[name], "tok_s": tokens[name] / seconds[name],
                         "mean_acceptance_length": total.mean_acceptance_length,
                         "rows_per_step": 1 + total.num_draft_tokens / max(1, total.num_drafts),
                         "per_position_acceptance": total.per_position_acceptance,
                         "per_category": {c: s.mean_acceptance_length for c, s in stats[name].items()},
                         "per_category_tok_s": {c: n / t for c, (n, t) in by_class[name].items()},
                         "per_category_acceptance": {c: s.acceptance_rate for c, s in stats[name].items()},
                         "per_category_tokens_per_step": {c: s.num_emitted_tokens / max(1, s.num_steps)
                                                          for c, s in stats[name].items()},
                         "outputs": outputs[name]}
    return results


def run_batches(llms: dict[str, LLM], prompts: list[dict[str, str]], params: SamplingParams,
                batch: int) -> dict[str, dict]:
    """The prompts in batches of `batch`, every engine in turn on each batch."""
    tokens = dict.fromkeys(llms, 0)
    seconds = dict.fromkeys(llms, 0.0)
    stats = {name: SpecDecodeStats() for name in llms}
    for start_index in range(0, len(prompts), batch):
        for name, llm in llms.items():
            ids = [chat_ids(llm, row["prompt"]) for row in prompts[start_index : start_index + batch]]
            start = time.perf_counter()
            outs = llm.generate(ids, params, use_tqdm=False)
            seconds[name] += time.perf_counter() - start
            tokens[name] += sum(len(o.token_ids) for o in outs)
            for o in outs:
                stats[name].merge(o.stats)
    return {name: {"tokens": tokens[name], "seconds": seconds[name], "tok_s": tokens[name] / seconds[name],
                   "mean_acceptance_length": stats[name].mean_acceptance_length,
                   "rows_per_step": 1 + stats[name].num_draft_tokens / max(1, stats[name].num_drafts)}
            for name in llms}


def run_classes(drafters: list[str], repeats: int, max_tokens: int, batch: int, k_scan: list[int],
                control: bool = False) -> list[dict]:
    """The prompt classes (bench/prompts/classes.jsonl: copy-heavy, code edit, open, summary) on
    each drafter's default engine (the default 4-bit target, adaptive K): batch 1 greedy and
    sampled (T 0.8, top-k 50, top-p 0.9, unseeded and seeded), then every prompt at once
    (`batch` requests, `repeats` rounds), greedy and sampled; with k_scan, batch 1 greedy at each
    fixed K; with control, a second engine without drafts in every row ("none control": how far
    apart two identical engines read in this run, the noise any cell's ratio carries)."""
    prompts = load(10**6, CLASSES) * repeats
    drafts = {name: name for name in drafters} | ({"none control": "none"} if control else {})
    llms = {name: LLM(draft=draft, progress=False) for name, draft in drafts.items()}
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    sampled = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_tokens=max_tokens)
    for llm in llms.values():  # one prompt each first: the caches filled, the costs learned from this machine
        llm.generate([chat_ids(llm, row["prompt"]) for row in prompts[:2]], greedy, use_tqdm=False)
    rows = []
    classes = list(dict.fromkeys(row["category"] for row in prompts))
    table = Table("mode", "drafter", *classes, "all")  # cells: tok/s, x none, tokens per step
    for mode, params, seeded in (("greedy", greedy, False), ("sampled", sampled, False),
                                 ("sampled, seeded", sampled, True)):
        results = run_batch1(llms, prompts, params, seeded)
        for name, r in results.items():
            none = results["none"]
            table.row(f"b1 {mode}", name, *(f"{r['per_category_tok_s'][c]:.1f} "
                                            f"{r['per_category_tok_s'][c] / none['per_category_tok_s'][c]:.2f}x "
                                            f"{r['per_category_tokens_per_step'][c]:.2f}" for c in classes),
                      f"{r['tok_s']:.1f} {r['tok_s'] / none['tok_s']:.2f}x")
            rows.append({"batch": 1, "mode": mode, "drafter": name, "speedup_vs_none": r["tok_s"] / none["tok_s"],
                         "per_category_speedup": {c: r["per_category_tok_s"][c] / none["per_category_tok_s"][c]
                                                  for c in classes},
                         **{key: v for key, v in r.items() if key != "outputs"}})
    # `repeats` rounds of the same batch, engines taking turns: one round alone is a single
    # timing, and batch-16 ratios of two identical engines have been seen 8 % apart.
    wide = (prompts * -(-batch // len(prompts)))[:batch] * repeats
    for mode, params in (("greedy", greedy), ("sampled", sampled)):
        results = run_batches(llms, wide, params, batch)
        for name, r in results.items():
            ratio = r["tok_s"] / results["none"]["tok_s"]
            table.row(f"b{batch} {mode}", name, *[""] * len(classes),
                      f"{r['tok_s']:.1f} {ratio:.2f}x {r['mean_acceptance_length']:.2f}")
            rows.append({"batch": batch, "mode": mode, "drafter": name, "speedup_vs_none": ratio, **r})
    del llms
    for name in [d for d in drafters if d != "none"] if k_scan else []:
        fixed = {f"{name} K={k}": LLM(draft=name if k else "none", num_speculative_tokens=k, adaptive=False,
                                       progress=False) for k in k_scan}
        for llm in fixed.values():
            llm.generate([chat_ids(llm, row["prompt"]) for row in prompts[:1]], greedy, use_tqdm=False)
        results = run_batch1(fixed, prompts, greedy)
        for (label, r), k in zip(results.items(), k_scan):
            table.row("b1 greedy", label, *[""] * len(classes), f"{r['tok_s']:.1f} {r['mean_acceptance_length']:.2f}")
            rows.append({"batch": 1, "mode": "greedy", "drafter": name, "k": k, "scan": True,
                         **{key: v for key, v in r.items() if key != "outputs"}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafters", nargs="+", default=list(DRAFTERS), choices=DRAFTERS,
                        help="which drafters run ('none' always does)")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--adaptive-batch1", action="store_true", help="also batch 1 greedy with the adaptive K")
    parser.add_argument("--adaptive-only", action="store_true", help="skip the fixed-K batch-1 rows")
    parser.add_argument("--trees", nargs="*", default=[], metavar="B1,B2,...|dynamic:N,D,K",
                        help="also Medusa and EAGLE with these draft trees (K does not apply to them)")
    parser.add_argument("--heads", nargs="*", default=[], metavar="NAME=FILE",
                        help="more head files, run beside the shipped heads under NAME")
    parser.add_argument("--control", action="store_true", help="a second engine without drafts, as a noise floor")
    parser.add_argument("--classes", action="store_true",
                        help="the prompt classes on each drafter's default engine (run_classes); "
                             "--drafters, --max-tokens, --batch, --repeats, --k-scan and --control apply")
    parser.add_argument("--repeats", type=int, default=2, help="with --classes: passes over the prompts")
    parser.add_argument("--k-scan", type=int, nargs="*", default=[], metavar="K",
                        help="with --classes: also batch 1 greedy at each of these fixed K")
    parser.add_argument("--json", type=Path, default=Path("bench/results/drafters.json"))
    args = parser.parse_args()
    if args.classes:
        torch.set_num_threads(args.threads)
        chosen = CLASS_DRAFTERS if args.drafters == list(DRAFTERS) else args.drafters
        drafters = ["none", *(d for d in chosen if d != "none")]
        rows = run_classes(drafters, args.repeats, args.max_tokens, args.batch, args.k_scan, args.control)
        write_json(args.json, torch.device("cpu"), rows, max_tokens=args.max_tokens, repeats=args.repeats,
                   prompts=str(CLASSES.name))
        return
    heads = dict(item.split("=", 1) for item in args.heads if "=" in item)
    drafters = ["none", *(d for d in args.drafters if d != "none")]
    if len(heads) != len(args.heads) or set(heads) & set(DRAFTERS):
        parser.error(f"--heads takes NAME=FILE with a NAME other than {DRAFTERS}, got {args.heads}")
    torch.set_num_threads(args.threads)
    prompts = load(args.per_category)
    rows = []
    print(f"{len(prompts)} prompts ({args.per_category} per category), max_tokens {args.max_tokens}, K = {args.k}, "
          f"{args.threads} threads")
    table = Table("batch", "mode", "K", "drafter", "tok/s", "x none", "accept len", "rows/step", "same tokens as none")

    def report(batch: int, mode: str, k: str, results: dict[str, dict]) -> None:
        for name, r in results.items():
            ratio = r["tok_s"] / results["none"]["tok_s"]
            same = r["outputs"] == results["none"]["outputs"] if mode == "greedy" and "outputs" in r else None
            table.row(batch, mode, k, name, f"{r['tok_s']:.1f}", ratio, r["mean_acceptance_length"], r["rows_per_step"],
                      "" if same is None else same)
            rows.append({"batch": batch, "mode": mode, "k": k, "drafter": name, "speedup_vs_none": ratio,
                         "same_as_none": same, **{key: v for key, v in r.items() if key != "outputs"}})

    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    if not args.adaptive_only:
        fixed = engines(drafters, args.k, adaptive=False, trees=args.trees, heads=heads, control=args.control)
        for mode, params in (("greedy", greedy), ("T=0.7", SamplingParams(temperature=0.7, max_tokens=args.max_tokens))):
            report(1, mode, str(args.k), run_batch1(fixed, prompts, params))
        del fixed
    adaptive = engines(drafters, args.k, adaptive=True, trees=args.trees, heads=heads, control=args.control)
    if args.adaptive_batch1:
        report(1, "greedy", "adaptive", run_batch1(adaptive, prompts, greedy))
    report(args.batch, "greedy", "adaptive", run_batches(adaptive, prompts, greedy, args.batch))
    write_json(args.json, torch.device("cpu"), rows, k=args.k, max_tokens=args.max_tokens,
               prompts=len(prompts))


if __name__ == "__main__":
    main()
