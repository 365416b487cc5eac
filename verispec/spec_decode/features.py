"""FeatureStore: the target hidden states a learned drafter has seen, per request.

Terms: a *segment* holds the features of consecutive positions start, start + 1, ... of one
request, with the token at each position; a request's segments are disjoint and in position
order, and the positions between them are *holes*: fed in passes that captured no hidden
states (the engine skips capturing while no request is about to draft, LLMEngine) or taken
from the target's prefix cache. The engine hands over the features of every fed token,
rejected drafts included (spec_decode/base.py, FedTokens); `confirm` keeps only what the
request's tokens agree with. A feature depends on its token and every token before it (the
target is causal), so a stored feature whose token matches the request's is the true one:
a feed at position p rewrites what the target holds from p on, so it drops every stored
position >= p, and the positions in a hole are ones the target kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .base import FedTokens


@dataclass
class _Segment:
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

    def rows(self, begin: int, end: int) -> torch.Tensor:  # [end - begin, F], within the segment
        return torch.cat(self.chunks)[begin - self.start : end - self.start]


class FeatureStore:
    def __init__(self) -> None:
        self._segments: dict[str, list[_Segment]] = {}

    def observe(
        self,
        fed: Sequence[FedTokens],
        hidden: torch.Tensor,  # [T, F], rows as `fed` says
    ) -> None:
        for f in fed:
            segments = self._cut(f.request_id, f.start)
            if not segments or segments[-1].end != f.start:
                segments.append(_Segment(f.start))
            segments[-1].tokens.extend(f.token_ids)
            # A copy: a view would keep the whole batch's hidden states alive.
            segments[-1].chunks.append(hidden[f.first_row : f.first_row + len(f.token_ids)].clone())

    def _cut(self, request_id: str, position: int) -> list[_Segment]:
        """The request's segments without positions >= position."""
        segments = self._segments.setdefault(request_id, [])
        while segments and segments[-1].start >= position:
            segments.pop()
        if segments:
            segments[-1].truncate(position)
        return segments

    def confirm(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Drops stored positions the request's tokens disagree with, and the rest of their
        segment (computed over the disagreeing token). A later segment was computed after
        every earlier one (a feed drops what lies after it), over tokens the request had
        kept, so it stands on its own."""
        segments = self._segments.get(request_id, [])
        for segment in segments:
            end = segment.start
            while end < min(segment.end, len(token_ids)) and segment.tokens[end - segment.start] == token_ids[end]:
                end += 1
            segment.truncate(end)
        segments[:] = [s for s in segments if s.tokens]

    def known(self, request_id: str, position: int) -> bool:
        """Whether the feature of `position` is stored."""
        return any(s.start <= position < s.end for s in self._segments.get(request_id, []))

    def first_hole(self, request_id: str, begin: int, end: int) -> int | None:
        """The first position in [begin, end) whose feature is not stored (None: all are)."""
        position = begin
        for segment in self._segments.get(request_id, []):
            if segment.end <= position:
                continue
            if segment.start > position:
                break
            position = segment.end
        return position if position < end else None

    def features(self, request_id: str, begin: int, end: int) -> torch.Tensor:  # [end - begin, F]
        """The features of positions [begin, end), zero in holes (a learned drafter reads a
        hole as "no feature": drafts only change speed, never the output). At least one
        position of the request must be stored (its F and dtype come from there)."""
        segments = self._segments.get(request_id, [])
        if not segments:
            raise ValueError(f"no features of request {request_id!r} are stored")
        inside = [s for s in segments if s.start < end and s.end > begin]
        if len(inside) == 1 and inside[0].start <= begin and inside[0].end >= end:
            return inside[0].rows(begin, end)  # the usual case: no hole
        like = segments[0].chunks[0]
        out = like.new_zeros((end - begin, like.shape[1]))
        for s in inside:
            lo, hi = max(begin, s.start), min(end, s.end)
            out[lo - begin : hi - begin] = s.rows(lo, hi)
        return out

    def drop_before(self, request_id: str, position: int) -> None:
        """Forgets positions < position: a drafter that no longer needs them saves memory."""
        segments = self._segments.get(request_id)
        if not segments:
            return
        while segments and segments[0].end <= position:
            segments.pop(0)
        if segments and segments[0].start < position:
            first = segments[0]
            rest = first.rows(position, first.end)
            del first.tokens[: position - first.start]
            first.chunks, first.start = [rest.clone()], position

    def tokens(self, request_id: str) -> tuple[int, list[int]]:
        """(start, the stored tokens from start on) of the request's first segment."""
        segments = self._segments.get(request_id)
        if not segments:
            raise KeyError(request_id)
        return segments[0].start, list(segments[0].tokens)

    def release(self, request_id: str) -> None:
        self._segments.pop(request_id, None)
