"""Logits -> probabilities: the sampling pipeline, batched, native PyTorch (on CPU the top-k /
top-p head's values and the filter's mask come from the compiled kernels, csrc/sampling.h).

Order (docs/design.md, "The sampling pipeline"), identical for draft and target rows:
CFG combine -> repetition penalty -> frequency / presence penalties -> logit bias ->
allowed / banned mask -> temperature -> top-k -> top-p -> min-p.
The stages up to the mask (guide_and_adjust; penalties.py) change which token is the argmax, so
greedy rows go through them too; the rest is skipped for greedy rows. Every stage is skipped
when no request of the batch uses it (the flags of SamplingMetadata).

Everything stays in log space: a *processed* row holds the tempered (and guided) logits with
filtered tokens set to -inf, so that softmax(processed row) is the request's sampling
distribution and the sampler can read single probabilities as exp(x - logsumexp(row)) without
materialising full probability rows. Filter tie rules are those of SamplingParams (threshold
based: every token tied with the boundary token stays).
"""

from __future__ import annotations

import torch

from ..model.quant.kernels import compiled_kernels
from .metadata import SamplingMetadata
from .penalties import PrecedingTokens, apply_adjustments


def cfg_combine(
    cond: torch.Tensor,  # [N, V] conditional logits
    uncond: torch.Tensor,  # [N, V] unconditional logits, row-aligned with cond
    scale: torch.Tensor,  # [N] guidance scale per row; 1 leaves the row untouched
) -> torch.Tensor:  # [N, V] float32
    """Guided logits l_u + gamma (l_c - l_u) (Sanchez et al. 2023).

    Same softmax as the log-softmax form, since the two differ by a per-row constant. Rows with
    gamma = 1 return the conditional logits bit for bit. A token that both branches rule out
    (-inf) gives NaN in the formula; it stays ruled out.
    """
    cond = cond.float()
    uncond = uncond.float()
    g = scale[:, None]
    guided = uncond + g * (cond - uncond)
    guided = torch.where(torch.isnan(guided), float("-inf"), guided)
    return torch.where(g == 1, cond, guided)


# On CPU, top-k / top-p read the sorted head of each row (torch.topk) before sorting whole rows:
# sorting 6 rows of 49,152 takes 12 ms on 2 cores, their top 256 0.6 ms. The head widens x8 until
# it holds every kept token (most nuclei of language models are far smaller).
CPU_HEAD = 256


def apply_top_k_top_p(
    x: torch.Tensor,  # [N, V] tempered logits
    top_k: torch.Tensor | None,  # [N] int64, 0 = off; None when no row uses it
    top_p: torch.Tensor | None,  # [N] float32, 1 = off; None when no row uses it
) -> torch.Tensor:  # [N, V]
    """Masks with -inf the tokens outside each row's top-k, then outside its nucleus."""
    vocab = x.shape[-1]
    width = vocab
    if x.device.type == "cpu":  # on GPUs a full sort is fast and a widening check would sync
        width = min(vocab, max(CPU_HEAD, int(top_k.max()) if top_k is not None else 0))
    while True:
        threshold, complete = _top_k_top_p_threshold(x, top_k, top_p, width)
        if width == vocab or bool(complete.all()):
            compiled = compiled_kernels()
            if compiled is not None and x.device.type == "cpu" and x.dtype == torch.float32:
                return compiled.fill_below(x.contiguous(), threshold.reshape(-1).contiguous())
            return x.masked_fill(x < threshold, float("-inf"))
        width = min(vocab, width * 8)


