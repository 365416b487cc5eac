"""Chain vs tree speculation with a learned drafter (EAGLE by default) on the embedded model.

On the evaluation prompts (bench/prompts/spec_bench.jsonl), chat-rendered, fp32, batch 1, in
one process on the same weights: for chains of K drafts (verified token by token, and as a
block: SpeculativeConfig.verification="block") and for trees (SpeculativeConfig.tree:
static shapes and EAGLE-2 dynamic trees; top-k children when greedy, drawn without
replacement from q when sampled), greedy and temperature 0.7 (seeded; top-p `--top-p`, none by
default), the mean tokens emitted per verify step (accepted drafts + 1), the verify rows per
step (drafts + 1, the target's cost per step; both over steps with drafts, as vLLM counts
acceptance) and output tokens per second. Rows are printed by planned verify rows; a tree's
or block's "x chain" is its acceptance length over that of the token-verified chain with as
many rows (when one ran). Greedy rows also say whether the tokens equal those of decoding
without drafts (they must).

    python bench/trees.py                                   # 2 prompts per category, EAGLE
    python bench/trees.py --draft medusa --chains 2 4 --trees 2,1 3,2,1 dynamic:8,4,2
    python bench/trees.py --draft ngram+eagle --chains 4 15 --trees dynamic:15,4,8
    python bench/trees.py --draft ngram+eagle --chain-draft eagle --chains 15 --trees dynamic:15,4,4
    python bench/trees.py --top-p 0.9 --chains 15 --trees dynamic:15,4,8   # sampled rows at T = 0.7, top-p 0.9
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import Table, write_json
from drafters import load, run_batch1

from verispec import SamplingParams
from verispec.config import parse_tree, tree_size
from verispec.engine.llm import LLM


KV_GIB = 0.25


def engines(draft: str, chains: list[int], trees: list[str],
            chain_draft: str | None = None) -> tuple[dict[str, LLM], dict[str, int]]:
    """By label, with the verify rows each plans per step; adaptive K off, so that every step
    drafts the whole chain or tree; chains (and blocks) drafted by `chain_draft` (default:
    `draft`). Small KV caches (batch 1 needs a few thousand slots) keep a dozen engines in
    memory."""
    llms, planned = {"none": LLM(draft="none", kv_cache_gib=KV_GIB, progress=False)}, {"none": 1}
    for k in chains:
        for verification in ("token", "block"):
            name = f"{'chain' if verification == 'token' else 'block'} {k}"
            llms[name] = LLM(draft=chain_draft or draft, num_speculative_tokens=k, adaptive=False,
                             verification=verification,
                             kv_cache_gib=KV_GIB, progress=False)
            planned[name] = 1 + k
    for text in trees:
        tree = parse_tree(text)
        llms[f"tree {text}"] = LLM(draft=draft, tree=tree, adaptive=False, kv_cache_gib=KV_GIB, progress=False)
        planned[f"tree {text}"] = 1 + tree_size(tree)
    return llms, planned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--draft", default="eagle", help="'eagle' or 'medusa' (the shipped heads), a head file, "
                        "or one of them behind prompt lookup ('ngram+eagle', ...)")
    parser.add_argument("--chain-draft", default=None,
                        help="drafter of the chains and blocks, when it should differ from --draft (e.g. "
                             "EAGLE's chains against ngram+eagle's grafted trees)")
    parser.add_argument("--chains", type=int, nargs="+", default=[3, 4, 7], metavar="K")
    parser.add_argument("--trees", nargs="+", default=["3", "2,1", "4", "dynamic:4,4,2", "dynamic:7,4,3"],
                        metavar="B1,B2,...|dynamic:N,D,K")
    parser.add_argument("--top-p", type=float, default=1.0, help="top-p of the T = 0.7 rows (default 1: none)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path("bench/results/trees.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = load(args.per_category)
    llms, planned = engines(args.draft, args.chains, args.trees, args.chain_draft)
    chain_at = {rows: name for name, rows in planned.items() if name.startswith("chain")}
    print(f"{len(prompts)} prompts ({args.per_category} per category), max_tokens {args.max_tokens}, "
          f"{args.threads} threads, batch 1, drafter {args.draft}, sampled rows at T = 0.7, top-p {args.top_p}"
          + (f", chains and blocks by {args.chain_draft}" if args.chain_draft else ""))
    table = Table("mode", "drafts", "rows", "rows/step", "accept len", "x chain", "tok/s", "x none",
                  "same tokens as none")
    rows = []
    for mode, params in (("greedy", SamplingParams(temperature=0, max_tokens=args.max_tokens)),
                         ("T=0.7", SamplingParams(temperature=0.7, top_p=args.top_p, max_tokens=args.max_tokens))):
        results = run_batch1(llms, prompts, params)
        for name in sorted(llms, key=lambda n: (planned[n], n)):
            r = results[name]
            ratio = r["tok_s"] / results["none"]["tok_s"]
            same = r["outputs"] == results["none"]["outputs"] if mode == "greedy" else None
            chain = chain_at.get(planned[name]) if not name.startswith(("chain", "none")) else None
            vs_chain = r["mean_acceptance_length"] / results[chain]["mean_acceptance_length"] if chain else None
            table.row(mode, name, planned[name], r["rows_per_step"], r["mean_acceptance_length"],
                      "" if vs_chain is None else vs_chain, f"{r['tok_s']:.1f}", ratio, "" if same is None else same)
            rows.append({"mode": mode, "drafts": name, "planned_rows": planned[name], "speedup_vs_none": ratio,
                         "acceptance_vs_chain": vs_chain, "same_as_none": same,
                         **{k: v for k, v in r.items() if k != "outputs"}})
    write_json(args.json, torch.device("cpu"), rows, max_tokens=args.max_tokens, prompts=len(prompts),
               draft=args.draft, chain_draft=args.chain_draft or args.draft, top_p=args.top_p)


if __name__ == "__main__":
    main()
