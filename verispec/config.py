"""Engine configuration: frozen dataclasses, validated on construction, never mutated."""

from __future__ import annotations

from dataclasses import dataclass


def _require(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: expected {expected}")


MAX_TREE_NODES = 64


def tree_size(shape: tuple[int, ...] | DynamicTree) -> int:
    """Nodes of a static tree with branching factor shape[d] at depth d + 1, or a dynamic
    tree's node budget."""
    if isinstance(shape, DynamicTree):
        return shape.nodes
    total, width = 0, 1
    for branching in shape:
        width *= branching
        total += width
    return total


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's dynamic draft tree (verispec/spec_decode/trees.py): at most `nodes` nodes, `depth` levels,
    `top_k` nodes expanded per level with `top_k` children each."""

    nodes: int = 16
    depth: int = 5
    top_k: int = 4

    def __post_init__(self) -> None:
        for name, low, high in (("nodes", 1, MAX_TREE_NODES), ("depth", 1, 16), ("top_k", 1, 16)):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and low <= value <= high,
                     f"DynamicTree {name}", value, f"an integer in [{low}, {high}]")

    def max_fed_nodes(self) -> int:
        """The most nodes one expansion round feeds: the expanded nodes and their ancestors."""
        return self.top_k * max(1, self.depth - 1)


TreeShape = tuple[int, ...] | DynamicTree


def parse_tree(text: str) -> TreeShape:
    """A tree from its command-line form: "3,2,1" (a static shape) or
    "dynamic[:NODES[,DEPTH[,TOP_K]]]" (a DynamicTree, defaults for what is left out).
    ValueError naming the text otherwise."""
    dynamic = text == "dynamic" or text.startswith("dynamic:")
    fields = text[len("dynamic:"):].split(",") if text.startswith("dynamic:") else [] if dynamic else text.split(",")
    try:
        values = tuple(int(v) for v in fields)
    except ValueError:
        values = None
    if dynamic and values is not None and len(values) <= 3:
        return DynamicTree(*values)
    if not dynamic and values and min(values) >= 1:
        return values
    raise ValueError(f"tree {text!r} is invalid: expected branching factors >= 1 separated by commas "
                     "(e.g. 3,2,1) or dynamic[:NODES[,DEPTH[,TOP_K]]] (e.g. dynamic:16,5,4)")


def _positive_int(name: str, value: object) -> None:
    _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name, value, "an integer >= 1")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: `num_blocks` blocks of `block_size` token slots, per model.

    enable_prefix_caching: keep the full blocks of committed tokens under a hash of their whole
        token prefix and let later requests with the same prefix start from them (vLLM's
        automatic prefix caching; verispec/runtime/prefix_cache.py). Output is the same either way.
    free_out_of_window: with a model whose every layer has a sliding window (Mistral), give the
        blocks that fell behind every query's window back to the pool (runtime/kv_cache.py), so a
        sequence holds about window + one step's tokens, not its whole length. Output is the
        same either way; False keeps them (the memory of full attention).
    """

    block_size: int = 16
    num_blocks: int = 1024
    enable_prefix_caching: bool = True
    free_out_of_window: bool = True

    def __post_init__(self) -> None:
        _positive_int("block_size", self.block_size)
        _positive_int("num_blocks", self.num_blocks)
        _require(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching",
                 self.enable_prefix_caching, "True or False")
        _require(isinstance(self.free_out_of_window, bool), "free_out_of_window",
                 self.free_out_of_window, "True or False")


@dataclass(frozen=True)
class DraftCost:
    """What one drafting call costs, in units of the target step's fixed cost a (the cost of a
    target pass with no rows, spec_decode/adaptive.py): for `num_requests` drafting requests, the
    deepest getting `depth` drafts,

        per_call + per_request * num_requests + depth * (per_position + per_row * num_requests),

    and nothing when nobody drafts. per_position prices a drafter that runs one pass per draft
    position (the pass's fixed cost), per_row what each request adds to such a pass. The declared
    numbers price seeded requests (K decides which random numbers a seeded request consumes, so
    it must not depend on how fast this machine happened to be) and are where the engine's
    learned prices start (SpeculativeConfig.learn_costs).
    """

    per_call: float = 0.0
    per_request: float = 0.0
    per_position: float = 0.0
    per_row: float = 0.0

    def __post_init__(self) -> None:
        for name in ("per_call", "per_request", "per_position", "per_row"):
            value = getattr(self, name)
            _require(isinstance(value, (int, float)) and not isinstance(value, bool)
                     and 0 <= value < float("inf"), name, value, "a finite number >= 0")

    def __call__(self, depth: int, num_requests: int) -> float:
        if depth <= 0 or num_requests <= 0:
            return 0.0
        return (self.per_call + self.per_request * num_requests
                + depth * (self.per_position + self.per_row * num_requests))


METHODS = ("ngram", "draft_model", "eagle", "medusa", "ngram+eagle", "ngram+medusa", "none")
LEARNED_METHODS = ("eagle", "medusa", "ngram+eagle", "ngram+medusa")  # those that take a head file


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to draft.

    method: "ngram" (prompt lookup, no model), "draft_model" (a smaller model sharing the target's
        tokenizer, given by `draft_model`), "eagle" / "medusa" (learned heads on the target's
        hidden states: `draft_model` names a head file, or None for the heads shipped for the
        embedded model), "ngram+eagle" / "ngram+medusa" (prompt lookup for a request whose
        context has a match of 2 tokens or more, the head otherwise; spec_decode/hybrid.py), or "none".
    num_speculative_tokens: K, the most draft tokens per request per step.
    ngram_min / ngram_max: n-gram sizes tried, longest first.
    adaptive: choose each request's K per step from its acceptance so far, and trim the step's
        drafts together against the step's cost (spec_decode/adaptive.py), never above
        num_speculative_tokens; with a tree, draft each request's whole tree or nothing by
        the same cost model (spec_decode/adaptive.py's TreeGate); off: always num_speculative_tokens
        (every tree node).
    row_cost: for `adaptive`, the cost of one more row in a forward pass relative to the
        pass's fixed cost; None takes the target's own (LlamaModel.row_cost: 0.1 for float
        weights, 0.6 for quantized ones, whose one-row pass is memory-bound and cheap).
    draft_cost: for `adaptive`, what drafting costs relative to the same fixed cost (a
        DraftCost); None takes the drafter's own declaration (Drafter.draft_cost).
    learn_costs: for `adaptive` with row_cost and draft_cost None, learn both from the step
        times the engine sees, starting from the declared ones or from what the last engine on
        this machine learned (spec_decode/cost_learner.py); seeded requests keep the declared
        ones. False: the declared constants throughout.
    verification: how drafts are verified, both exact: "token" (accept draft by draft, stop at
        the first rejection) or "block" (Sun et al. 2024: judge the drafts as a block; never
        fewer accepted drafts in expectation; verispec/sample/block.py).
    tree: tree speculation with a static tree shape, the branching factor at each depth (e.g.
        (3, 2, 1): 3 children of the root, 2 children of each, 1 child of each of those: 15
        nodes), or a DynamicTree grown by draft confidence (EAGLE-2; drafters without their own
        tree drafts draft one chain), verified exactly with verispec/sample/tree.py; None: chains of
        num_speculative_tokens drafts. With a tree, a request drafts up to the tree's node count
        (num_speculative_tokens does not apply; `verification` must be "token").
    """

    method: str = "none"
    num_speculative_tokens: int = 5
    draft_model: str | None = None
    ngram_min: int = 1
    ngram_max: int = 3
    adaptive: bool = True
    row_cost: float | None = None
    draft_cost: DraftCost | None = None
    learn_costs: bool = True
    verification: str = "token"
    tree: TreeShape | None = None

    def __post_init__(self) -> None:
        _require(self.method in METHODS, "method", self.method, f"one of {METHODS}")
        _require(
            isinstance(self.num_speculative_tokens, int) and 0 <= self.num_speculative_tokens <= 64,
            "num_speculative_tokens", self.num_speculative_tokens, "an integer in [0, 64]",
        )
        _require(self.draft_model is not None if self.method == "draft_model"
                 else self.draft_model is None or self.method in LEARNED_METHODS, "draft_model",
                 self.draft_model, "a model path for method 'draft_model', optionally a head file "
                 f"for {LEARNED_METHODS}, None otherwise")
        _positive_int("ngram_min", self.ngram_min)
        _require(isinstance(self.ngram_max, int) and self.ngram_max >= self.ngram_min, "ngram_max",
                 self.ngram_max, f"an integer >= ngram_min ({self.ngram_min})")
        _require(self.row_cost is None or isinstance(self.row_cost, (int, float)) and self.row_cost > 0,
                 "row_cost", self.row_cost, "a number > 0 or None")
        _require(isinstance(self.learn_costs, bool), "learn_costs", self.learn_costs, "True or False")
        if self.draft_cost is not None and not isinstance(self.draft_cost, DraftCost):
            raise TypeError(f"draft_cost={self.draft_cost!r} is a {type(self.draft_cost).__name__}: "
                            "expected a DraftCost or None")
        _require(self.verification in ("token", "block"), "verification", self.verification,
                 "'token' or 'block'")
        if self.tree is not None and not isinstance(self.tree, DynamicTree):
            _require(isinstance(self.tree, tuple) and 0 < len(self.tree)
                     and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in self.tree)
                     and tree_size(self.tree) <= MAX_TREE_NODES, "tree", self.tree,
                     f"a non-empty tuple of branching factors >= 1 with at most {MAX_TREE_NODES} nodes in all")
        if self.tree is not None:
            _require(self.verification == "token", "verification", self.verification,
                     "'token' with a tree")

    @property
    def num_draft_tokens(self) -> int:
        """The most draft tokens (tree nodes) a request verifies per step."""
        return self.num_speculative_tokens if self.tree is None else tree_size(self.tree)

    @property
    def enabled(self) -> bool:
        return self.method != "none" and self.num_draft_tokens > 0


@dataclass(frozen=True)
class StructuredOutputConfig:
    """Limits on structured-output grammars (verispec/structured/), each refused with a
    ValueError (a 400 from the server) that names it.

    max_grammar_bytes: largest JSON schema (as JSON), regex or grammar text.
    max_schema_depth: deepest nesting of a JSON schema document.
    compile_timeout_s: most seconds compiling one grammar may take (llguidance's own fuel limits
        bound it too).
    cache_size: compiled grammars kept, least recently used dropped first.
    """

    max_grammar_bytes: int = 256 * 1024
    max_schema_depth: int = 32
    compile_timeout_s: float = 10.0
    cache_size: int = 64

    def __post_init__(self) -> None:
        _positive_int("max_grammar_bytes", self.max_grammar_bytes)
        _positive_int("max_schema_depth", self.max_schema_depth)
        _positive_int("cache_size", self.cache_size)
        t = self.compile_timeout_s
        _require(isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < float("inf"),
                 "compile_timeout_s", t, "a finite number of seconds > 0")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's limits.

    max_num_seqs: most requests in one step.
    max_num_batched_tokens: most tokens (prompt chunks + last tokens + drafts) in one step; a
        longer prompt is prefilled in chunks.
    max_model_len: most tokens (prompt + output) per sequence; a request's max_tokens is lowered
        to fit it (its CFG companion's negative prompt included).
    structured: limits and cache of structured-output grammars (StructuredOutputConfig).
    static_step: run decode and verify steps padded to fixed shapes over persistent buffers
        (runtime/static_step.py); None: on CUDA only (on the CPU the ordinary step is as fast,
        and the CPU tests run both). Exactness is the same either way; on a GPU the products of
        a padded step may round as those of another batch size do.
    enforce_eager: with the static step on CUDA, False replays its steps as CUDA graphs
        (runtime/cuda_graphs.py); True runs every kernel eagerly (vLLM's name). A replayed step
        gives the eager step's logits bit for bit.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 8192
    cache: CacheConfig = CacheConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    structured: StructuredOutputConfig = StructuredOutputConfig()
    static_step: bool | None = None
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        _positive_int("max_num_seqs", self.max_num_seqs)
        _require(self.static_step is None or isinstance(self.static_step, bool), "static_step", self.static_step, "True, False or None")
        _require(isinstance(self.enforce_eager, bool), "enforce_eager", self.enforce_eager, "True or False")
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("max_model_len", self.max_model_len)
        k = self.speculative.num_speculative_tokens if self.speculative.enabled else 0
        _require(self.max_num_batched_tokens > k, "max_num_batched_tokens", self.max_num_batched_tokens,
                 f"more than num_speculative_tokens ({k}), so a decode step fits")


@dataclass(frozen=True)
class ServeLimits:
    """What one client may take of `verispec serve` (serve/limits.py).

    max_request_bytes: largest request body (413 beyond). max_choices: most sequences one
    request may queue, n x prompts (OpenAI caps n at 128). header_timeout_s / body_timeout_s:
    time a client has to send a request's headers / its body. max_connections: open connections
    (and requests) before new ones get 503. stall_s: /health answers 503 when the engine thread
    has been inside one step or command this long while work is queued."""

    max_request_bytes: int = 8 * 1024 * 1024
    max_choices: int = 128
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 256
    stall_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_choices", "max_connections"):
            _positive_int(name, getattr(self, name))
        for name in ("header_timeout_s", "body_timeout_s", "stall_s"):
            value = getattr(self, name)
            _require(not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0, name, value,
                     "a number of seconds > 0")
