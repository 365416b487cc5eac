"""Training a draft head on a recorded Dataset (train/record.py), resumably.

Terms as in spec/heads.py (feature, draft vocabulary) and train/record.py (sequence). Targets
are the target model's own distributions, restricted to the draft vocabulary and renormalised
there (the soft labels of self-distillation; the draft vocabulary holds most of the mass):
- EAGLE: row t of a sequence reads (f_t, x_{t+1}) and must predict f_{t+1} (smooth L1,
  weighted by `feature_weight`) and p_{t+1}, the distribution of x_{t+2} (cross-entropy). With
  `unroll` = 2 a second pass feeds the first pass's predicted features back in place of the
  true ones, as drafting does from the second draft on, and is trained on the same targets.
- Medusa: head k at row t must predict p_{t+k}, the distribution of x_{t+k+1} (cross-entropy,
  weighted 0.8^(k-1) as Medusa does).
Only positions whose predicted token is output (not prompt) count. Input features get
uniform noise of +-`noise` (EAGLE's remedy for the gap between true and predicted features).

Checkpoints (head weights, optimizer, progress) are written every `checkpoint_every` steps and
at the end of every epoch; `train` resumes from the one in `checkpoint_dir` when it was written
for the same configuration and draft vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..model import AttentionMetadata
from ..spec.heads import EagleHead, Head, MedusaHeads
from .record import Dataset

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class TrainConfig:
    # The recipe of the shipped heads (docs/benchmarks.md): on ~100k tokens of data, many small
    # steps learn far more per unit of compute than few large ones.
    epochs: int = 8
    batch_tokens: int = 1024  # sequences are packed into steps of about this many tokens
    lr: float = 2e-3
    warmup_steps: int = 20
    feature_weight: float = 1.0
    noise: float = 0.05
    unroll: int = 2
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 25

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_tokens", "checkpoint_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: expected an integer >= 1")
        if self.unroll not in (1, 2):
            raise ValueError(f"unroll={self.unroll!r} is invalid: expected 1 or 2")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr!r} is invalid: expected a number > 0")


def _batches(dataset: Dataset, config: TrainConfig, epoch: int) -> list[list[int]]:
    """The epoch's steps: sequence indices, shuffled with a seed per epoch (so a resumed run
    sees the same order), packed up to batch_tokens."""
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(config.seed * 1000 + epoch))
    lengths = (dataset.offsets[1:] - dataset.offsets[:-1]).tolist()
    batches, current, size = [], [], 0
    for i in order.tolist():
        if current and size + lengths[i] > config.batch_tokens:
            batches.append(current)
            current, size = [], 0
        current.append(i)
        size += lengths[i]
    if current:
        batches.append(current)
    return batches


def _soft_cross_entropy(
    logits: torch.Tensor,  # [M, N] the head's
    target_logits: torch.Tensor,  # [M, N] the target's, over the same draft vocabulary
) -> torch.Tensor:  # [] mean over rows
    return -(target_logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()


def _eagle_loss(head: EagleHead, dataset: Dataset, batch: list[int], config: TrainConfig,
                generator: torch.Generator) -> torch.Tensor:
    block = 16
    features, inputs, targets, lengths, mask = [], [], [], [], []
    for i in batch:
        tokens, feats, prompt_len = dataset.sequence(i)
        n = tokens.numel() - 1  # rows: t = 0 .. L - 2
        features.append(feats[:n])
        inputs.append(tokens[1:])
        targets.append(torch.cat((feats[1:n], feats.new_zeros(1, feats.shape[1]))))
        lengths.append(n)
        # Row t predicts x_{t+2}: it counts when that is output and f_{t+1} exists.
        t = torch.arange(n)
        mask.append((t + 2 >= prompt_len) & (t + 1 <= n - 1))
    device = head.draft_vocab.device
    true = head.normalize(torch.cat(features).to(device, head.dtype))
    goal = head.normalize(torch.cat(targets).to(device, head.dtype))
    ids = torch.cat(inputs).to(device)
    rows = torch.cat(mask).nonzero().squeeze(1).to(device)
    tables, used = [], 0
    for n in lengths:
        count = -(-n // block)
        tables.append(list(range(used, used + count)))
        used += count
    attn = AttentionMetadata.build(lengths, lengths, tables, block, device)
    positions = attn.positions()
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    first_rows = torch.tensor(starts[:-1], device=device)
    with torch.no_grad():
        target_logits = head.logits(goal.index_select(0, rows))
    loss = true.new_zeros((), dtype=torch.float32)
    fed = true
    for _ in range(config.unroll):
        noise = (torch.rand(fed.shape, generator=generator) * 2 - 1).to(device, fed.dtype) * config.noise
        predicted = head(fed + noise, ids, positions, attn, head.allocate_kv_cache(max(used, 1), block))
        chosen = predicted.index_select(0, rows)
        loss = loss + _soft_cross_entropy(head.logits(chosen), target_logits)
        loss = loss + config.feature_weight * F.smooth_l1_loss(chosen.float(), goal.index_select(0, rows).float())
        # Next pass: row t reads the prediction of f_t (from row t - 1); a sequence's first row
        # has none and keeps the true feature.
        shifted = torch.cat((true[:1], predicted[:-1].detach()))
        fed = shifted.index_copy(0, first_rows, true.index_select(0, first_rows))
    return loss / config.unroll


def _medusa_loss(heads: MedusaHeads, dataset: Dataset, batch: list[int], config: TrainConfig,
                 generator: torch.Generator) -> torch.Tensor:
    device = heads.draft_vocab.device
    loss = torch.zeros((), device=device)
    total_weight = 0.0
    features, per_sequence = [], []
    for i in batch:
        tokens, feats, prompt_len = dataset.sequence(i)
        features.append(feats[:-1])
        per_sequence.append((tokens.numel() - 1, prompt_len))
    g = heads.normalize(torch.cat(features).to(device, heads.dtype))
    noise = (torch.rand(g.shape, generator=generator) * 2 - 1).to(device, g.dtype) * config.noise
    starts = [0, *torch.tensor([n for n, _ in per_sequence]).cumsum(0).tolist()]
    for k in range(1, heads.config.num_medusa_heads + 1):
        # Row t (features of t = 0 .. n - 1) predicts x_{t+k+1} from p_{t+k}: t + k <= n - 1.
        source, goal = [], []
        for (n, prompt_len), start in zip(per_sequence, starts):
            t = torch.arange(max(0, prompt_len - k - 1), max(0, n - k))
            source.append(start + t)
            goal.append(start + t + k)
        source_rows, goal_rows = torch.cat(source).to(device), torch.cat(goal).to(device)
        if source_rows.numel() == 0:
            continue
        chosen = g.index_select(0, source_rows) + noise.index_select(0, source_rows)
        logits = heads.head_logits(k - 1, chosen)
        with torch.no_grad():
            target_logits = heads.logits(g.index_select(0, goal_rows))
        weight = 0.8 ** (k - 1)
        loss = loss + weight * _soft_cross_entropy(logits, target_logits)
        total_weight += weight
    return loss / max(total_weight, 1e-9)


def _learning_rate(config: TrainConfig, step: int, total: int) -> float:
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, total - config.warmup_steps)
    return config.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(head: Head, dataset: Dataset, config: TrainConfig = TrainConfig(),
          checkpoint_dir: str | os.PathLike[str] | None = None, progress: bool = True) -> list[float]:
    """Trains `head` in place; returns the loss of every step run in this call."""
    params = head.trainable()
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    epochs = [_batches(dataset, config, e) for e in range(config.epochs)]
    total = sum(len(b) for b in epochs)
    identity = {"config": dataclasses.asdict(config), "kind": head.config.kind,
                "draft_vocab": head.draft_vocab.cpu(), "num_sequences": len(dataset)}
    step = 0
    path = Path(checkpoint_dir) / CHECKPOINT if checkpoint_dir is not None else None
    if path is not None and path.is_file():
        saved = torch.load(path, weights_only=False)
        if _same(saved["identity"], identity):
            with torch.no_grad():
                for name, p in head.own_state().items():
                    p.copy_(saved["head"][name])
            optimizer.load_state_dict(saved["optimizer"])
            step = saved["step"]
    loss_fn = _eagle_loss if head.config.kind == "eagle" else _medusa_loss
    losses: list[float] = []
    bar = tqdm(total=total, initial=step, desc=f"training {head.config.kind}", unit="step", disable=not progress)
    flat = [(e, b) for e, batches in enumerate(epochs) for b in batches]
    for index in range(step, total):
        epoch, batch = flat[index]
        generator = torch.Generator().manual_seed(config.seed * 1_000_003 + index)
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(config, index, total)
        loss = loss_fn(head, dataset, batch, config, generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
        optimizer.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", epoch=epoch + 1)
        bar.update(1)
        done = index + 1
        end_of_epoch = done == total or flat[done][0] != epoch
        if path is not None and (done % config.checkpoint_every == 0 or end_of_epoch):
            _save(path, {"identity": identity, "head": head.own_state(),
                         "optimizer": optimizer.state_dict(), "step": done})
    bar.close()
    for p in params:
        p.requires_grad_(False)
    return losses


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) if isinstance(b[k], torch.Tensor) else a.get(k) == b[k] for k in b)


def _save(path: Path, state: dict) -> None:
    """Atomically: a run killed while saving keeps the previous checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    torch.save(state, partial)
    os.replace(partial, path)
