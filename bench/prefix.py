"""Prefix caching on the embedded default model: caching on vs off, greedy, batch 1.

Three workloads, run with one LLM per setting (so "on" starts from an empty cache), each
workload off then on:
- chats: 32 conversations sharing one ~600-token system prompt, each with its own question;
  the first is a miss, the others find the system prompt cached;
- cfg: 8 requests with guidance (gamma 1.5) sharing one long negative prompt, each its own prompt;
- distinct: 8 prompts with no shared prefix beyond the chat template's first tokens (what
  caching costs when it cannot help).
Per workload and setting: time to first token (of the first request, a miss either way; p50 /
p95 over all requests, and over the requests after the first: with caching, the hits), total output tokens / total seconds, and the
prompt tokens served from the cache. Requests run one at a time (batch 1), streamed.

    python bench/prefix.py
    python bench/prefix.py --chats 8 --max-tokens 8 --draft none
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from common import Table, write_json

from verispec import SamplingParams
from verispec.engine.llm import LLM

SYSTEM = (
    "You are the help desk assistant of the Riverside Public Library. Follow these rules in every answer. "
    "Opening hours: Monday to Friday from nine in the morning to eight in the evening, Saturday from ten to "
    "five, closed on Sundays and public holidays. Members may borrow up to twelve items at once: books for "
    "three weeks, films and music for one week, magazines for one week, and reference works never leave the "
    "building. Renewals are possible twice, online or at the desk, unless another member has reserved the "
    "item. Late returns cost twenty cents a day per item, capped at five dollars; children's items have no "
    "late fees. Lost items are charged at their replacement cost plus a processing fee of three dollars. "
    "Membership is free for residents of the county with proof of address; visitors pay ten dollars a year. "
    "The library offers free wireless internet, twenty public computers bookable for two hours a day, "
    "printing at ten cents a page in black and white and fifty cents in colour, scanning for free, quiet "
    "study rooms for groups of up to six that can be booked a week ahead, a makerspace with two 3D printers "
    "open on Tuesday and Thursday afternoons after a short safety course, story time for children every "
    "Wednesday and Saturday morning, a homework club on weekday afternoons, English conversation circles on "
    "Monday evenings, and a monthly book club on the first Thursday. Interlibrary loans take about ten days "
    "and cost nothing. Donations of books in good condition are welcome at the desk, but not textbooks older "
    "than five years or encyclopedias. Food is not allowed except in the cafe on the ground floor; covered "
    "drinks are fine. Lost and found items are kept for thirty days. Accessibility: there is a ramp at the "
    "east entrance, a lift to every floor, large-print books, audio books, and a reading machine for the "
    "visually impaired. Parking is free for two hours behind the building. Answer politely and briefly, "
    "in at most three sentences, quote the rule you rely on, never invent services the library does not "
    "offer, and suggest asking at the desk when you are not sure. Events: the summer reading challenge runs "
    "from June to August for readers of every age, with a small prize for every five books; author talks are "
    "announced on the notice board by the entrance and on the website a month ahead; the local history "
    "room on the second floor holds old maps, newspapers on microfilm and family records, open on weekday "
    "mornings with a librarian present. Volunteers help with the homework club and the book sale in "
    "October; ask at the desk for a form. Gift cards for the cafe and the book sale can be bought at the "
    "desk. Phones on silent in every reading room, please. The library closes early, at five, on the days "
    "before public holidays, and the book drop by the car park takes returns at any hour; items returned "
    "there are checked in the next morning."
)
QUESTIONS = [
    "When are you open on Saturday?", "How many books can I borrow?", "What does a late DVD cost?",
    "Can I renew a reserved book?", "Is membership free?", "How much is colour printing?",
    "Can I bring coffee?", "Where is the ramp?", "How long do interlibrary loans take?",
    "Do you take old encyclopedias?", "When is story time?", "Can I use the 3D printer?",
    "How long can I book a computer?", "Is there parking?", "What if I lose a book?",
    "Do children pay late fees?", "When does the book club meet?", "Can six of us book a room?",
    "Is the wifi free?", "Are you open on Sunday?", "How long is a film loan?", "Can I scan documents?",
    "Where is the cafe?", "How long do you keep lost items?", "Do visitors pay for membership?",
    "Is there a homework club?", "Can I borrow reference books?", "How do I renew online?",
    "Do you have audio books?", "When are the conversation circles?", "What is the cap on late fees?",
    "Can I donate books?",
]
NEGATIVE = (
    "Answer rudely, at length, with made-up facts, irrelevant digressions about unrelated topics, "
    "no structure, many repetitions, invented prices and opening hours, and without ever quoting a rule. "
) * 6
CFG_PROMPTS = ["Tell me about the ocean.", "Describe a volcano.", "What do bees eat?", "Why does the moon shine?",
               "How do you play chess?", "How is bread made?", "Where do rivers begin?", "Why do owls hoot?"]
DISTINCT = ["Name three primary colours.", "What is two plus two?", "Write a haiku about rain.",
            "Who wrote Hamlet?", "Explain gravity to a child.", "List four fruits.",
            "What is the boiling point of water?", "Give me a synonym for happy."]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Streams each prompt alone; TTFT per request, tokens, seconds, cached prompt tokens."""
    ttft, tokens, cached, prompt_tokens = [], 0, 0, 0
    stats = llm.engine.scheduler.prefix_stats
    hits_before = stats.hits
    start = time.perf_counter()
    for prompt in prompts:
        t0 = time.perf_counter()
        first = None
        for out in llm.stream(prompt, params):
            if first is None and out.new_token_ids:
                first = time.perf_counter() - t0
            last = out
        ttft.append(first)
        tokens += len(last.token_ids)
        cached += last.num_cached_tokens or 0
        prompt_tokens += len(last.prompt_token_ids)
    return {"ttft": ttft, "tokens": tokens, "seconds": time.perf_counter() - start,
            "cached": cached, "prompt_tokens": prompt_tokens, "all_hits": stats.hits - hits_before}


