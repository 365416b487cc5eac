"""Token-wise vs block verification (rejection_sample(verification=...)): accepted drafts per
verify step and verify-step time, side by side on the same inputs in one process.

Synthetic worlds: target logits are N(0, scale^2) per row; the draft distribution of each
position mixes an independent random distribution with the target's, q = (1 - a) q_rand + a p
(a = draft quality, 0 = unrelated drafter), both at the request's temperature; drafts are sampled
from q and verified as DraftProbs. Both verifiers see the same logits, drafts and seeds.
Accepted = mean num_accepted per request per step (emitted = accepted + 1); "gain" = block minus
token-wise, paired per request, with its standard error. JSON goes to
bench/results/verification.json (or --json).

    python bench/verification.py                 # CPU, 2 threads, the table of docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
from common import Table, measure, write_json

from verispec import SamplingMetadata, SamplingParams
from verispec.sample import DraftProbs, rejection_sample


def world(batch: int, k: int, vocab: int, quality: float, temperature: float, scale: float,
          seed: int) -> tuple[torch.Tensor, torch.Tensor, DraftProbs]:
    """Target logits [B (K + 1), V], draft ids [B K] sampled from q, and q [B K, V]."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(batch, k + 1, vocab, generator=g) * scale
    p = (target[:, :k] / temperature).softmax(-1)
    q_rand = (torch.randn(batch, k, vocab, generator=g) * scale / temperature).softmax(-1)
    q = ((1 - quality) * q_rand + quality * p).reshape(batch * k, vocab)
    ids = torch.multinomial(q, 1, generator=g)[:, 0]
    return target.reshape(batch * (k + 1), vocab), ids, DraftProbs(q)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, nargs="+", default=[1000, 32000])
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--quality", type=float, nargs="+", default=[0.0, 0.5, 0.9])
    parser.add_argument("--temperature", type=float, nargs="+", default=[1.0, 0.7])
    parser.add_argument("--batch", type=int, default=64, help="requests per verify step")
    parser.add_argument("--steps", type=int, default=16, help="verify steps (independent worlds) per row")
    parser.add_argument("--scale", type=float, default=3.0, help="std of the random logits")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "verification.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")

    rows = []
    table = Table("V", "K", "draft quality", "T", "accepted token-wise", "accepted block", "gain ± se", "ratio",
                  "time token-wise", "time block", digits=3)
    for vocab, k, quality, temperature in itertools.product(args.vocab, args.k, args.quality, args.temperature):
        accepted = {"token": [], "block": []}
        cu = torch.arange(args.batch + 1) * k
        for step in range(args.steps):
            target, ids, draft = world(args.batch, k, vocab, quality, temperature, args.scale, seed=step)
            sampling = SamplingMetadata.from_params(
                [SamplingParams(temperature=temperature)] * args.batch,
                seeds=list(range(step * args.batch, (step + 1) * args.batch)),
            )
            for name in accepted:
                out = rejection_sample(target, ids, cu, sampling, draft=draft, verification=name)
                accepted[name].append(out.num_accepted.double())
        per_request = {name: torch.cat(values) for name, values in accepted.items()}
        gain = per_request["block"] - per_request["token"]  # paired: same worlds, same seeds
        gain_se = float(gain.std() / gain.numel() ** 0.5)
        accepted = {name: float(values.mean()) for name, values in per_request.items()}
        seconds = {
            name: measure(lambda: rejection_sample(target, ids, cu, sampling, draft=draft, verification=name),
                          device, args.reps)
            for name in accepted
        }
        ratio = accepted["block"] / accepted["token"] if accepted["token"] > 0 else float("nan")
        rows.append(dict(vocab=vocab, k=k, quality=quality, temperature=temperature, batch=args.batch,
                         requests=args.batch * args.steps, accepted_token=accepted["token"],
                         accepted_block=accepted["block"], gain=accepted["block"] - accepted["token"],
                         gain_se=gain_se, ratio=ratio,
                         seconds_token=seconds["token"], seconds_block=seconds["block"]))
        table.row(f"{vocab:,}", k, quality, temperature, accepted["token"], accepted["block"],
                  f"{accepted['block'] - accepted['token']:+.3f} ± {gain_se:.3f}", f"{ratio:.3f}×",
                  f"{seconds['token'] * 1e3:.2f} ms", f"{seconds['block'] * 1e3:.2f} ms")
    write_json(args.json, device, rows, batch=args.batch, steps=args.steps, scale=args.scale)


if __name__ == "__main__":
    main()
