"""Decode and verify steps padded to fixed shapes over persistent buffers (runtime/static_step.py),
run eagerly on the CPU: the engine emits the same tokens, drafts and acceptances as with the
ordinary step, greedy (token for token) and seeded (draw for draw), with no drafter, n-gram, a
draft model and EAGLE, chains and trees, CFG, a sliding window and 4-bit weights, and with the row
attention's torch reference in place of the compiled kernel.

Poisoned runs prove padding and stale lanes are never read: before each padded step the reserved
block is NaN in every layer, the KV cache starts NaN, the buffer lanes past the step's shape and
the block-table rows of no sequence hold out-of-range ids, and after preparing the padding rows
get random tokens and positions and point their attention at random sequences and lengths.
"""

from __future__ import annotations

import pytest
import torch

from verispec import SamplingParams
from verispec.model import row_attention
from verispec.runtime import static_step
from verispec.runtime.static_step import StaticInputs, StaticShapes
from verispec.spec_decode.draft_model import DraftModelDrafter
from verispec.spec_decode.eagle import EagleDrafter
from verispec.spec_decode.heads import HeadConfig, new_head
from verispec.spec_decode.ngram import NgramDrafter

from ..tiny import run_all, tiny_engine, tiny_model

VOCAB, K = 16, 4
OUT_OF_RANGE = 10**9
PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 7, 5, 6, 7], [9, 3], [4, 4, 2, 8, 1]]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_tokens=20, ignore_eos=True)
CFG = SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True, guidance_scale=1.5,
                     negative_prompt=[6, 0, 1])


def _target(kind: str):
    if kind == "window":
        return tiny_model(seed=0, scale=3.0, window=6)
    if kind == "int4":
        return tiny_model(seed=0, scale=3.0, quantization=(4, 32))
    return tiny_model(seed=0, scale=3.0)


def _drafter(kind: str, model):
    kind = kind.removesuffix(" tree")
    if kind == "ngram":
        return NgramDrafter(1, 3, K)
    if kind == "draft model":
        return DraftModelDrafter(tiny_model(seed=1, scale=3.0), num_blocks=256, block_size=4)
    if kind == "eagle":
        head = new_head(HeadConfig.for_target("eagle", model.config), model, torch.arange(VOCAB))
        return EagleDrafter(head, num_blocks=256, block_size=4)
    return None


def _run(target: str, drafter: str, params: SamplingParams, static: bool, poison: bool = False,
         monkeypatch: pytest.MonkeyPatch | None = None, fixed_k: bool = False) -> tuple[list, int]:
    """Per prompt (tokens, drafts, accepted drafts), and how many steps ran padded (fixed_k: K
    drafts every step, whatever they are worth)."""
    model = _target(target)
    # 4-bit rows cost the adaptive K too much on a tiny model, trees are drafted whole or not at
    # all, an untrained EAGLE head's drafts never pay (the adaptive K would step it aside), nor
    # do a draft model's as large as its target: K and trees stay fixed there, so that every
    # step verifies drafts.
    tree = drafter.endswith(" tree")
    engine = tiny_engine(model, _drafter(drafter, model), k=K if drafter != "none" else 0, max_seqs=8,
                         static_step=static,
                         adaptive=not fixed_k and target != "int4" and not tree
                         and drafter not in ("eagle", "draft model"),
                         tree=(2, 2) if tree else None)
    # Every request runs 20 tokens: the closed-batch rule (finish_shares) would leave drafting
    # to the longest alone; the padded steps here verify the drafts the throughput rule lets
    # through.
    monkeypatch.setattr(engine, "_finish_shares", lambda speculating: None)
    padded = []
    prepare = StaticInputs.prepare

    def spy(inputs: StaticInputs, *args):
        step = prepare(inputs, *args)
        padded.append(step is not None)
        if poison and step is not None:
            _poison(engine, inputs, step, len(args[0]))
        return step

    monkeypatch.setattr(StaticInputs, "prepare", spy)
    if poison:
        for cache in engine.runner.kv_caches:
            cache.fill_(float("nan"))
    ids = [engine.add_request(p, params) for p in PROMPTS]
    done = run_all(engine)
    return [(done[r].token_ids, done[r].stats.num_draft_tokens, done[r].stats.num_accepted_tokens)
            for r in ids], sum(padded)


