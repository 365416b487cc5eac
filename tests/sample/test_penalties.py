"""Penalties, logit bias and token masks: the batched stages against the float64 oracle, the
verifier token for token against the reference walk (per-row histories with repeated drafts),
greedy argmax, fast paths, batch invariance and parameter validation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from verispec import SamplingMetadata, SamplingParams
from verispec.sample import DraftLogits, DraftProbs, rejection_sample
from verispec.sample.penalties import PrecedingTokens
from verispec.sample.processors import process_logits
from verispec.sample.reference import reference_probs, reference_rejection_sample
from verispec.sample.rejection import adjust_rows

VOCAB = 16
PARAMS = [
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(repetition_penalty=0.6, temperature=0.7, top_k=6),
    SamplingParams(frequency_penalty=0.9, presence_penalty=-0.5),
    SamplingParams(presence_penalty=2.0, top_p=0.8, min_p=0.05),
    SamplingParams(logit_bias={3: 5.0, 7: -30.0, 0: 2.5}),
    SamplingParams(allowed_token_ids=[1, 2, 3, 9], banned_token_ids=[2]),
    SamplingParams(banned_token_ids=[0, 4, 5], guidance_scale=2.0, repetition_penalty=1.3),
    SamplingParams(frequency_penalty=2.0, logit_bias={5: 1.0}, guidance_scale=-0.5, temperature=1.3),
    SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=1.0, logit_bias={4: 0.5}),
    SamplingParams(top_k=4),  # no adjustment, in the same batch
    SamplingParams(guidance_scale=3.0),  # no adjustment, guided
]
PROMPTS = [[1, 2, 2, 3], [4], [5, 5, 6], [0, 1], [7], [8, 9], [3, 3], [2], [6, 7, 8], [1], [2, 3]]
OUTPUTS = [[3, 3, 1], [], [6, 6, 6, 2], [1, 0], [7, 7], [9], [4, 0, 4], [5, 5], [8, 4], [1, 1], [3]]


def test_rows_with_preceding_tokens_match_the_reference() -> None:
    """Each request's rows: row j is preceded by j extra tokens (some repeating the output)."""
    g = torch.Generator().manual_seed(0)
    n, per = len(PARAMS), 3
    logits = torch.randn(n * per, VOCAB, generator=g) * 3
    uncond = torch.randn(n * per, VOCAB, generator=g) * 3
    extra = torch.randint(0, VOCAB, (n, per - 1), generator=g)
    extra[:, 0] = torch.tensor([o[-1] if o else 0 for o in OUTPUTS])
    rows = torch.arange(n).repeat_interleave(per)
    pairs = [(b * per + j, int(extra[b, i])) for b in range(n) for j in range(per) for i in range(j)]
    preceding = PrecedingTokens(
        torch.tensor([r for r, _ in pairs]), torch.tensor([t for _, t in pairs]), torch.ones(len(pairs), dtype=torch.bool)
    )
    sampling = SamplingMetadata.from_params(PARAMS, prompt_token_ids=PROMPTS, output_token_ids=OUTPUTS)
    out = process_logits(logits, rows, sampling, uncond, preceding)
    for r in range(n * per):
        b, j = divmod(r, per)
        history = OUTPUTS[b] + extra[b, :j].tolist()
        expected = reference_probs(logits[r], PARAMS[b], uncond[r], PROMPTS[b], history)
        if PARAMS[b].greedy:
            assert int(out[r].argmax()) == int(expected.argmax())
        else:
            torch.testing.assert_close(out[r].softmax(-1).double(), expected, atol=1e-6, rtol=1e-5)


def _batch(seed: int):
    """Ragged K (0 included); drafts repeat the last output token and each other often."""
    g = torch.Generator().manual_seed(seed)
    ks = [0, 1, 4, 2, 3, 5] * 4
    drafts = []
    for b, k in enumerate(ks):
        last = OUTPUTS[b % len(OUTPUTS)][-1:] or [0]
        pool = torch.tensor(last + [int(torch.randint(0, VOCAB, (1,), generator=g))])
        drafts.append(pool[torch.randint(0, 2, (k,), generator=g)].tolist())
    d = sum(ks)
    target = torch.randn(d + len(ks), VOCAB, generator=g) * 2
    rows = [start + sum(ks[:b]) + b for b, k in enumerate(ks) for start in range(k)]
    target[rows, [t for d in drafts for t in d]] += 4.0  # likely drafts, so rows after them are read
    return dict(
        ks=ks, drafts=drafts,
        target=target,
        uncond=torch.randn(d + len(ks), VOCAB, generator=g) * 2,
        probs=torch.softmax(torch.randn(d, VOCAB, generator=g), -1),
        draft_logits=torch.randn(d, VOCAB, generator=g) * 2,
        params=[PARAMS[b % len(PARAMS)] for b in range(len(ks))],
        prompts=[PROMPTS[b % len(PROMPTS)] for b in range(len(ks))],
        outputs=[OUTPUTS[b % len(OUTPUTS)] for b in range(len(ks))],
    )


