"""Log-probabilities of emitted tokens equal log-softmax of the processed target rows, computed
independently by the float64 oracle (reference_probs), for accepted, recovered and bonus tokens,
penalties seeing each row's own history (the output, then the accepted drafts before the row)."""

from __future__ import annotations

import dataclasses

import torch

from verispec import SamplingMetadata, SamplingParams
from verispec.sample import DraftProbs, rejection_sample
from verispec.sample.logprobs import emitted_logprobs
from verispec.sample.reference import reference_probs

V = 40
PARAMS = [
    SamplingParams(temperature=0.8, top_k=10, top_p=0.9),
    SamplingParams(temperature=0),
    SamplingParams(guidance_scale=2.0, temperature=1.3),
    SamplingParams(min_p=0.05),
    SamplingParams(temperature=0, guidance_scale=1.5),
    SamplingParams(presence_penalty=1.5, repetition_penalty=1.3, temperature=0.9),
    SamplingParams(temperature=0, frequency_penalty=2.0, logit_bias={3: 5.0}),
]
PROMPT = [1, 2, 3]
OUTPUT = [4, 4, 5]


def test_emitted_logprobs_match_the_oracle() -> None:
    g = torch.Generator().manual_seed(0)
    params = PARAMS * 40
    ks = [i % 4 for i in range(len(params))]
    cu = torch.tensor([0, *torch.tensor(ks).cumsum(0).tolist()])
    target = torch.randn(int(cu[-1]) + len(ks), V, generator=g) * 2
    uncond = torch.randn_like(target)
    # Drafts: often the target row's argmax (so drafts get accepted and bonus tokens occur).
    draft_rows = torch.cat([torch.arange(c, c + k) + b for b, (c, k) in enumerate(zip(cu[:-1].tolist(), ks))])
    ids = target[draft_rows].argmax(-1)
    noise = torch.randint(0, V, ids.shape, generator=g)
    ids = torch.where(torch.rand(ids.shape, generator=g) < 0.3, noise, ids)
    draft = DraftProbs(torch.softmax(torch.randn(ids.shape[0], V, generator=g), -1))
    sampling = SamplingMetadata.from_params(params, seeds=list(range(len(params))),
                                            prompt_token_ids=[PROMPT] * len(params),
                                            output_token_ids=[OUTPUT] * len(params))
    out = rejection_sample(target, ids, cu, sampling, draft=draft, uncond_logits=uncond)
    wanted = [i % 3 != 2 for i in range(len(params))]
    got = emitted_logprobs(target, ids, cu, sampling, out, wanted, 5, uncond)

    kinds = set()
    r = 0
    for b, sp in enumerate(params):
        n = int(out.num_emitted[b])
        assert got.num_rows[b] == (n if wanted[b] else 0)
        if not wanted[b]:
            continue
        reference_params = dataclasses.replace(sp, temperature=1.0) if sp.greedy else sp
        for j in range(n):
            row = int(cu[b]) + b + j
            history = OUTPUT + out.token_ids[b, :j].tolist()  # the accepted drafts before row j
            log_p = reference_probs(target[row], reference_params, uncond[row], PROMPT, history).log()
            token = int(out.token_ids[b, j])
            torch.testing.assert_close(got.token_logprobs[r], log_p[token].float(), atol=1e-5, rtol=0)
            expected_top = log_p.sort(descending=True).values[:5].float()
            finite = torch.isfinite(expected_top)
            torch.testing.assert_close(got.top_logprobs[r][finite], expected_top[finite], atol=1e-5, rtol=0)
            assert torch.equal(torch.isfinite(got.top_logprobs[r]), finite)
            kinds.add("accepted" if j < int(out.num_accepted[b]) else "bonus" if j == ks[b] else "recovered")
            r += 1
    assert r == got.token_logprobs.shape[0]
    assert kinds == {"accepted", "recovered", "bonus"}