def _poison(engine, inputs: StaticInputs, step: static_step.StaticStep, num_seqs: int) -> None:
    g = torch.Generator().manual_seed(len(step.input_ids) + int(step.positions.sum()))
    size, reserved = len(step.input_ids), inputs.reserved_block
    for cache in engine.runner.kv_caches:
        cache[:, reserved] = float("nan")
    padding = torch.ones(size, dtype=torch.bool)
    padding[step.real_rows] = False
    count = int(padding.sum())
    assert (step.attn.slot_mapping[padding] // inputs.block_size == reserved).all()
    step.input_ids[padding] = torch.randint(0, VOCAB, (count,), generator=g)
    step.positions[padding] = torch.randint(0, 400, (count,), generator=g)
    # Any sequence of the step, or the all-reserved row; any length its table row covers.
    seqs = torch.randint(0, num_seqs + 1, (count,), generator=g)
    step.attn.rows.row_seq[padding] = torch.where(seqs == num_seqs, inputs.shapes.max_seqs, seqs)
    width = inputs.shapes.max_blocks * inputs.block_size
    step.attn.rows.row_visible[padding] = torch.randint(1, width + 1, (count,), generator=g)
    for name in inputs.SEGMENTS:  # lanes past the step's shape
        inputs.segment(inputs.rows, name)[size:] = OUT_OF_RANGE
    inputs.segment(inputs.rows, "real")[len(step.real_rows):] = OUT_OF_RANGE
    inputs.tables[num_seqs : inputs.shapes.max_seqs] = OUT_OF_RANGE


SETUPS = [("plain", "none"), ("plain", "ngram"), ("plain", "draft model"), ("plain", "eagle"),
          ("plain", "ngram tree"), ("plain", "eagle tree"), ("window", "ngram"), ("window", "eagle tree"),
          ("int4", "ngram")]


@pytest.mark.parametrize("target,drafter", SETUPS, ids=[f"{t}-{d}" for t, d in SETUPS])
@pytest.mark.parametrize("params", [GREEDY, SEEDED, CFG], ids=["greedy", "seeded", "cfg"])
def test_the_padded_step_emits_what_the_ordinary_step_emits(monkeypatch: pytest.MonkeyPatch, target: str,
                                                           drafter: str, params: SamplingParams) -> None:
    ordinary, never = _run(target, drafter, params, static=False, monkeypatch=monkeypatch)
    padded, steps = _run(target, drafter, params, static=True, poison=True, monkeypatch=monkeypatch)
    assert never == 0 and steps > 10
    assert padded == ordinary
    if drafter != "none":
        assert sum(d for _, d, _ in padded) > 0


@pytest.mark.parametrize("drafter", ["ngram", "eagle", "eagle tree"])
def test_the_torch_reference_rows_emit_the_same(monkeypatch: pytest.MonkeyPatch, drafter: str) -> None:
    ordinary, _ = _run("plain", drafter, SEEDED, static=False, monkeypatch=monkeypatch)
    monkeypatch.setattr(row_attention, "backend_for", lambda device_type: "torch")
    padded, steps = _run("plain", drafter, SEEDED, static=True, poison=True, monkeypatch=monkeypatch)
    assert steps > 10 and padded == ordinary


def test_a_wrong_padding_slot_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Padding rows writing into a real sequence's slots (the first block of the cache) change
    what the poisoned run emits: the comparison above can fail."""
    # At a fixed K: steps of many rows, so padding rows that write where they must not are many.
    ordinary, _ = _run("plain", "ngram", GREEDY, static=False, monkeypatch=monkeypatch, fixed_k=True)
    monkeypatch.setattr(StaticInputs, "__init__", _wrong_reserved)
    padded, steps = _run("plain", "ngram", GREEDY, static=True, monkeypatch=monkeypatch, fixed_k=True)
    assert steps > 10 and padded != ordinary


_right_init = StaticInputs.__init__


def _wrong_reserved(inputs: StaticInputs, device, shapes, block_size: int, reserved_block: int) -> None:
    _right_init(inputs, device, shapes, block_size, reserved_block=0)


def test_steps_are_padded_to_buckets_and_refused_beyond_the_shapes() -> None:
    inputs = StaticInputs(torch.device("cpu"), StaticShapes(4, 3, 5), block_size=4, reserved_block=99)
    step = inputs.prepare([[7], [8, 9, 10], [11, 12]], [5, 0, 8], [[3, 4], [1], [2, 6, 0]])
    assert (step.shape.num_seqs, step.shape.rows) == (4, 3)
    assert step.real_rows.tolist() == [0, 3, 4, 5, 6, 7]
    assert step.input_ids[step.real_rows].tolist() == [7, 8, 9, 10, 11, 12]
    assert step.positions[step.real_rows].tolist() == [5, 0, 1, 2, 8, 9]
    # Position p of a sequence: its block table[p // 4], slot p % 4 there; padding: the reserved slot.
    assert step.attn.slot_mapping.tolist() == [4 * 4 + 1, 396, 396, 4, 5, 6, 0, 1, 396, 396, 396, 396]
    assert step.attn.rows.row_visible.tolist() == [6, 1, 1, 1, 2, 3, 9, 10, 1, 1, 1, 1]
    assert step.attn.rows.row_seq.tolist() == [0, 4, 4, 1, 1, 1, 2, 2, 4, 4, 4, 4]
    assert inputs.prepare([[1]] * 5, [0] * 5, [[0]] * 5) is None  # more sequences
    assert inputs.prepare([[1] * 4], [0], [[0]]) is None  # more rows
    assert inputs.prepare([[1]], [0], [[0] * 6]) is None  # a longer block table
    assert inputs.prepare([[1, 2]], [4], [[0, 1]], [[-1, 0]]) is None  # a tree, without trees
    with pytest.raises(ValueError, match="max_seqs=3"):
        StaticShapes(3, 1, 1)


def test_tree_rows_see_the_context_and_their_ancestors() -> None:
    inputs = StaticInputs(torch.device("cpu"), StaticShapes(2, 4, 5, trees=True), block_size=4, reserved_block=99)
    # A chain of 2 from position 5, a tree of 4 from position 8: root, two children, a grandchild.
    step = inputs.prepare([[7, 8], [1, 2, 3, 4]], [5, 8], [[3, 4], [2, 6, 0]], [None, [-1, 0, 0, 2]])
    assert step.real_rows.tolist() == [0, 1, 4, 5, 6, 7]
    rows = step.attn.rows
    assert step.positions.tolist() == [5, 6, 0, 0, 8, 9, 9, 10]  # tree rows: start + depth
    assert step.attn.slot_mapping.tolist() == [17, 18, 396, 396, 0, 1, 2, 3]  # tree rows: start + row
    assert rows.row_visible.tolist() == [6, 7, 1, 1, 8, 8, 8, 8]
    assert rows.tree_start.tolist() == [5, 5, 0, 0, 8, 8, 8, 8]
    assert rows.tree_mask.int().tolist() == [[0] * 4] * 4 + [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]
