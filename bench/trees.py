"""Chain vs tree speculation with the Medusa heads on the embedded model.

On the evaluation prompts (bench/prompts/spec_bench.jsonl), chat-rendered, fp32, batch 1, in
one process on the same weights: for chains of K drafts (the heads draft at most one token per
head) and for static trees (SpeculativeConfig.tree, Medusa top-k expansion), greedy and
temperature 0.7 (seeded), the mean tokens emitted per verify step (accepted drafts + 1), the
verify rows per step (drafts + 1, the target's cost per step; both over steps with drafts, as
vLLM counts acceptance) and output tokens per second. Rows are printed by verify rows, so chains and trees compare at equal rows; a tree whose
first branch is the chain of the same depth never accepts less than it. Greedy rows also say
whether the tokens equal those of decoding without drafts (they must).

    python bench/trees.py                                   # 2 prompts per category
    python bench/trees.py --per-category 10 --max-tokens 128 --trees 2,1 3,1 2,2,1 3,2,1
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import write_json
from drafters import load, run_batch1

from verispec import SamplingParams
from verispec.config import tree_size
from verispec.engine.llm import LLM


def shape(text: str) -> tuple[int, ...]:
    return tuple(int(b) for b in text.split(","))


def engines(draft: str, chains: list[int], trees: list[tuple[int, ...]]) -> dict[str, LLM]:
    """By label; adaptive K off, so that every step drafts the whole chain or tree."""
    llms = {"none": LLM(draft="none", progress=False)}
    for k in chains:
        llms[f"chain {k}"] = LLM(draft=draft, num_speculative_tokens=k, adaptive=False, progress=False)
    for tree in trees:
        llms[f"tree {','.join(map(str, tree))}"] = LLM(draft=draft, tree=tree, progress=False)
    return llms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--draft", default="medusa", help="'medusa' (the shipped heads) or a Medusa head file")
    parser.add_argument("--chains", type=int, nargs="+", default=[1, 2, 3, 4], metavar="K")
    parser.add_argument("--trees", type=shape, nargs="+", default=[(2, 1), (3, 1), (2, 2, 1), (3, 2, 1)],
                        metavar="B1,B2,...")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path("bench/results/trees.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = load(args.per_category)
    llms = engines(args.draft, args.chains, args.trees)
    planned = {name: 1 + (0 if name == "none" else int(name.split()[1]) if name.startswith("chain")
                          else tree_size(shape(name.split()[1]))) for name in llms}
    print(f"{len(prompts)} prompts ({args.per_category} per category), max_tokens {args.max_tokens}, "
          f"{args.threads} threads, batch 1, Medusa heads")
    print(f"{'mode':>7} {'drafts':>10} {'rows':>5} {'rows/step':>9} {'accept len':>10} {'tok/s':>7} {'x none':>6}")
    rows = []
    for mode, params in (("greedy", SamplingParams(temperature=0, max_tokens=args.max_tokens)),
                         ("T=0.7", SamplingParams(temperature=0.7, max_tokens=args.max_tokens))):
        results = run_batch1(llms, prompts, params)
        for name in sorted(llms, key=lambda n: (planned[n], n)):
            r = results[name]
            ratio = r["tok_s"] / results["none"]["tok_s"]
            same = r["outputs"] == results["none"]["outputs"] if mode == "greedy" else None
            print(f"{mode:>7} {name:>10} {planned[name]:5d} {r['rows_per_step']:9.2f} "
                  f"{r['mean_acceptance_length']:10.2f} {r['tok_s']:7.1f} {ratio:6.2f}"
                  + ("" if same is None else f"   same tokens as none: {same}"))
            rows.append({"mode": mode, "drafts": name, "planned_rows": planned[name], "speedup_vs_none": ratio,
                         "same_as_none": same, **{k: v for k, v in r.items() if k != "outputs"}})
    write_json(args.json, torch.device("cpu"), rows, max_tokens=args.max_tokens, prompts=len(prompts))


if __name__ == "__main__":
    main()
