"""Training a draft head on a recorded Dataset (train/record.py), resumably.

Terms as in spec_decode/heads.py (feature, draft vocabulary) and train/record.py (sequence). Targets
are the target model's own distributions, restricted to the draft vocabulary and renormalised
there (the soft labels of self-distillation; the draft vocabulary holds most of the mass):
- EAGLE: row t of a sequence reads (f_t, x_{t+1}) and must predict p_{t+1}, the distribution
  of x_{t+2} (cross-entropy), and, unless the head is fused, f_{t+1} (smooth L1, weighted by
  `feature_weight`). The head is trained at `unroll` draft depths at once, each fed its own
  predictions and attending as drafting does (train/unroll.py, EAGLE-3's training-time test);
  depth j's loss is weighted 0.8^j.
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
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..files import atomic_path, intact
from ..spec_decode.heads import EagleHead, Head, MedusaHeads
from .record import Dataset
from .unroll import unrolled_passes, valid_rows

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class TrainConfig:
    # The recipe of the shipped heads (docs/drafter-training.md): on ~100k tokens of data, many small
    # steps learn far more per unit of compute than few large ones.
    epochs: int = 8
    batch_tokens: int = 1024  # sequences are packed into steps of about this many tokens
    lr: float = 2e-3
    warmup_steps: int = 20
    feature_weight: float = 1.0
    noise: float = 0.05
    unroll: int = 3
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 25

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_tokens", "checkpoint_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: expected an integer >= 1")
        if not isinstance(self.unroll, int) or not 1 <= self.unroll <= 8:
            raise ValueError(f"unroll={self.unroll!r} is invalid: expected an integer in [1, 8]")
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
    n_in = len(head.config.hidden_layers) * head.config.hidden_size
    features, inputs, targets, mask, positions = [], [], [], [], []
    for i in batch:
        tokens, feats, prompt_len = dataset.sequence(i)
        n = tokens.numel() - 1  # rows: t = 0 .. L - 2
        features.append(feats[:n, :n_in])
        inputs.append(tokens[1:])
        # Row t's target is the distribution of x_{t+2}, read from the last layer at t + 1.
        targets.append(torch.cat((feats[1:n, -head.config.hidden_size :], feats.new_zeros(1, head.config.hidden_size))))
        # Row t predicts x_{t+2}: it counts when that is output and f_{t+1} exists.
        t = torch.arange(n)
        positions.append(t)
        mask.append((t + 2 >= prompt_len) & (t + 1 <= n - 1))
    device = head.draft_vocab.device
    true = head.features(torch.cat(features).to(device, head.dtype))
    last = torch.cat(targets).to(device, head.dtype)
    ids, position = torch.cat(inputs).to(device), torch.cat(positions).to(device)
    counted = torch.cat(mask).to(device)
    with torch.no_grad():
        target_logits = head.target_logits(last)
        goal = None if head.config.fused_layers else head.features(last)
    noise = (torch.rand(true.shape, generator=generator) * 2 - 1).to(device, true.dtype) * config.noise
    loss, total = true.new_zeros((), dtype=torch.float32), 0.0
    for depth, predicted in enumerate(unrolled_passes(head, true + noise, ids, position, config.unroll)):
        rows = (counted & valid_rows(position, depth)).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        chosen = predicted.index_select(0, rows)
        term = _soft_cross_entropy(head.logits(chosen), target_logits.index_select(0, rows))
        if goal is not None:
            term = term + config.feature_weight * F.smooth_l1_loss(chosen.float(), goal.index_select(0, rows).float())
        # Later drafts count less: each is reached only when the ones before it are accepted.
        weight = 0.8**depth
        loss, total = loss + weight * term, total + weight
    return loss / max(total, 1e-9)


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
    g = heads.features(torch.cat(features).to(device, heads.dtype))
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
    """Trains `head` in place; returns the loss of every step run in this call. `dataset` must
    hold the layers the head reads and the last one (its targets)."""
    last = head.config.target_num_layers
    dataset = dataset.select(tuple(sorted({*head.config.hidden_layers, last})))
    params = head.trainable()
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    epochs = [_batches(dataset, config, e) for e in range(config.epochs)]
    total = sum(len(b) for b in epochs)
    identity = {"config": dataclasses.asdict(config), "head": dataclasses.asdict(head.config),
                "draft_vocab": head.draft_vocab.cpu(), "num_sequences": len(dataset)}
    step = 0
    path = Path(checkpoint_dir) / CHECKPOINT if checkpoint_dir is not None else None
    if path is not None and path.is_file():
        step = _resume(path, identity, head, optimizer)
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


def _resume(path: Path, identity: dict, head: Head, optimizer: torch.optim.Optimizer) -> int:
    """Loads the checkpoint at `path` into `head` and `optimizer` when it belongs to this run;
    returns the steps it had done (0: start over). weights_only: a checkpoint is tensors and
    plain values, and a file placed in a shared cache directory must not run code when loaded.
    A damaged or foreign checkpoint is reported and training starts from the beginning."""
    state = {name: p.detach().clone() for name, p in head.own_state().items()}
    try:
        if not intact(path):
            raise ValueError("its bytes do not match the checksum written with it")
        saved = torch.load(path, weights_only=True)
        if not _same(saved["identity"], identity):
            return 0
        with torch.no_grad():
            for name, p in head.own_state().items():
                p.copy_(saved["head"][name])
        optimizer.load_state_dict(saved["optimizer"])
        return int(saved["step"])
    # torch.load reports a cut, garbled or code-carrying file as any of several types (pickle's
    # UnpicklingError, EOFError, RuntimeError, ...), and a foreign dict fails on its keys.
    except Exception as error:
        with torch.no_grad():
            for name, p in head.own_state().items():
                p.copy_(state[name])
        print(f"warning: training checkpoint {str(path)!r} is damaged ({type(error).__name__}: {error}); "
              "training from the start", file=sys.stderr)
        return 0


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) if isinstance(b[k], torch.Tensor) else a.get(k) == b[k] for k in b)


def _save(path: Path, state: dict) -> None:
    """Atomically: a run killed while saving keeps the previous checkpoint."""
    with atomic_path(path, sealed=True) as partial:
        torch.save(state, partial)
