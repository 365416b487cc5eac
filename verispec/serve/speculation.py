"""The `speculation` extension of streamed chunks: how each streamed token came to be.

Asked for with `"stream_options": {"include_speculation": true}` (off by default, so OpenAI's
clients see OpenAI's chunks). Each chunk whose step emitted tokens then carries, in its choice,

    "speculation": {"step": 4, "drafted": 3, "accepted": 2,
                    "tokens": [{"id": 9906, "text": " Hello", "origin": "accepted"}, ...]}

step: the sequence's verify step (from 1); drafted / accepted: its draft tokens (tree nodes)
and how many were accepted; tokens: the tokens the step emitted, in order, each with its origin
(spec_decode/trace.py: "accepted", "recovered", "bonus" or "plain") and its text. The tokens'
texts join into the sequence's text as generated, before a stop string is cut off it: a token
that ends inside a multi-byte character has text "" and the token that completes it carries the
character. A stream asking for it also gets a chunk (with an empty delta) for a step whose text
is held back, so every emitted token is reported once.
"""

from __future__ import annotations

from ..config import SpeculativeConfig
from ..engine.engine import RequestOutput
from ..model import IncrementalDecoder, Tokenizer


class SpeculationTrace:
    """The extension of one streamed response, per choice."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        # A decoder of its own per choice: the engine's lives on the engine thread.
        self._decoders: dict[int, IncrementalDecoder] = {}

    def of(self, index: int, out: RequestOutput) -> dict | None:
        """The extension for choice `index`'s output; None when its step emitted nothing."""
        record = out.new_step
        if record is None or not out.new_token_ids:
            return None
        decoder = self._decoders.get(index)
        if decoder is None:
            decoder = self._decoders[index] = self.tokenizer.incremental_decoder(context=out.prompt_token_ids)
        origins = record.origins(len(out.new_token_ids))
        tokens = [{"id": t, "text": decoder.push([t]), "origin": o.value}
                  for t, o in zip(out.new_token_ids, origins)]
        return {"step": record.step, "drafted": record.num_draft, "accepted": record.num_accepted,
                "tokens": tokens}


def describe_drafter(config: SpeculativeConfig) -> str:
    """The drafter in words, for people: its method and what bounds its drafts."""
    if not config.enabled:
        return "none (no speculation)"
    name = config.method
    if config.draft_model is not None:
        name += f" ({config.draft_model.rstrip('/').rsplit('/', 1)[-1]})"
    if config.tree is not None:
        shape = config.tree if isinstance(config.tree, tuple) else "dynamic"
        name += f", tree {shape} of {config.num_draft_tokens} nodes"
    else:
        name += f", up to {config.num_speculative_tokens} drafts a step"
    if config.adaptive:
        name += ", adaptive"
    if config.verification == "block":
        name += ", block verification"
    return name