def _verify(batch: dict, draft, **kw):
    """rejection_sample on the batch, on the device of its tensors."""
    n, device = len(batch["ks"]), batch["target"].device
    sampling = SamplingMetadata.from_params(
        batch["params"], seeds=list(range(100, 100 + n)), steps=[3] * n, device=device,
        prompt_token_ids=batch["prompts"], output_token_ids=batch["outputs"],
    )
    ids = torch.tensor([t for d in batch["drafts"] for t in d], dtype=torch.long, device=device)
    cu = torch.tensor([0] + batch["ks"], device=device).cumsum(0)
    return rejection_sample(batch["target"], ids, cu, sampling, draft=draft, uncond_logits=batch["uncond"], **kw)


@pytest.mark.parametrize("draft_kind", ["probs", "logits", "onehot"])
def test_verifier_matches_the_reference_walk_token_for_token(draft_kind: str) -> None:
    """Same random streams as the oracle, so the same tokens: every target row (and every draft
    logit row) must be penalised with the output followed by the drafts before it."""
    batch = _batch(0)
    ks, drafts = batch["ks"], batch["drafts"]
    if draft_kind == "logits":
        draft = DraftLogits(batch["draft_logits"])
        rows, start = [], 0
        for b, k in enumerate(ks):
            unguided = dataclasses.replace(batch["params"][b], guidance_scale=1.0)
            for i in range(k):
                history = list(batch["outputs"][b]) + drafts[b][:i]
                rows.append(reference_probs(batch["draft_logits"][start + i], unguided, None, batch["prompts"][b], history))
            start += k
        ref_q = torch.stack(rows)
    else:
        draft = DraftProbs(batch["probs"]) if draft_kind == "probs" else None
        ref_q = batch["probs"] if draft_kind == "probs" else None
    out = _verify(batch, draft)
    expected = reference_rejection_sample(
        batch["target"], drafts, batch["params"], list(range(100, 100 + len(ks))), steps=[3] * len(ks),
        draft_probs=ref_q, uncond_logits=batch["uncond"],
        prompt_token_ids=batch["prompts"], output_token_ids=batch["outputs"],
    )
    got = [row[:n].tolist() for row, n in zip(out.token_ids, out.num_emitted.tolist())]
    assert got == expected
    assert sum(n > 1 for n in out.num_emitted.tolist()) > 5  # drafts were accepted, rows after them read


def test_greedy_emits_the_argmax_of_the_adjusted_logits() -> None:
    """A bias, a ban and a penalty each move the argmax; drafts equal to the raw argmax are
    rejected and the adjusted argmax is emitted."""
    target = torch.tensor([[5.0, 4.0, 3.0, 0.0]] * 2)
    cases = [
        (SamplingParams(temperature=0, logit_bias={3: 6.0}), 3),
        (SamplingParams(temperature=0, banned_token_ids=[0, 1]), 2),
        (SamplingParams(temperature=0, allowed_token_ids=[1, 3]), 1),
        (SamplingParams(temperature=0, presence_penalty=1.5), 1),  # token 0 is in the output
        (SamplingParams(temperature=0, repetition_penalty=2.0), 1),
        (SamplingParams(temperature=0), 0),
    ]
    for params, expected in cases:
        sampling = SamplingMetadata.from_params([params], output_token_ids=[[0]], prompt_token_ids=[[2]])
        out = rejection_sample(target, torch.tensor([0]), torch.tensor([0, 1]), sampling)
        assert out.token_ids[0].tolist()[: int(out.num_emitted)] == ([0, 0] if expected == 0 else [expected]), params


