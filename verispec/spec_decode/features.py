"""FeatureStore: the target hidden states a learned drafter has seen, per request.

Terms: an *entry* holds the features of consecutive positions start, start + 1, ... of one
request, with the token at each position. The engine hands over the features of every fed
token, rejected drafts included (spec_decode/base.py, FedTokens); `confirm` keeps only the prefix the
request's tokens agree with. A feature depends on its token and every token before it (the
target is causal), so a stored feature whose token matches the request's is the true one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .base import FedTokens


@dataclass
class _Entry:
    start: int
    tokens: list[int] = field(default_factory=list)
    chunks: list[torch.Tensor] = field(default_factory=list)  # [n_i, F] each, positions in order

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def truncate(self, end: int) -> None:
        """Keeps positions < end."""
        keep = max(0, end - self.start)
        if keep >= len(self.tokens):  # the usual case, a feed right after the stored positions
            return
        del self.tokens[keep:]
        kept, total = [], 0
        for chunk in self.chunks:
            if total >= keep:
                break
            kept.append(chunk[: keep - total])
            total += kept[-1].shape[0]
        self.chunks = kept


class FeatureStore:
    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def observe(
        self,
        fed: Sequence[FedTokens],
        hidden: torch.Tensor,  # [T, F], rows as `fed` says
    ) -> None:
        for f in fed:
            entry = self._entries.get(f.request_id)
            if entry is None or not entry.start <= f.start <= entry.end:
                # A gap (state released mid-request): start over where the feed starts.
                entry = self._entries[f.request_id] = _Entry(f.start)
            entry.truncate(f.start)
            entry.tokens.extend(f.token_ids)
            # A copy: a view would keep the whole batch's hidden states alive.
            entry.chunks.append(hidden[f.first_row : f.first_row + len(f.token_ids)].clone())

    def confirm(self, request_id: str, token_ids: Sequence[int]) -> tuple[int, int]:
        """Drops stored positions the request's tokens disagree with; returns the range
        [start, end) of positions whose features are known ((0, 0) when none)."""
        entry = self._entries.get(request_id)
        if entry is None:
            return 0, 0
        end = entry.start
        while end < min(entry.end, len(token_ids)) and entry.tokens[end - entry.start] == token_ids[end]:
            end += 1
        entry.truncate(end)
        return entry.start, end

    def features(self, request_id: str, begin: int, end: int) -> torch.Tensor:  # [end - begin, F]
        """Stored features of positions [begin, end), which `confirm` reported known."""
        entry = self._entries[request_id]
        if not entry.start <= begin <= end <= entry.end:
            raise ValueError(f"positions [{begin}, {end}) of request {request_id!r} are not stored "
                             f"(stored: [{entry.start}, {entry.end}))")
        return torch.cat(entry.chunks)[begin - entry.start : end - entry.start]

    def drop_before(self, request_id: str, position: int) -> None:
        """Forgets positions < position: a drafter that no longer needs them saves memory."""
        entry = self._entries.get(request_id)
        if entry is None or position <= entry.start:
            return
        rest = torch.cat(entry.chunks)[position - entry.start :] if entry.chunks else None
        del entry.tokens[: position - entry.start]
        entry.chunks = [rest.clone()] if rest is not None and rest.shape[0] else []
        entry.start = position

    def tokens(self, request_id: str) -> tuple[int, list[int]]:
        """(start, the stored tokens from start on)."""
        entry = self._entries[request_id]
        return entry.start, list(entry.tokens)

    def release(self, request_id: str) -> None:
        self._entries.pop(request_id, None)