def _top_k_top_p_threshold(
    x: torch.Tensor,  # [N, V] tempered logits
    top_k: torch.Tensor | None,  # [N] int64, 0 = off; at most `width` where > 0
    top_p: torch.Tensor | None,  # [N] float32, 1 = off
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([N, 1] threshold, [N, 1] bool)
    """Each row's threshold from its `width` largest values, and whether those hold every
    token at or above it (else a wider head may find a lower threshold)."""
    vocab = x.shape[-1]
    compiled = compiled_kernels()
    if width < vocab and compiled is not None and x.device.type == "cpu" and x.dtype == torch.float32:
        head = compiled.top_values(x.contiguous(), width)  # topk's values, ~3x faster (csrc/sampling.h)
    else:
        head = x.topk(width, dim=-1).values if width < vocab else x.sort(dim=-1, descending=True).values
    threshold = torch.full_like(x[:, :1], float("-inf"))
    ordered = head
    if top_k is not None:
        kth = head.gather(1, (top_k - 1).clamp(0, width - 1)[:, None])
        threshold = torch.where(top_k[:, None] > 0, kth, threshold)
        ordered = head.masked_fill(head < threshold, float("-inf"))
    complete = torch.ones_like(threshold, dtype=torch.bool)
    if top_p is not None:
        # Masses are shares of the row after top-k: the head holds all of a top-k row's mass
        # unless tokens tied with its k-th value lie past it (then it widens); other rows need
        # their whole row.
        lse = ordered.logsumexp(dim=-1, keepdim=True)
        if top_k is not None:
            complete = (top_k[:, None] <= 0) | (head[:, -1:] < threshold)
        if width < vocab and (top_k is None or not bool((top_k > 0).all())):
            row_lse = x.logsumexp(dim=-1, keepdim=True)
            lse = row_lse if top_k is None else torch.where(top_k[:, None] > 0, lse, row_lse)
        cum_mass = (ordered - lse).exp().cumsum(dim=-1)
        # The nucleus ends at the first sorted position whose running mass reaches top_p.
        last = (cum_mass < top_p[:, None]).sum(dim=-1, keepdim=True).clamp(max=width - 1)
        nucleus = ordered.gather(1, last)
        threshold = torch.where(top_p[:, None] < 1, torch.maximum(threshold, nucleus), threshold)
    complete &= (threshold == float("-inf")) | (head[:, -1:] < threshold)
    return threshold, complete


def apply_min_p(
    x: torch.Tensor,  # [N, V] tempered logits
    min_p: torch.Tensor,  # [N] float32, 0 = off
) -> torch.Tensor:  # [N, V]
    """p_v < min_p * p_max  <=>  x_v - x_max < log(min_p), without a softmax."""
    log_ratio = torch.log(min_p)[:, None]  # log(0) = -inf keeps every token
    row_max = x.max(dim=-1, keepdim=True).values
    return x.masked_fill(x - row_max < log_ratio, float("-inf"))


def guide_and_adjust(
    logits: torch.Tensor,  # [N, V] raw logits (any float dtype)
    rows: torch.Tensor,  # [N] int64, the request (index into `sampling`) each row belongs to
    sampling: SamplingMetadata,
    uncond_logits: torch.Tensor | None = None,  # [N, V] CFG unconditional rows, or None
    preceding: PrecedingTokens | None = None,
) -> torch.Tensor:  # [N, V] float32
    """The stages up to the allowed / banned mask: CFG combine, penalties (each row's history
    is its request's output followed by the `preceding` tokens paired with the row), logit
    bias, mask. The verifier's pre-stage runs exactly this for its adjusted rows."""
    if uncond_logits is not None and sampling.any_cfg:
        x = cfg_combine(logits, uncond_logits, sampling.guidance_scale[rows])
    else:
        x = logits.float()
    if sampling.adjustments is not None:
        x = apply_adjustments(x, rows, sampling.adjustments, preceding)
    return x


def process_logits(
    logits: torch.Tensor,  # [N, V] raw logits (any float dtype)
    rows: torch.Tensor,  # [N] int64, the request (index into `sampling`) each row belongs to
    sampling: SamplingMetadata,
    uncond_logits: torch.Tensor | None = None,  # [N, V] CFG unconditional rows, or None
    preceding: PrecedingTokens | None = None,
) -> torch.Tensor:  # [N, V] float32 processed logits
    """The whole pipeline for rows of many requests. Greedy rows are guided and adjusted but
    not tempered or filtered (their argmax is all that is read). Pass uncond_logits=None for
    draft rows: drafts are unguided. `preceding`: see guide_and_adjust."""
    x = guide_and_adjust(logits, rows, sampling, uncond_logits, preceding)
    if sampling.all_greedy:
        return x
    temperature = sampling.temperature[rows]
    x = x / torch.where(temperature > 0, temperature, 1.0)[:, None]
    if sampling.any_top_k or sampling.any_top_p:
        x = apply_top_k_top_p(
            x,
            sampling.top_k[rows] if sampling.any_top_k else None,
            sampling.top_p[rows] if sampling.any_top_p else None,
        )
    if sampling.any_min_p:
        x = apply_min_p(x, sampling.min_p[rows])
    return x

