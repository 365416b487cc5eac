"""rejection_sample(): exact, batched, ragged verification of draft tokens (docs/design.md:
"The algorithm", "Interfaces").

Terms, used throughout verispec/sample:
- request b proposes K_b *draft* tokens x_1..x_K (K_b may be 0), drawn from *draft*
  distributions q_1..q_K (or a one-hot drafter: q is one-hot at x_i);
- one target forward pass gives K_b + 1 *target* rows: p_1..p_K for the drafts and one *bonus*
  row p_{K+1}; p and q are the distributions after the request's sampling pipeline;
- a draft token is *accepted* with probability min(1, p(x)/q(x)) (greedy: when it is the argmax
  of p); at the first rejection a *recovered* token is drawn from normalize(max(p - q, 0)); when
  every draft is accepted, a *bonus* token is drawn from p_{K+1};
- the *emitted* tokens of a request are its accepted drafts followed by one recovered or bonus
  token: num_emitted = num_accepted + 1.

Only one full row per request is ever turned into probabilities: the row of its recovered or
bonus token. Draft rows contribute single probabilities exp(x - logsumexp(row)). No host
synchronisation and no Python loop over requests happen in the step; the only host read is
max K when the caller neither passes it nor keeps cu_num_draft_tokens on the host.

Two backends implement the same contract behind one validation: "native" (_native below,
PyTorch, the CPU path and the test oracle) and "triton" (verispec.sample.kernels, imported only
when used). Which one runs when the caller names none is decided once per device type
(default_backend).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from types import ModuleType

import torch

from . import validation as check
from .metadata import SamplingMetadata
from .penalties import PrecedingTokens, preceding_drafts
from .processors import guide_and_adjust, process_logits
from .rng import ACCEPT, SAMPLE, uniform
from . import block
from .ragged import Layout, emitted_output, layout, leading_run, sample_inverse_cdf
from .types import AdjustedRows, Draft, DraftLogits, DraftProbs, RejectionOutput

BACKENDS = ("native", "triton")
VERIFICATIONS = ("token", "block")
BACKEND_ENV = "VERISPEC_SAMPLER_BACKEND"  # forces the default backend, e.g. for tests


def rejection_sample(
    target_logits: torch.Tensor,  # [num_draft_tokens + B, V]: per request K_b draft rows + 1 bonus row
    draft_token_ids: torch.Tensor,  # [num_draft_tokens] int, requests concatenated
    cu_num_draft_tokens: torch.Tensor,  # [B + 1] int, leading 0
    sampling: SamplingMetadata,
    draft: Draft = None,
    uncond_logits: torch.Tensor | None = None,  # [num_draft_tokens + B, V], CFG rows aligned with target_logits
    max_num_draft_tokens: int | None = None,
    validate: bool = True,
    backend: str | None = None,
    verification: str = "token",
) -> RejectionOutput:
    """Verify every request's drafts against its target rows and emit tokens.

    The emitted sequence of each request is distributed exactly as sampling token by token from
    its target distributions, whatever the drafts. `uncond_logits` is needed when a request
    uses CFG (guidance_scale != 1); its rows for other requests are ignored. `validate` checks
    values too (NaN / +inf logits, ids out of range, offsets), which reads the tensors.
    `backend` is "native" or "triton"; None takes default_backend(target_logits.device.type).
    `verification` is "token" (stop at the first rejected draft) or "block" (Sun et al. 2024,
    verispec.sample.block: never fewer accepted drafts in expectation); "block" runs natively
    whatever the backend, as the Triton kernels implement "token" only.
    """
    if verification not in VERIFICATIONS:
        raise ValueError(f"verification={verification!r} is invalid: expected one of {VERIFICATIONS}")
    if validate:
        max_num_draft_tokens = check_inputs(
            target_logits, draft_token_ids, cu_num_draft_tokens, sampling, draft, uncond_logits
        )
    elif max_num_draft_tokens is None:
        max_num_draft_tokens = int((cu_num_draft_tokens[1:] - cu_num_draft_tokens[:-1]).max())
    adjusted = None
    if sampling.adjustments is not None:
        target_logits, draft, sampling = adjust_rows(
            target_logits, draft_token_ids, cu_num_draft_tokens, sampling, draft, uncond_logits,
            max_num_draft_tokens,
        )
        adjusted = AdjustedRows(target_logits, sampling)
    if verification == "block":
        if backend is not None:
            _check_backend("backend", backend)
        verify = block.verify_block
    elif _backend(backend, target_logits) == "native":
        verify = _native
    else:
        verify = _kernels().rejection_sample_triton
    out = verify(
        target_logits, draft_token_ids, cu_num_draft_tokens, sampling, draft, uncond_logits,
        max_num_draft_tokens,
    )
    return out if adjusted is None else dataclasses.replace(out, adjusted=adjusted)


def adjust_rows(
    target_logits: torch.Tensor,  # [N, V]
    draft_token_ids: torch.Tensor,  # [D]
    cu_num_draft_tokens: torch.Tensor,  # [B + 1]
    sampling: SamplingMetadata,
    draft: Draft,
    uncond_logits: torch.Tensor | None,  # [N, V]
    max_k: int,
) -> tuple[torch.Tensor, Draft, SamplingMetadata]:
    """The pre-stage for penalties, logit bias and token masks of a chain, shared by both
    backends: adjust_with_history, where target row j of a request is penalised with the
    history output + x_1..x_j (the drafts before its prediction), and so is the DraftLogits row
    that proposed x_{j+1}."""
    num_rows, vocab = target_logits.shape
    lay = layout(cu_num_draft_tokens, num_rows, target_logits.device)
    ids = draft_token_ids.to(torch.int64).clamp(0, vocab - 1)
    later = lay.num_draft[lay.req_of_draft] - lay.pos_of_draft  # [D] target rows after each draft
    before_target = preceding_drafts(ids, lay.row_of_draft + 1, later, max_k)
    before_draft = None
    if isinstance(draft, DraftLogits):
        draft_rows = torch.arange(ids.shape[0], device=ids.device)
        before_draft = preceding_drafts(ids, draft_rows + 1, later - 1, max_k)
    return adjust_with_history(
        target_logits, lay.req_of_row, lay.req_of_draft, sampling, draft, uncond_logits, before_target, before_draft
    )


def adjust_with_history(
    target_logits: torch.Tensor,  # [N, V]
    req_of_row: torch.Tensor,  # [N] int64, the request of each target row
    req_of_draft: torch.Tensor,  # [D] int64, the request of each draft row
    sampling: SamplingMetadata,
    draft: Draft,
    uncond_logits: torch.Tensor | None,  # [N, V]
    before_target: PrecedingTokens,
    before_draft: PrecedingTokens | None,  # needed when draft is DraftLogits
) -> tuple[torch.Tensor, Draft, SamplingMetadata]:
    """The pre-stage given each row's drafted history (chains: adjust_rows; trees: the path
    to the row, verispec.sample.tree).

    Rows of requests that adjust their logits leave guided and adjusted (guide_and_adjust),
    their guidance scale set to 1, and `adjustments` dropped from the metadata: each verifier
    then runs its usual pipeline (CFG for the other requests, temperature, filters) unchanged,
    the Triton kernels included. Rows of other requests are returned as they came (as float32).
    """
    adj = sampling.adjustments
    adjusted = guide_and_adjust(target_logits, req_of_row, sampling, uncond_logits, before_target)
    target_logits = torch.where(adj.adjusts[req_of_row][:, None], adjusted, target_logits.float())
    if isinstance(draft, DraftLogits):
        adjusted = guide_and_adjust(draft.logits, req_of_draft, sampling, None, before_draft)
        draft = DraftLogits(torch.where(adj.adjusts[req_of_draft][:, None], adjusted, draft.logits.float()))
    sampling = dataclasses.replace(
        sampling,
        guidance_scale=torch.where(adj.adjusts, 1.0, sampling.guidance_scale),
        any_cfg=adj.guided_unadjusted,
        adjustments=None,
    )
    return target_logits, draft, sampling


def rejection_sample_probs(
    draft_probs: torch.Tensor,  # [B, K, V]
    draft_token_ids: torch.Tensor,  # [B, K] int
    target_probs: torch.Tensor,  # [B, K + 1, V]
    keys: torch.Tensor,  # [B] int64: SamplingMetadata.keys, or rng.request_keys(seeds, steps)
    validate: bool = True,
    backend: str | None = None,
) -> RejectionOutput:
    """Probabilities in, with FlashInfer's chain_speculative_sampling contract.

    For callers whose distributions have already been through their sampling pipeline: every
    request is sampled (no greedy) with the same K, and the rows are the p and q of docs/design.md
    as they are. Random numbers come from `keys` as in rejection_sample, so a request's
    acceptance decisions do not depend on the rest of the batch.
    """
    if validate:
        _validate_probs(draft_probs, draft_token_ids, target_probs, keys)
    if _backend(backend, target_probs) == "native":
        verify = _native_probs
    else:
        verify = _kernels().rejection_sample_probs_triton
    return verify(draft_probs, draft_token_ids, target_probs, keys)


@functools.lru_cache(maxsize=None)
def default_backend(device_type: str) -> str:
    """The backend used when the caller names none, decided once per device type (cached):
    $VERISPEC_SAMPLER_BACKEND when set, else "triton" for CUDA tensors when triton imports,
    else "native"."""
    forced = os.environ.get(BACKEND_ENV)
    if forced:
        return _check_backend(BACKEND_ENV, forced)
    return "triton" if device_type == "cuda" and _triton_importable() else "native"


def _backend(backend: str | None, tensor: torch.Tensor) -> str:
    if backend is None:
        name = default_backend(tensor.device.type)
    else:
        name = _check_backend("backend", backend)
        if name == "triton" and not _triton_importable():
            raise ValueError(
                "backend='triton' is unavailable: triton is not installed (pip install verispec[triton])"
            )
    # Triton compiles for a GPU; only its interpreter runs kernels on CPU tensors.
    if name == "triton" and tensor.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 to interpret the kernels), "
            f"got tensors on {tensor.device}"
        )
    return name


def _check_backend(name: str, value: object) -> str:
    if value not in BACKENDS:
        raise ValueError(f"{name}={value!r} is invalid: expected one of {BACKENDS}")
    return value


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _kernels() -> ModuleType:
    """verispec.sample.kernels, imported on first use: triton is an optional dependency."""
    from . import kernels

    return kernels


def _validate_probs(
    draft_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    target_probs: torch.Tensor,
    keys: torch.Tensor,
) -> None:
    check.check_tensor("target_probs", target_probs, 3, floating=True)
    device = target_probs.device
    batch, slots, vocab = target_probs.shape
    check.check_tensor("draft_probs", draft_probs, 3, floating=True, device=device)
    check.check_shape("draft_probs", draft_probs, (batch, slots - 1, vocab))
    check.check_tensor("draft_token_ids", draft_token_ids, 2, integer=True, device=device)
    check.check_shape("draft_token_ids", draft_token_ids, (batch, slots - 1))
    check.check_tensor("keys", keys, 1, integer=True, device=device)
    check.check_shape("keys", keys, (batch,))
    check.check_prob_values("target_probs", target_probs.reshape(-1, vocab))
    check.check_prob_values("draft_probs", draft_probs.reshape(-1, vocab))
    check.check_token_ids("draft_token_ids", draft_token_ids, vocab)


def _native_probs(
    draft_probs: torch.Tensor,  # [B, K, V]
    draft_token_ids: torch.Tensor,  # [B, K]
    target_probs: torch.Tensor,  # [B, K + 1, V]
    keys: torch.Tensor,  # [B]
) -> RejectionOutput:
    """log p as logits: softmax(log p) = p, so _native at temperature 1 without filters samples p."""
    batch, k, vocab = draft_probs.shape
    device = target_probs.device
    ones = torch.ones(batch, device=device)
    zeros = torch.zeros(batch, device=device)
    sampling = SamplingMetadata(
        temperature=ones, top_k=zeros.long(), top_p=ones, min_p=zeros, guidance_scale=ones,
        keys=keys, is_greedy=zeros.bool(), all_greedy=False, all_random=True,
        any_top_k=False, any_top_p=False, any_min_p=False, any_cfg=False,
    )
    return _native(
        target_probs.reshape(batch * (k + 1), vocab).float().log(),
        draft_token_ids.reshape(batch * k),
        torch.arange(batch + 1, device=device) * k,
        sampling,
        DraftProbs(draft_probs.reshape(batch * k, vocab)),
        None,
        k,
    )


def check_inputs(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    sampling: SamplingMetadata,
    draft: Draft,
    uncond_logits: torch.Tensor | None,
    ids_name: str = "draft_token_ids",
    cu_name: str = "cu_num_draft_tokens",
) -> int:
    """All checks; returns max K. The names are those of the caller's arguments (the tree
    verifier passes its node_token_ids and cu_num_nodes)."""
    if not isinstance(sampling, SamplingMetadata):
        raise TypeError(f"sampling is {type(sampling).__name__}: expected SamplingMetadata")
    check.check_tensor("target_logits", target_logits, 2, floating=True)
    device = target_logits.device
    check.check_tensor(ids_name, draft_token_ids, 1, integer=True, device=device)
    check.check_tensor(cu_name, cu_num_draft_tokens, 1, integer=True)
    batch, num_draft = sampling.batch_size, draft_token_ids.shape[0]
    vocab = target_logits.shape[1]
    counts = check.check_offsets(cu_name, cu_num_draft_tokens, batch, num_draft)
    check.check_shape("target_logits", target_logits, (num_draft + batch, vocab))
    check.check_logit_values("target_logits", target_logits)
    check.check_token_ids(ids_name, draft_token_ids, vocab)
    if sampling.temperature.device != device:
        raise ValueError(f"sampling is on {sampling.temperature.device}: expected {device}")
    if sampling.any_cfg:
        if uncond_logits is None:
            raise ValueError(
                "uncond_logits is None but a request has guidance_scale != 1: expected the "
                "unconditional logits, row-aligned with target_logits"
            )
        check.check_tensor("uncond_logits", uncond_logits, 2, floating=True, device=device)
        check.check_shape("uncond_logits", uncond_logits, tuple(target_logits.shape))
        check.check_logit_values("uncond_logits", uncond_logits)
    if isinstance(draft, DraftProbs):
        check.check_tensor("draft.probs", draft.probs, 2, floating=True, device=device)
        check.check_shape("draft.probs", draft.probs, (num_draft, vocab))
        check.check_prob_values("draft.probs", draft.probs)
    elif isinstance(draft, DraftLogits):
        check.check_tensor("draft.logits", draft.logits, 2, floating=True, device=device)
        check.check_shape("draft.logits", draft.logits, (num_draft, vocab))
        check.check_logit_values("draft.logits", draft.logits)
    elif draft is not None:
        raise TypeError(f"draft is {type(draft).__name__}: expected DraftProbs, DraftLogits or None")
    return max(counts, default=0)


def _native(
    target_logits: torch.Tensor,  # [N, V]
    draft_token_ids: torch.Tensor,  # [D]
    cu_num_draft_tokens: torch.Tensor,  # [B + 1]
    sampling: SamplingMetadata,
    draft: Draft,
    uncond_logits: torch.Tensor | None,  # [N, V]
    max_k: int,
) -> RejectionOutput:
    num_rows, vocab = target_logits.shape
    device = target_logits.device
    lay = layout(cu_num_draft_tokens, num_rows, device)
    target = process_logits(target_logits, lay.req_of_row, sampling, uncond_logits)  # [N, V]
    row_argmax = target.max(dim=-1).indices

    # Out-of-range ids (possible only without validation) are rejected, never emitted.
    ids = draft_token_ids.to(torch.int64)
    in_range = (ids >= 0) & (ids < vocab)
    ids = ids.clamp(0, vocab - 1)
    # Rule 4: greedy requests accept while the draft is the target argmax.
    accept = ids == row_argmax[lay.row_of_draft]
    if not sampling.all_greedy and ids.numel() > 0:  # without drafts, nothing to judge
        # Rule 1: accept x with probability min(1, p/q) as u * q < p; q = 0 rejects.
        row_lse = torch.logsumexp(target, dim=-1)
        p_draft = (target[lay.row_of_draft, ids] - row_lse[lay.row_of_draft]).exp()
        if isinstance(draft, DraftLogits):
            draft_rows = process_logits(draft.logits, lay.req_of_draft, sampling)  # [D, V]
            draft_lse = torch.logsumexp(draft_rows, dim=-1)
            q_draft = (draft_rows.gather(1, ids[:, None])[:, 0] - draft_lse).exp()
        elif isinstance(draft, DraftProbs):
            q_draft = draft.probs.gather(1, ids[:, None])[:, 0].float()
        else:
            q_draft = torch.ones_like(p_draft)
        u = uniform(sampling.keys[lay.req_of_draft], lay.pos_of_draft, ACCEPT)
        sampled_accept = (q_draft > 0) & (u * q_draft.double() < p_draft.double())
        accept = torch.where(sampling.is_greedy[lay.req_of_draft], accept, sampled_accept)
    accept &= in_range
    num_accepted = leading_run(accept, lay, max_k)

    # Rules 2 and 3: one row per request yields the recovered or bonus token.
    final_row = lay.draft_start + torch.arange(num_accepted.shape[0], device=device) + num_accepted
    final_token = row_argmax[final_row]
    if not sampling.all_greedy:
        sampled = _sample_final(
            target[final_row], lay, num_accepted, ids, draft, sampling, in_range
        )
        final_token = torch.where(sampling.is_greedy, final_token, sampled)

    return emitted_output(ids, lay, num_accepted, final_token, max_k)


def _sample_final(
    final_rows: torch.Tensor,  # [B, V] processed target logits at each request's final row
    lay: Layout,
    num_accepted: torch.Tensor,  # [B]
    ids: torch.Tensor,  # [D] clamped draft ids
    draft: Draft,
    sampling: SamplingMetadata,
    in_range: torch.Tensor,  # [D] bool
) -> torch.Tensor:  # [B] int64
    p = final_rows.softmax(dim=-1)
    rejected = num_accepted < lay.num_draft
    if ids.numel() > 0:
        final_draft = (lay.draft_start + num_accepted).clamp(max=ids.shape[0] - 1)
        # A slot whose id is out of range (a caller's -1 placeholder) drafted nothing, so
        # nothing was rejected there: its token follows p, whatever q says.
        residual = rejected & in_range[final_draft]
        if draft is None:
            # One-hot q: the residual max(p - q, 0) is p with the rejected token removed.
            weights = p.scatter(1, ids[final_draft][:, None], 0.0)
            weights = torch.where(residual[:, None], weights, p)
        else:
            if isinstance(draft, DraftLogits):
                q_rows = process_logits(
                    draft.logits[final_draft], lay.req_of_draft[final_draft], sampling
                ).softmax(dim=-1)
            else:
                q_rows = draft.probs[final_draft].float()
            weights = torch.where(residual[:, None], (p - q_rows).clamp(min=0), p)
        # A residual with no mass means the rejection had probability 0: fall back to p.
        weights = torch.where(weights.sum(dim=-1, keepdim=True) > 0, weights, p)
    else:
        weights = p
    u = uniform(sampling.keys, num_accepted, SAMPLE)
    return sample_inverse_cdf(weights, u)
