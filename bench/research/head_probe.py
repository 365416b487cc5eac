"""What an EAGLE head's accuracy allows, probed offline on the target's own answers: how well the
head's confidence predicts acceptance, whether a draft temperature or another sibling rule
would accept more, and what chain policies earn under the adaptive K's cost model.

The embedded target answers the evaluation prompts (bench/prompts/spec_bench.jsonl, greedy,
chat-rendered) with its hidden states recorded (verispec.train.record), and the head is run
over each answer as in training (train/unroll.py: pass j is the j-th draft of a chain whose
earlier drafts were accepted), so every row is a draft the head would make on the target's
greedy trajectory, side by side for every rule:
- per category: greedy acceptance of first drafts, and how many of the target's greedy tokens
  the draft vocabulary holds at all (a draft outside it cannot be made);
- calibration: greedy acceptance (the head's argmax is the target's) by the head's top-1
  probability, first drafts;
- draft temperature: the chance that one of k root children drawn from q (recursive rejection
  sampling, as below) is accepted at temperature 0.7 / top-p `--top-p`, with the head's logits
  divided by tau before the pipeline (k = 1: the chance sum(min(p, q)) of a single draft);
- sibling groups of k root children at T = 0.7: drawn without replacement from q and verified
  by recursive rejection sampling (what verispec does; simulated), the k most likely tokens as
  deterministic drafts (sum of p over them), and the most likely token first with the rest drawn;
- chain policies, greedy: fixed K against chains that go on while the product of the drafts'
  top-1 probabilities stays above a threshold, priced as 1 + row_cost * drafts + pass_cost *
  head passes per step (spec_decode/adaptive.py; a gated chain pays one pass more than it drafts, to
  see the confidence that stops it), reported as tokens per unit of cost (x none).
Target distributions are the full vocabulary's; the head's q lives on its draft vocabulary.

    python bench/research/head_probe.py                                   # the shipped EAGLE head
    python bench/research/head_probe.py --head eagle-1.82.safetensors --per-category 4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, drafters.py
from common import write_json  # noqa: E402
from drafters import load

from verispec import SamplingParams
from verispec.config import CacheConfig, EngineConfig
from verispec.model.llama import rms_norm
from verispec.model.loader import load_model
from verispec.sample.metadata import SamplingMetadata
from verispec.sample.processors import process_logits
from verispec.spec_decode.heads import EagleHead, load_head, shipped_head
from verispec.train.command import recorded_layers
from verispec.train.record import record
from verispec.train.unroll import unrolled_passes

DEPTH = 4
TAUS = (0.7, 0.85, 1.0, 1.2, 1.5)
THRESHOLDS = (0.1, 0.2, 0.3, 0.4, 0.5)
BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.01)


def sampled(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:  # [R, V] -> [R, V] probabilities
    """The engine's own sampling pipeline (verispec.sample.processors)."""
    sampling = SamplingMetadata.from_params([SamplingParams(temperature=temperature, top_p=top_p, seed=0)])
    rows = torch.zeros(logits.shape[0], dtype=torch.int64)
    return process_logits(logits, rows, sampling).softmax(-1)


def on_draft_vocab(p: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R, N + 1]
    """p on the draft vocabulary's columns, with the rest of its mass in one last column (never
    drafted: q is 0 there), which keeps residuals exact."""
    inside = p.index_select(1, vocab)
    return torch.cat((inside, (1 - inside.sum(-1, keepdim=True)).clamp(min=0)), dim=1)


def rrs_acceptance(p: torch.Tensor, q: torch.Tensor, k: int, first: torch.Tensor | None,
                   generator: torch.Generator, reps: int = 8) -> float:
    """Chance that one of k root children is accepted (p, q: [R, N + 1] float64): drawn without
    replacement from q, tested by recursive rejection sampling; with `first` ([R] columns), that
    token comes first as a deterministic draft and the others are drawn from q without it.
    This restates the verifier's sibling rule (verispec/sample/tree.py) on the reduced
    [R, N + 1] layout: verify_tree needs full-vocabulary rows, too much memory for every row of
    every answer at once. tests/sample/ prove the verifier's rule, not this copy."""
    total = 0.0
    for _ in range(reps):
        residual, weights = p.clone(), q.clone()
        accepted = torch.zeros(p.shape[0], dtype=torch.bool)
        draws = k
        if first is not None:
            accepted |= torch.rand(p.shape[0], generator=generator, dtype=p.dtype) < residual.gather(1, first[:, None])[:, 0]
            residual.scatter_(1, first[:, None], 0.0)
            residual /= residual.sum(-1, keepdim=True).clamp(min=1e-30)
            weights.scatter_(1, first[:, None], 0.0)
            draws -= 1
        for _ in range(draws):
            alive = weights.sum(-1) > 0
            qi = weights / weights.sum(-1, keepdim=True).clamp(min=1e-30)
            x = torch.multinomial(torch.where(alive[:, None], qi, 1.0), 1, generator=generator)[:, 0]
            u = torch.rand(p.shape[0], generator=generator, dtype=p.dtype)
            accepted |= alive & (u * qi.gather(1, x[:, None])[:, 0] < residual.gather(1, x[:, None])[:, 0])
            left = (residual - qi).clamp(min=0)
            mass = left.sum(-1, keepdim=True)
            rejected = (alive & ~accepted)[:, None] & (mass > 0)
            residual = torch.where(rejected, left / mass.clamp(min=1e-30), residual)
            weights.scatter_(1, x[:, None], 0.0)
        total += accepted.double().mean().item()
    return total / reps


