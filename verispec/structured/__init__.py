"""Structured output: grammar-constrained decoding (JSON schema, JSON object, regex, Lark / GBNF
grammars), exact under speculation. The grammar engine is llguidance (docs/design.md,
"Structured output")."""

from .compiler import GrammarCompiler
from .matcher import GrammarError, GrammarMatcher, apply_token_mask, chain_prefixes, tree_prefixes
from .spec import GrammarSpec

__all__ = ["GrammarCompiler", "GrammarError", "GrammarMatcher", "GrammarSpec", "apply_token_mask", "chain_prefixes",
           "tree_prefixes"]
