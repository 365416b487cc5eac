"""`verispec train-drafter`: record, train, evaluate, save (train/record.py, train/trainer.py).

Held-out prompts (every `held_out_every`-th prompt of the set, never trained on) measure the
head's acceptance before and after training with the engine itself: greedy, a fixed K, the
mean number of tokens emitted per verify step (accepted drafts + 1).

Everything slow is cached under the cache directory: recordings in shards of SHARD prompts,
each keyed by the model, max_tokens, seed and its own prompts (an interrupted run records only
the missing shards, and a run on more prompts reuses the shards of the prompts it shares), and
training checkpoints keyed by the data and head settings (trainer.py), so running the same
command again resumes. Every cache file is written to a temporary name and renamed, and a
recording that does not load (cut short, garbled) is recorded again, with a warning.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import CacheConfig, EngineConfig, SpeculativeConfig
from ..engine.engine import LLMEngine
from ..files import atomic_path, check_writable
from ..model import LlamaModel, Tokenizer, load_model
from ..model.loader import cache_dir
from ..sampling_params import SamplingParams
from ..spec_decode.eagle import EagleDrafter
from ..spec_decode.heads import KINDS, Head, HeadConfig, fused_layers, load_head, new_head, save_head, shipped_head
from ..spec_decode.medusa import MedusaDrafter
from ..spec_decode.metrics import SpecDecodeStats
from .prompts import load_prompts
from .record import Dataset, record
from .trainer import TrainConfig, train

SHARD = 64
DRAFT_VOCAB = 8192


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"--{name}={value} is invalid: expected an integer >= 1")


def run(args: argparse.Namespace) -> int:
    for name in ("max_tokens", "held_out_every", "eval_tokens", "num_speculative_tokens", "answers_per_prompt"):
        _positive(name.replace("_", "-"), getattr(args, name))
    draft_vocab = DRAFT_VOCAB if args.draft_vocab is None else args.draft_vocab
    _positive("draft-vocab", draft_vocab)
    if args.kind != "eagle" and (args.fused or args.unroll is not None):
        raise ValueError(f"--fused and --unroll are for --kind eagle, not --kind {args.kind}")
    if args.init and (args.fused or args.intermediate_size is not None or args.draft_vocab is not None):
        raise ValueError("--fused, --intermediate-size and --draft-vocab shape a new head: with --init "
                         "the head file gives them")
    if args.max_prompts is not None:
        _positive("max-prompts", args.max_prompts)
    started = time.monotonic()
    out = Path(args.out or f"{args.kind}-head.safetensors")
    check_writable(out, "--out")  # before the recording and training, which can take hours
    prompts = [p["prompt"] for p in load_prompts(args.prompts)]
    source = f"--prompts={args.prompts!r}" if args.prompts else "the shipped prompt set"
    if not prompts:
        raise ValueError(f"{source} holds no prompts: expected JSONL lines of {{\"category\", \"prompt\"}}")
    held_out = prompts[:: args.held_out_every]
    training = [p for i, p in enumerate(prompts) if i % args.held_out_every][: args.max_prompts]
    if not training:
        raise ValueError(f"{source} has {len(prompts)} prompt(s) and --held-out-every={args.held_out_every} "
                         "holds out every one of them: expected more prompts, or a larger --held-out-every")
    cache = Path(args.cache_dir) if args.cache_dir else cache_dir() / "train"
    stage = _Stage("loading the model")
    try:
        return _run(args, started, out, cache, held_out, training, draft_vocab, stage)
    except KeyboardInterrupt:  # Ctrl-C: where it stopped and how to go on, not a traceback
        print(f"\nverispec: interrupted while {stage.doing}; the recordings and checkpoints so far are kept "
              f"in {str(cache)!r}: run the same command again to resume", file=sys.stderr)
        return 130


@dataclass
class _Stage:
    """What a train-drafter run is doing, for the message when it is interrupted."""

    doing: str


def _run(args: argparse.Namespace, started: float, out: Path, cache: Path, held_out: list[str],
         training: list[str], draft_vocab: int, stage: _Stage) -> int:
    model, tokenizer = load_model(args.model, dtype=torch.float32, device=args.device)
    if not args.init and draft_vocab > model.config.vocab_size:
        raise ValueError(f"--draft-vocab={draft_vocab} is invalid: expected at most the model's "
                         f"vocabulary size {model.config.vocab_size}")
    if args.init:  # checked before the recording, which can take long
        head, init_digest = initial_head(args.init, args.kind, model)
        if head.config.kind == "medusa" and args.num_speculative_tokens > head.config.num_medusa_heads:
            raise ValueError(f"-k={args.num_speculative_tokens} is invalid: the --init head has "
                             f"{head.config.num_medusa_heads} Medusa heads")
    key = hashlib.sha1(repr((str(args.model), model.config, args.max_tokens, args.seed)).encode()).hexdigest()[:12]
    stage.doing = f"recording the answers to {len(training)} prompts"
    dataset = record_shards(model, tokenizer, training, args.max_tokens, cache / f"data-{key}", args.seed,
                            args.answers_per_prompt)
    print(f"data: {len(dataset)} answers, {dataset.num_output_tokens} output tokens "
          f"({len(dataset.tokens)} with prompts)")
    if not args.init:
        config = HeadConfig.for_target(args.kind, model.config, args.intermediate_size, args.num_speculative_tokens,
                                       fused=args.fused)
        head = new_head(config, model, draft_vocabulary(dataset, draft_vocab, model.config.eos_token_ids),
                        seed=args.seed)
        init_digest = None
    config, vocab = head.config, head.draft_vocab
    start = "initial" if args.init else "untrained"
    stage.doing = "measuring the held-out acceptance before training"
    before = acceptance(model, tokenizer, head, held_out, args.num_speculative_tokens, args.eval_tokens)
    chosen = {name: getattr(args, name) for name in ("epochs", "lr", "batch_tokens", "unroll")
              if getattr(args, name) is not None}
    train_config = TrainConfig(seed=args.seed, **chosen)
    identity = (key, training, args.answers_per_prompt, config, vocab.numel()) + ((init_digest,) if init_digest else ())
    run_key = hashlib.sha1(repr(identity).encode()).hexdigest()[:12]
    stage.doing = f"training (a checkpoint every {train_config.checkpoint_every} steps)"
    losses = train(head, dataset, train_config, checkpoint_dir=cache / f"{args.kind}-{run_key}")
    stage.doing = f"writing {str(out)!r} and measuring the trained head's acceptance"
    save_head(head, out)
    after = acceptance(model, tokenizer, head, held_out, args.num_speculative_tokens, args.eval_tokens)
    report = {
        "kind": args.kind, "model": args.model or "embedded SmolLM2-135M-Instruct",
        "prompts": len(training), "answers_per_prompt": args.answers_per_prompt, "answers": len(dataset),
        "output_tokens": dataset.num_output_tokens,
        "max_tokens": args.max_tokens, "draft_vocab": vocab.numel(), "fused_layers": list(config.fused_layers),
        "init": str(args.init) if args.init else None,
        "train_config": dataclasses.asdict(train_config), "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
        "held_out_prompts": len(held_out), "k": args.num_speculative_tokens,
        f"mean_acceptance_length_{start}": before,
        "mean_acceptance_length_trained": after,
        "seconds": round(time.monotonic() - started, 1),
    }
    with atomic_path(out.with_suffix(".json")) as partial:
        partial.write_text(json.dumps(report, indent=2) + "\n")
    print(f"held-out mean acceptance length at K={args.num_speculative_tokens} (greedy, "
          f"{len(held_out)} prompts): {start} {before:.2f}, trained {after:.2f}")
    print(f"wrote {out} and {out.with_suffix('.json')} in {report['seconds']:.0f} s")
    return 0


def initial_head(source: str, kind: str, model: LlamaModel) -> tuple[Head, str]:
    """The head to start from for --init (a head file, or 'eagle' / 'medusa' for the heads shipped
    with the embedded model), and a digest of its file that keys the training checkpoints."""
    path = shipped_head(source) if source in KINDS else Path(source)
    if not path.is_file():
        raise ValueError(f"--init={source!r} is invalid: expected a head file or one of {KINDS}")
    head = load_head(path, model)
    if head.config.kind != kind:
        raise ValueError(f"--init={source!r} is {_an(head.config.kind)} head: expected {_an(kind)} head for "
                         f"--kind {kind}")
    return head, hashlib.sha1(path.read_bytes()).hexdigest()


def _an(kind: str) -> str:
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


def record_shards(model: LlamaModel, tokenizer: Tokenizer, prompts: Sequence[str], max_tokens: int,
                  directory: Path, seed: int = 0, answers: int = 1,
                  layers: Sequence[int] | None = None) -> Dataset:
    """`record` `answers` answers per prompt with the hidden states of `layers` (recorded_layers
    by default), in shards of SHARD prompts and one answer each, cached in `directory` under a
    name that holds the shard's index, the answer's index (from the second on), the layers and
    a hash of its prompts (answer_params says how each is sampled). Features are kept in bf16,
    as stored: several layers of a few hundred thousand tokens take gigabytes in fp32."""
    layers = tuple(layers) if layers is not None else recorded_layers(model.config.num_layers)
    parts = []
    for answer in range(answers):
        for start in range(0, len(prompts), SHARD):
            chunk = prompts[start : start + SHARD]
            digest = hashlib.sha1(repr(list(chunk)).encode()).hexdigest()[:10]
            tag = f"-a{answer}" if answer else ""
            path = directory / f"shard-{start // SHARD:04d}{tag}-L{'.'.join(map(str, layers))}-{digest}.safetensors"
            shard = _cached(path)
            if shard is None:
                params = [answer_params(start + i, answer, seed, max_tokens) for i in range(len(chunk))]
                print(f"recording prompts {start}..{start + len(chunk) - 1} of {len(prompts)}"
                      + (f", answer {answer + 1} of {answers}" if answers > 1 else ""))
                record(model, tokenizer, chunk, params, EngineConfig(max_num_seqs=SHARD, max_num_batched_tokens=1024,
                                                                       cache=CacheConfig(16, 2048)),
                       progress=True, layers=layers).save(path)
                shard = Dataset.load(path, torch.bfloat16)
            parts.append(shard)
    return Dataset.concat(parts)


def _cached(path: Path) -> Dataset | None:
    """The recording at `path`, or None when there is none or it does not load (a shard cut by a
    kill before atomic writes, a disk error): then it is recorded again."""
    if not path.is_file():
        return None
    try:
        return Dataset.load(path, torch.bfloat16)
    except ValueError as error:
        print(f"warning: {error}; recording it again", file=sys.stderr)
        return None


def recorded_layers(num_layers: int) -> tuple[int, ...]:
    """The layers a recording keeps: the last (EAGLE-1 and Medusa read it) and the three a fused
    EAGLE head reads (spec_decode/heads.py fused_layers), so one recording serves every head."""
    return tuple(sorted({*fused_layers(num_layers), num_layers}))


def answer_params(index: int, answer: int, seed: int, max_tokens: int) -> SamplingParams:
    """How answer `answer` to prompt `index` is generated: the first two answers of a prompt are
    one greedy and one at temperature 0.7 / top-p 0.9 (the two regimes drafts serve; which one
    comes first alternates between prompts), later answers are sampled too. Seeds differ per
    prompt and answer."""
    greedy = answer < 2 and (index + answer) % 2 == 0
    return SamplingParams(temperature=0.0 if greedy else 0.7, top_p=1.0 if greedy else 0.9,
                          seed=seed * 1_000_003 + index + answer * 10_000_019, max_tokens=max_tokens)


def draft_vocabulary(dataset: Dataset, size: int, always: Sequence[int] = ()) -> torch.Tensor:  # [size] int64
    """The `size` tokens the recorded answers use most (ties: prompt use, then lower id), with
    `always` (the end-of-sequence tokens) included."""
    vocab_size = int(dataset.tokens.max()) + 1
    is_output = torch.zeros_like(dataset.tokens, dtype=torch.bool)
    for i in range(len(dataset)):
        is_output[int(dataset.offsets[i]) + int(dataset.prompt_lens[i]) : int(dataset.offsets[i + 1])] = True
    width = max(vocab_size, *(t + 1 for t in always), size)
    score = torch.bincount(dataset.tokens[is_output], minlength=width).double() * (len(dataset.tokens) + 1)
    score += torch.bincount(dataset.tokens[~is_output], minlength=width).double()
    for t in always:
        score[t] = float("inf")
    return torch.argsort(score, descending=True, stable=True)[:size].sort().values


def acceptance(model: LlamaModel, tokenizer: Tokenizer, head: Head, prompts: Sequence[str | list[int]],
               k: int, max_tokens: int) -> float:
    """Mean tokens emitted per verify step over `prompts` (texts chat-rendered, token ids as
    given; greedy, K = k fixed)."""
    drafter = EagleDrafter(head, 4096, 16) if head.config.kind == "eagle" else MedusaDrafter(head)
    config = EngineConfig(max_num_seqs=64, max_num_batched_tokens=1024, cache=CacheConfig(16, 4096),
                          speculative=SpeculativeConfig(method=head.config.kind, num_speculative_tokens=k,
                                                        adaptive=False))
    engine = LLMEngine(model, tokenizer, config, drafter)
    for prompt in prompts:
        text = isinstance(prompt, str)
        if text:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        engine.enqueue(engine.prepare_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                     ignore_eos=not text),
                                              add_special_tokens=not text))
    stats = SpecDecodeStats()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                stats.merge(out.stats)
    return stats.mean_acceptance_length