def probe_rows(head: EagleHead, target_norm: torch.Tensor, target_lm_head: torch.Tensor, dataset, eps: float):
    """Per answer: the head's logits at each depth ([DEPTH] x [n, N]), the target's full logits
    [n, V] (row t: the distribution of x_{t+2}), the rows whose first draft is an output token,
    and the chain starts s whose DEPTH drafts (row s + j of pass j) are all output tokens."""
    n_in = len(head.config.hidden_layers) * head.config.hidden_size
    d = head.config.hidden_size
    for i in range(len(dataset)):
        tokens, feats, prompt_len = dataset.sequence(i)
        n = tokens.numel() - 1
        positions = torch.arange(n)
        # Row t predicts x_{t+2}, from the last layer's hidden state at t + 1.
        last = torch.cat((feats[1:n, -d:], feats.new_zeros(1, d)))
        target = (rms_norm(last, target_norm, eps) @ target_lm_head.T).float()
        passes = unrolled_passes(head, head.features(feats[:n, :n_in]), tokens[1:], positions, DEPTH)
        first = torch.arange(max(0, prompt_len - 2), n - 1)
        starts = torch.arange(max(0, prompt_len - 2), max(0, n - DEPTH))
        yield [head.logits(out) for out in passes], target, first, starts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", default=None, help="EAGLE head file (default: the shipped one)")
    parser.add_argument("--per-category", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--row-cost", type=float, default=0.1, help="a verify row, in target passes")
    parser.add_argument("--pass-cost", type=float, default=0.09, help="a head pass, in target passes")
    parser.add_argument("--top-p", type=float, default=0.9,
                        help="top-p of the T = 0.7 rows (default 0.9, the sampled training answers'; "
                             "bench/drafters.py and bench/trees.py sample at T = 0.7 with no top-p: 1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path("bench/results/head_probe.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    model, tokenizer = load_model(None, dtype=torch.float32, progress=False)
    head = load_head(args.head or shipped_head("eagle"), model)
    if not isinstance(head, EagleHead):
        raise SystemExit(f"--head={args.head!r} is a {head.config.kind} head: expected an EAGLE head")
    rows_in = load(args.per_category)
    prompts = [row["prompt"] for row in rows_in]
    params = [SamplingParams(temperature=0, max_tokens=args.max_tokens)] * len(prompts)
    config = EngineConfig(max_num_seqs=len(prompts), max_num_batched_tokens=2048, cache=CacheConfig(16, 4096))
    dataset = record(model, tokenizer, prompts, params, config, layers=recorded_layers(model.config.num_layers))
    if len(dataset) != len(prompts):
        raise SystemExit(f"{len(prompts) - len(dataset)} of {len(prompts)} answers failed to record")
    vocab = head.draft_vocab

    confidence, hits, scaled, groups, chains = [], [], {t: [] for t in TAUS}, [], []
    by_category: dict[str, list[torch.Tensor]] = {}  # category -> [hits, greedy token in the draft vocabulary]
    with torch.no_grad():
        for row, (logits, target, first, starts) in zip(rows_in, probe_rows(
                head, model.norm.detach(), model.lm_head.weight.detach(), dataset, model.config.rms_norm_eps)):
            greedy = target.argmax(-1)
            z, t = logits[0][first], target[first]
            confidence.append(z.softmax(-1).amax(-1))
            hits.append(vocab[z.argmax(-1)] == greedy[first])
            pair = by_category.setdefault(row["category"], [[], []])
            pair[0].append(hits[-1])
            pair[1].append(torch.isin(greedy[first], vocab))
            p = on_draft_vocab(sampled(t, 0.7, args.top_p), vocab).double()
            outside = z.new_zeros(z.shape[0], 1)  # q's column for the mass outside the draft vocabulary
            for tau in TAUS:
                q_tau = torch.cat((sampled(z, 0.7 * tau, args.top_p), outside), dim=1).double()
                drawn_tau = [rrs_acceptance(p, q_tau, k, None, generator) for k in range(1, DEPTH + 1)]
                scaled[tau].append(torch.tensor(drawn_tau) * z.shape[0])
                if tau == 1.0:  # the head as is: its drawn sibling groups are these
                    q, drawn = q_tau, drawn_tau
            ranked = q.topk(DEPTH, dim=-1).indices
            groups.append(torch.tensor([[drawn[k - 1],
                                         p.gather(1, ranked[:, :k]).sum(-1).mean().item(),
                                         rrs_acceptance(p, q, k, ranked[:, 0], generator)]
                                        for k in range(1, DEPTH + 1)]) * z.shape[0])
            rows_of = [starts + j for j in range(DEPTH)]  # draft j of the chain from s: row s + j of pass j
            chains.append((torch.stack([logits[j][r].softmax(-1).amax(-1) for j, r in enumerate(rows_of)], 1),
                           torch.stack([vocab[logits[j][r].argmax(-1)] == greedy[r] for j, r in enumerate(rows_of)], 1)))
    confidence, hits = torch.cat(confidence), torch.cat(hits).double()
    rows = []
    print(f"{len(prompts)} evaluation prompts, {hits.numel()} first drafts, greedy first-draft acceptance "
          f"{hits.mean():.3f}")

    print("\nper category (first drafts): greedy acceptance, and the share of the target's greedy tokens "
          "inside the draft vocabulary (the ceiling)")
    for category, (hit, inside) in by_category.items():
        hit, inside = torch.cat(hit).double(), torch.cat(inside).double()
        print(f"  {category:<14} n={hit.numel():5d}  accepted {hit.mean():.3f}  in vocabulary {inside.mean():.3f}")
        rows.append({"probe": "category", "category": category, "n": hit.numel(),
                     "accepted": hit.mean().item(), "in_vocabulary": inside.mean().item()})

    print("\ncalibration (first drafts): head top-1 probability -> share accepted greedy")
    for low, high in zip(BUCKETS, BUCKETS[1:]):
        chosen = (confidence >= low) & (confidence < high)
        if chosen.any():
            print(f"  [{low:.1f}, {min(high, 1.0):.1f})  n={int(chosen.sum()):5d}  accepted {hits[chosen].mean():.3f}")
            rows.append({"probe": "calibration", "low": low, "high": high, "n": int(chosen.sum()),
                         "accepted": hits[chosen].mean().item()})

    base = torch.stack(scaled[1.0]).sum(0) / hits.numel()
    print(f"\ndraft temperature (T = 0.7, top-p {args.top_p}): chance that one of k drawn root children is accepted, "
          "k = 1..4 (x head as is)")
    for tau in TAUS:
        value = torch.stack(scaled[tau]).sum(0) / hits.numel()
        print(f"  logits / {tau:<4}  " + "  ".join(f"{v:.3f} ({v / b:.3f}x)" for v, b in zip(value.tolist(), base.tolist())))
        rows.append({"probe": "draft temperature", "tau": tau, "acceptance": value.tolist(),
                     "vs_tau_1": (value / base).tolist()})

    group = torch.stack(groups).sum(0) / hits.numel()  # [DEPTH, 3] per k: drawn, ranked, top-1 then drawn
    print(f"\nroot sibling groups at T = 0.7, top-p {args.top_p}: chance that one of k children is accepted")
    for k, (drawn, top, mixed) in enumerate(group.tolist(), start=1):
        print(f"  k={k}  drawn (verispec) {drawn:.3f}  ranked {top:.3f} ({top / drawn:.3f}x)  "
              f"top-1 then drawn {mixed:.3f} ({mixed / drawn:.3f}x)")
        rows.append({"probe": "sibling group", "k": k, "drawn": drawn, "ranked": top, "top1_then_drawn": mixed})

    conf = torch.cat([c for c, _ in chains])
    hit = torch.cat([h for _, h in chains]).double().cumprod(1)  # a draft counts when all before it were accepted
    cost = args.row_cost + args.pass_cost
    print(f"\nchain policies, greedy (a row {args.row_cost}, a head pass {args.pass_cost} of a target pass; "
          f"{conf.shape[0]} chain starts)")
    for k in range(1, DEPTH + 1):
        tokens = 1 + hit[:, :k].sum(1).mean().item()
        rate = tokens / (1 + cost * k)
        print(f"  fixed K={k}            drafts {k:.2f}  tokens/step {tokens:.3f}  x none {rate:.3f}")
        rows.append({"probe": "chain", "policy": f"K={k}", "drafts": k, "tokens": tokens, "x_none": rate})
    for threshold in THRESHOLDS:
        drafted = (conf.cumprod(1) >= threshold).double().cumprod(1)
        k = drafted.sum(1)
        tokens = 1 + (hit * drafted).sum(1)
        passes = (k + 1).clamp(max=DEPTH)
        rate = tokens.mean().item() / (1 + args.row_cost * k.mean().item() + args.pass_cost * passes.mean().item())
        print(f"  gate {threshold:<4} (K<={DEPTH})  drafts {k.mean():.2f}  tokens/step {tokens.mean():.3f}  "
              f"x none {rate:.3f}")
        rows.append({"probe": "chain", "policy": f"gate {threshold}", "drafts": k.mean().item(),
                     "tokens": tokens.mean().item(), "x_none": rate})
    write_json(args.json, torch.device("cpu"), rows, head=str(args.head or shipped_head("eagle")),
               prompts=len(prompts), max_tokens=args.max_tokens, row_cost=args.row_cost, pass_cost=args.pass_cost,
               top_p=args.top_p)


if __name__ == "__main__":
    main()