def test_no_adjustment_is_the_fast_path_and_other_rows_are_untouched() -> None:
    assert SamplingMetadata.from_params(PARAMS[-2:], output_token_ids=[[1], [2]]).adjustments is None
    assert SamplingMetadata.from_params([SamplingParams(logit_bias={})]).adjustments is None
    batch = _batch(1)
    n = len(batch["ks"])
    sampling = SamplingMetadata.from_params(
        batch["params"], output_token_ids=batch["outputs"], prompt_token_ids=batch["prompts"]
    )
    ids = torch.tensor([t for d in batch["drafts"] for t in d])
    cu = torch.tensor([0] + batch["ks"]).cumsum(0)
    target, draft, after = adjust_rows(
        batch["target"], ids, cu, sampling, DraftLogits(batch["draft_logits"]), batch["uncond"], max(batch["ks"])
    )
    adjusts = torch.tensor([p.adjusts_logits for p in batch["params"]])
    row_req = torch.arange(n).repeat_interleave(torch.tensor(batch["ks"]) + 1)
    draft_req = torch.arange(n).repeat_interleave(torch.tensor(batch["ks"]))
    assert torch.equal(target[~adjusts[row_req]], batch["target"][~adjusts[row_req]])
    assert torch.equal(draft.logits[~adjusts[draft_req]], batch["draft_logits"][~adjusts[draft_req]])
    assert not torch.equal(target[adjusts[row_req]], batch["target"][adjusts[row_req]])
    assert after.adjustments is None and after.any_cfg  # an unadjusted request is still guided
    expected_scale = torch.tensor([1.0 if p.adjusts_logits else p.guidance_scale for p in batch["params"]])
    assert torch.equal(after.guidance_scale, expected_scale)


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    g = torch.Generator().manual_seed(2)
    vocab = 40
    mine_target = torch.randn(4, vocab, generator=g)
    mine_logits = torch.randn(3, vocab, generator=g)
    mine_drafts = [5, 5, 9]
    params = SamplingParams(seed=1234, temperature=1.2, presence_penalty=1.5, repetition_penalty=1.4,
                            logit_bias={5: 2.0}, banned_token_ids=[1])
    history = dict(prompt_token_ids=[[9, 2]], output_token_ids=[[5, 3]])

    def run(target, drafts, cu, params_list, steps, draft_logits, **hist):
        sampling = SamplingMetadata.from_params(params_list, steps=steps, **hist)
        return rejection_sample(target, torch.tensor(drafts), torch.tensor(cu), sampling, draft=DraftLogits(draft_logits))

    alone = run(mine_target, mine_drafts, [0, 3], [params], [7], mine_logits, **history)
    n = int(alone.num_emitted)
    for other_k in (0, 2, 6):
        others = torch.randn(other_k + 1, vocab, generator=g)
        other_logits = torch.randn(other_k, vocab, generator=g)
        other = SamplingParams(frequency_penalty=1.0, min_p=0.1)
        batch = run(
            torch.cat([others, mine_target]), list(range(other_k)) + mine_drafts, [0, other_k, other_k + 3],
            [other, params], [0, 7], torch.cat([other_logits, mine_logits]),
            prompt_token_ids=[[1, 2, 3], [9, 2]], output_token_ids=[[0, 0, 1], [5, 3]],
        )
        assert batch.token_ids[1, :n].tolist() == alone.token_ids[0, :n].tolist()


@pytest.mark.parametrize("kwargs,match", [
    (dict(presence_penalty=2.5), r"presence_penalty=2.5 is invalid: expected a number in \[-2, 2\]"),
    (dict(frequency_penalty=float("nan")), r"frequency_penalty=nan is invalid"),
    (dict(frequency_penalty=True), r"frequency_penalty=True is invalid"),
    (dict(repetition_penalty=0), r"repetition_penalty=0 is invalid: expected a finite number > 0"),
    (dict(repetition_penalty=float("inf")), r"repetition_penalty=inf is invalid"),
    (dict(logit_bias={3: 101}), r"logit_bias=\{3: 101\} is invalid: expected None or a mapping"),
    (dict(logit_bias={-1: 1.0}), r"logit_bias=\{-1: 1.0\} is invalid"),
    (dict(logit_bias={True: 1.0}), r"logit_bias=\{True: 1.0\} is invalid"),
    (dict(logit_bias={"5": 1.0}), r"logit_bias=\{'5': 1.0\} is invalid"),
    (dict(logit_bias={5: float("inf")}), r"logit_bias=\{5: inf\} is invalid"),
    (dict(logit_bias=[(5, 1.0)]), r"logit_bias=\[\(5, 1.0\)\] is invalid"),
    (dict(allowed_token_ids=[]), r"allowed_token_ids=\[\] is invalid: expected None or a non-empty list"),
    (dict(allowed_token_ids=[1, -2]), r"allowed_token_ids=\[1, -2\] is invalid"),
    (dict(banned_token_ids=[1.0]), r"banned_token_ids=\[1.0\] is invalid: expected a list of token ids"),
    (dict(banned_token_ids=[False]), r"banned_token_ids=\[False\] is invalid"),
    (dict(allowed_token_ids=[1, 2], banned_token_ids=[2, 1]),
     r"allowed_token_ids=\[1, 2\] with banned_token_ids=\[2, 1\] is invalid: expected at least one allowed"),
])
def test_bad_values_name_the_argument(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_values_are_normalised_and_read_only() -> None:
    bias = {3: 1}
    p = SamplingParams(logit_bias=bias, allowed_token_ids=[1, 3], banned_token_ids=[3])
    bias[4] = 2.0
    assert dict(p.logit_bias) == {3: 1.0}
    with pytest.raises(TypeError):
        p.logit_bias[5] = 1.0
    assert p.allowed_token_ids == (1, 3) and p.banned_token_ids == (3,)
    assert p.adjusts_logits and not p.uses_penalties
    assert dataclasses.replace(p, seed=3).logit_bias == {3: 1.0}
    assert not SamplingParams().adjusts_logits
    p.check_vocab(4)
    for kwargs, name in [(dict(logit_bias={4: 1.0}), "logit_bias"), (dict(allowed_token_ids=[0, 9]), "allowed_token_ids"),
                         (dict(banned_token_ids=[4]), "banned_token_ids")]:
        with pytest.raises(ValueError, match=rf"{name} contains token id \d: expected ids in \[0, 4\)"):
            SamplingParams(**kwargs).check_vocab(4)