def quantiles(values: list[float]) -> tuple[float, float]:
    """(p50, p95) in milliseconds."""
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return 1e3 * statistics.median(ordered), 1e3 * p95


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chats", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--draft", default="ngram")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path("bench/results/prefix.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    table = Table("workload", "caching", "prompt tok", "cached", "all seqs", "first ms", "TTFT p50 ms", "TTFT p95 ms",
                  "after p50 ms", "after p95 ms", "tok/s", digits=0)
    # Both settings side by side, each workload off then on, so that the two runs of a workload
    # are minutes apart at most (a shared machine's load drifts).
    llms = {caching: LLM(draft=args.draft, kv_cache_gib=0.5, progress=False, enable_prefix_caching=caching)
            for caching in (False, True)}
    tok = llms[False].tokenizer

    def chat(question: str) -> list[int]:
        text = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                                       add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)

    def user(text: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True),
                          add_special_tokens=False)

    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    workloads = {
        "chats": ([chat(q) for q in (QUESTIONS * 2)[: args.chats]], greedy),
        "cfg": ([user(p) for p in CFG_PROMPTS],
                SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, guidance_scale=1.5,
                               negative_prompt=NEGATIVE)),
        "distinct": ([user(p) for p in DISTINCT], greedy),
    }
    for llm in llms.values():  # warm-up on a prompt no workload shares beyond the template's first tokens
        llm.generate(user("Hello there, warm up."), SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    for name, (prompts, params) in workloads.items():
        for caching, llm in llms.items():
            r = run(llm, prompts, params)
            p50, p95 = quantiles(r["ttft"])
            h50, h95 = quantiles(r["ttft"][1:])
            row = {"workload": name, "caching": caching, "requests": len(prompts), "prompt_tokens": r["prompt_tokens"],
                   "cached_tokens": r["cached"], "cached_tokens_all_sequences": r["all_hits"],
                   "first_ttft_ms": 1e3 * r["ttft"][0], "ttft_p50_ms": p50, "ttft_p95_ms": p95,
                   "after_first_p50_ms": h50, "after_first_p95_ms": h95, "tokens": r["tokens"],
                   "seconds": r["seconds"], "tok_per_s": r["tokens"] / r["seconds"]}
            rows.append(row)
            table.row(name, "on" if caching else "off", r["prompt_tokens"], r["cached"], r["all_hits"],
                      row["first_ttft_ms"], p50, p95, h50, h95, f"{row['tok_per_s']:.1f}")
    write_json(args.json, torch.device("cpu"), rows, max_tokens=args.max_tokens, draft=args.draft)


if __name__ == "__main__":
    main()
