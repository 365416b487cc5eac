"""Did EAGLE's compiled-call price and head prior (2026-11-28) help? Both variants side by side.

For each drafter named (comma-separated, default ngram+eagle,eagle) two engines of the default
4-bit target run beside one without drafts, prompt by prompt (bench/drafters.py run_batch1), on
the class prompts twice, greedy then sampled (T 0.8, top-k 50, top-p 0.9, unseeded): "new" as
shipped, and "old" with what came before, EAGLE's pass-by-pass price (DraftCost(0.25, 0.05,
0.18, 0.045)) and the adaptive K's generic prior 0.3 for the head's drafts, patched into the
engine. Both learn their step costs in this process only (cost caches off). Prints per engine
tok/s, x no drafts, and per class x no drafts / tokens per step.

    python bench/research/head_prior_ab.py ngram+eagle,eagle
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from drafters import CLASSES, chat_ids, load, run_batch1  # noqa: E402

from verispec import SamplingParams  # noqa: E402
from verispec.config import DraftCost  # noqa: E402
from verispec.engine.llm import LLM  # noqa: E402
from verispec.spec_decode.adaptive import PRIOR  # noqa: E402

OLD_COST = DraftCost(per_call=0.25, per_request=0.05, per_position=0.18, per_row=0.045)


def engine_pair(draft: str) -> dict[str, LLM]:
    pair = {}
    for variant in ("new", "old"):
        llm = LLM(draft=draft, progress=False)
        engine = llm.engine
        engine.costs.cache = None
        if variant == "old":
            head = getattr(engine.drafter, "learned", engine.drafter)
            head.cost = OLD_COST
            engine.adaptive.class_priors = (PRIOR, *engine.adaptive.class_priors[1:])
            engine.costs._fits.clear()  # noqa: SLF001 -- the fits start again from the old price
            engine.adaptive.recalibrate(*engine.costs.costs.snapshot())
        pair[f"{draft} {variant}"] = llm
    return pair


def main() -> None:
    torch.set_num_threads(2)
    drafts = (sys.argv[1] if len(sys.argv) > 1 else "ngram+eagle,eagle").split(",")
    prompts = load(10**6, CLASSES) * 2
    llms = {"none": LLM(draft="none", progress=False)}
    for draft in drafts:
        llms |= engine_pair(draft)
    greedy = SamplingParams(temperature=0, max_tokens=128)
    sampled = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_tokens=128)
    for llm in llms.values():
        llm.generate([chat_ids(llm, row["prompt"]) for row in prompts[:2]], greedy, use_tqdm=False)
    for mode, params in (("greedy", greedy), ("sampled", sampled)):
        results = run_batch1(llms, prompts, params, seeded=False)
        none = results["none"]
        for name, r in results.items():
            cells = " ".join(f"{c}: {r['per_category_tok_s'][c] / none['per_category_tok_s'][c]:.2f}x / "
                             f"{r['per_category_tokens_per_step'][c]:.2f}" for c in r["per_category_tok_s"])
            print(f"b1 {mode} {name:18s} {r['tok_s']:.1f} tok/s {r['tok_s'] / none['tok_s']:.3f}x  {cells}", flush=True)


if __name__ == "__main__":
    main()
