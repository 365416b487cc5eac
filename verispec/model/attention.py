"""Causal attention for a ragged batch against a paged KV cache, on torch's SDPA.

Terms used throughout:
- new tokens: the tokens of one forward pass, the query rows; T of them in all, n_b for
  sequence b, concatenated in batch order.
- seq_len S_b: tokens in sequence b's cache AFTER this step's new tokens are written. The new
  tokens sit at positions S_b - n_b .. S_b - 1; the cache already holds positions < S_b - n_b.
- block: block_size consecutive cache slots. A sequence's block table lists its blocks in
  position order; position p lives in slot block_table[p // block_size] * block_size
  + p % block_size.
- KV cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim], keys at index 0,
  values at 1.
- tree: optionally, the new tokens of a sequence form a tree instead of a chain (tree
  speculation: the pending tokens, then draft nodes branching from the last of them). Its
  parents list gives, for each new row, the new row it follows (-1: it follows the cached
  context directly). A row attends to the cached context and to its own ancestors (itself
  included) only, and its rotary position is S_b - n_b + depth (depth 0 for a row with parent
  -1): where it would sit on its own path. Its key/value still goes to cache position
  S_b - n_b + row; moving an accepted path to consecutive positions is the caller's affair.

How a batch is attended (decided once per forward by AttentionPlan, shared by all layers):
- sequences with at most MAX_PADDED_QUERY_LEN new tokens (decode steps, speculative verify steps,
  short prompts) are attended together: their blocks are gathered into one padded
  [batch, max_seq_len] key/value tensor and their queries into a padded [batch, max_query_len]
  one, with a boolean mask for causality and padding: one SDPA call for the lot.
- longer sequences (prefill chunks) are attended one at a time, where padding would waste more
  than the call costs. A chunk with no cached context attends to its own keys directly.

Sliding-window layers (ModelConfig.sliding_window) get their own plan, whose masks also hide
keys at positions <= p - window from a query at (rotary) position p. When every layer slides,
the engine releases the blocks behind every query's window (runtime/kv_cache.py); their block
table entries then point at block 0, whose keys the masks hide (a masked key's weight is
exactly 0, so results are bit for bit those with the blocks kept). Scores may be scaled by
other than head_dim ** -0.5 and soft-capped (cap * tanh(s / cap), Gemma 2); SDPA has no soft
cap, so capped attention runs as explicit products and a softmax.

A step whose shapes are fixed per bucket (runtime/static_step.py: decode and verify rows padded to
a bucket of sequences x rows, replayable as a CUDA graph) describes its rows on the device instead
(RowLayout): each row's block-table row and how many positions it sees. Its plan is built from
those tensors alone, with no host-side lengths, and every row is attended row by row
(verispec.model.row_attention: the compiled kernel on the CPU, a Triton kernel on CUDA), reading
the block table on the device rather than gathering blocks into tensors of the step's own size.

With `rowwise` (quantized models, whose int8 activations magnify any difference, and CPU
float32 models), every sequence is attended by the compiled row-by-row kernel instead
(verispec.cpu_kernels, csrc/attention.h), float32 models' long prefill chunks excepted
(`rowwise_max_query`, model/llama.py: the kernel's cost grows with the square of a chunk):
each (row, head) on its own straight from the paged cache, so a row's result depends neither on
the batch nor on how a prompt was chunked or drafts were fed with it (greedy speculative output
then equals plain output token for token). It reads only the positions a row attends (from
the first one inside its window), so it never reads a released block, and soft-caps scores
itself. Without the compiled kernels the SDPA paths run.

On a CPU without bf16 arithmetic, a bf16 padded group of one query per sequence (decode steps) is
attended in float32: torch's CPU flash kernel runs it 1.3x (1 sequence) to 4x (16-64 sequences)
slower in bf16 than widening queries, keys and values and attending in float32 (2 AVX2 cores,
SmolLM2's heads, 60-300 cached tokens). With several queries per sequence bf16 is as fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from verispec.model.row_attention import attend_rows
from verispec.model.row_plan import RowPlan

# Above this many new tokens a sequence is attended on its own (see the module docstring).
MAX_PADDED_QUERY_LEN = 16


@dataclass(frozen=True)
class RowLayout:
    """Every new token as a row on the device (module docstring): it reads row row_seq of the
    block table and attends positions 0 .. row_visible - 1 (a chain row at position p: p + 1,
    its own key written first), and a tree row also tree_start + j where tree_mask[row, j] (its
    ancestors and itself; a tree row's row_visible is its tree's first position). Padding rows
    point at a block-table row of reserved blocks and see 1 position, which nothing else reads."""

    row_seq: torch.Tensor  # [T] int64
    row_visible: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, rotary positions (a tree row's: its tree start + depth)
    tree_start: torch.Tensor  # [T] int64
    tree_mask: torch.Tensor  # [T, rows per sequence] bool, or [T, 0] without trees
    zeros: torch.Tensor  # [T] int64, all 0 (the first position seen without a window)


@dataclass
class AttentionMetadata:
    """Where the new tokens of a ragged batch go in the paged KV cache, and what they attend to.

    The four tensors live on the model's device; the two lists are their host-side copies, so
    that planning the attention never waits for the device. Left out, the lists are read back
    from the tensors (one device sync).
    """

    query_start_loc: torch.Tensor  # [B + 1] int64, cumulative new tokens per sequence, leading 0
    seq_lens: torch.Tensor  # [B] int64, cached tokens per sequence after this step's writes
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token's key/value
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int64, padded with 0
    query_lens_list: list[int] | None = field(default=None)
    seq_lens_list: list[int] | None = field(default=None)
    # Per sequence, the parents of its new rows (module docstring: tree), or None for a chain.
    trees: list[list[int] | None] | None = field(default=None)
    # The rows on the device (a fixed-shape step); then the lists are not read and stay None.
    rows: RowLayout | None = field(default=None)

    def __post_init__(self) -> None:
        if self.rows is not None:
            return
        if self.query_lens_list is None:
            self.query_lens_list = torch.diff(self.query_start_loc).tolist()
        if self.seq_lens_list is None:
            self.seq_lens_list = self.seq_lens.tolist()
        if self.trees is not None:
            if len(self.trees) != len(self.query_lens_list):
                raise ValueError(f"trees has {len(self.trees)} entries: expected one per sequence "
                                 f"({len(self.query_lens_list)})")
            for parents, n in zip(self.trees, self.query_lens_list):
                if parents is not None:
                    check_parents(parents, n)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        trees: list[list[int] | None] | None = None,
    ) -> AttentionMetadata:
        """Metadata for sequences with query_lens[b] new tokens ending at seq_lens[b] (trees:
        the parents of each sequence's new rows, None for chains)."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError(
                f"query_lens, seq_lens and block_tables must have one entry per sequence, "
                f"got {len(query_lens)}, {len(seq_lens)} and {len(block_tables)}")
        starts = [0]
        slots: list[int] = []
        for n, s, table in zip(query_lens, seq_lens, block_tables):
            if not 0 < n <= s or len(table) * block_size < s:
                raise ValueError(
                    f"sequence with query_len={n}, seq_len={s} and {len(table)} blocks of "
                    f"{block_size}: expected 0 < query_len <= seq_len <= blocks * block_size")
            starts.append(starts[-1] + n)
            slots.extend(table[p // block_size] * block_size + p % block_size
                         for p in range(s - n, s))
        width = max(len(t) for t in block_tables)
        padded = [t + [0] * (width - len(t)) for t in block_tables]

        def tensor(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(tensor(starts), tensor(seq_lens), tensor(slots), tensor(padded),
                   list(query_lens), list(seq_lens), None if trees is None else list(trees))

    def positions(self) -> torch.Tensor:  # [T] int64
        """Rotary position of every new token, in batch order (tree rows: module docstring)."""
        trees = self.trees or [None] * len(self.query_lens_list)
        values = [p for n, s, parents in zip(self.query_lens_list, self.seq_lens_list, trees)
                  for p in new_positions(s - n, n, parents)]
        return torch.tensor(values, dtype=torch.int64, device=self.slot_mapping.device)


def check_parents(parents: list[int], n: int) -> None:
    """ValueError unless `parents` gives each of n new rows a parent row before it, or -1."""
    if len(parents) != n or any(not -1 <= p < i for i, p in enumerate(parents)):
        raise ValueError(f"tree parents={parents!r} for {n} new rows: expected {n} entries, "
                         "each -1 or the index of an earlier row")


def new_positions(start: int, n: int, parents: list[int] | None) -> list[int]:
    """Rotary positions of n new rows from cache position `start`: consecutive for a chain,
    start + depth for a tree."""
    if parents is None:
        return list(range(start, start + n))
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return [start + d for d in depth]


def window_applies(window: int | None, seq_len: int) -> bool:
    """Whether a sliding window hides any key of a sequence of seq_len tokens."""
    return window is not None and seq_len > window


def window_mask(positions: list[int], seq_len: int, window: int,
                device: torch.device) -> torch.Tensor:
    """[n, seq_len] bool: keys at cache positions > p - window, for queries at rotary positions
    p (a tree row's ancestors sit at most its depth behind it, so this keeps them for trees
    shallower than the window)."""
    query = torch.tensor(positions, dtype=torch.int64, device=device)
    return torch.arange(seq_len, device=device)[None, :] > (query - window)[:, None]


def tree_mask(parents: list[int], seq_len: int, device: torch.device) -> torch.Tensor:
    """[n, seq_len] bool: each new row may attend the cached context and its ancestors."""
    n = len(parents)
    context = seq_len - n
    mask = torch.zeros(n, seq_len, dtype=torch.bool)
    mask[:, :context] = True
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, context + i] = True
    return mask.to(device)


@dataclass
class _PaddedGroup:
    """The short sequences, attended in one padded SDPA call."""

    num_seqs: int
    max_query_len: int
    max_seq_len: int
    block_ids: torch.Tensor  # [num_seqs * blocks_per_seq] their block tables, row by row
    # [num_seqs, 1, max_query_len, max_seq_len] True where a query may attend a key;
    # None when every query may attend every key (one new token per sequence, equal lengths).
    mask: torch.Tensor | None
    # All three None when the group is the whole batch, in order, unpadded:
    gather_rows: torch.Tensor | None  # [num_seqs * max_query_len] new-token row of each slot
    valid_slots: torch.Tensor | None  # [T_group] padded slots that hold a real query
    scatter_rows: torch.Tensor | None  # [T_group] new-token row of each valid slot


@dataclass
class _Single:
    """One long sequence (a prefill chunk), attended on its own."""

    start: int
    end: int
    seq_len: int
    block_ids: torch.Tensor | None  # [blocks] its blocks; None when it has no cached context
    # [end - start, seq_len] causal or tree mask; None for a chain with no cached context
    mask: torch.Tensor | None


class AttentionPlan:
    """Index tensors for one forward pass, computed once from host-side lengths, used by
    every layer: which sequences share the padded call, how their rows are gathered, masks."""

    def __init__(self, attn: AttentionMetadata, block_size: int,
                 widen_decode: bool = False, rowwise: bool = False,
                 window: int | None = None, rowwise_max_query: int | None = None) -> None:
        """widen_decode: attend a decode-only padded group in float32; rowwise: attend the
        sequences row by row, except those with more new tokens than both rowwise_max_query
        (None: no limit) and MAX_PADDED_QUERY_LEN, attended on their own; window: a sliding
        window (module docstring)."""
        device = attn.slot_mapping.device
        self.slot_mapping = attn.slot_mapping
        self.singles: list[_Single] = []
        self.padded = None
        self.widen_padded = False
        if attn.rows is not None:
            self.rows = self._device_rows(attn.block_tables, attn.rows, window)
            return
        query_lens, seq_lens = attn.query_lens_list, attn.seq_lens_list
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        short: list[int] = []
        trees = attn.trees or [None] * len(query_lens)
        for b, (n, s, parents) in enumerate(zip(query_lens, seq_lens, trees)):
            if n <= MAX_PADDED_QUERY_LEN or (rowwise and (rowwise_max_query is None
                                                         or n <= rowwise_max_query)):
                short.append(b)
                continue
            mask = None if parents is None else tree_mask(parents, s, device)
            if (n < s or window_applies(window, s)) and mask is None:
                mask = torch.ones(n, s, dtype=torch.bool, device=device).tril(s - n)
            if window_applies(window, s):
                mask &= window_mask(new_positions(s - n, n, parents), s, window, device)
            blocks = None if n == s else attn.block_tables[b, : -(-s // block_size)]
            self.singles.append(_Single(starts[b], starts[b + 1], s, blocks, mask))
        self.rows = self._plan_rows(attn, short, starts, window) if short and rowwise else None
        self.padded = self._plan_padded(attn, short, starts, block_size, window) \
            if short and self.rows is None else None
        self.widen_padded = widen_decode and self.padded is not None \
            and self.padded.max_query_len == 1

    @staticmethod
    def _device_rows(block_tables: torch.Tensor, layout: RowLayout, window: int | None) -> RowPlan:
        # Keys at positions > p - window for a row at rotary position p, as window_mask keeps them.
        first = layout.zeros if window is None else (layout.positions - window + 1).clamp_min(0)
        return RowPlan(None, block_tables, layout.row_seq, first, layout.row_visible, layout.tree_start,
                       layout.tree_mask)

    @staticmethod
    def _plan_rows(attn: AttentionMetadata, seqs: list[int], starts: list[int],
                   window: int | None) -> RowPlan:
        device = attn.slot_mapping.device
        trees = attn.trees or [None] * len(attn.query_lens_list)
        tree_width = max((attn.query_lens_list[b] for b in seqs if trees[b] is not None),
                         default=0)
        rows, row_seq, first, visible, tree_start = [], [], [], [], []
        masks = []
        for b in seqs:
            n, s = attn.query_lens_list[b], attn.seq_lens_list[b]
            rows.extend(range(starts[b], starts[b] + n))
            row_seq.extend([b] * n)
            tree_start.extend([s - n] * n)
            # Keys at positions > p - window, as window_mask keeps them.
            first.extend(0 if window is None else max(0, p - window + 1)
                         for p in new_positions(s - n, n, trees[b]))
            if trees[b] is None:
                visible.extend(range(s - n + 1, s + 1))
                masks.append(torch.zeros(n, tree_width, dtype=torch.bool))
            else:
                visible.extend([s - n] * n)
                own = tree_mask(trees[b], s, torch.device("cpu"))[:, s - n:]
                masks.append(torch.nn.functional.pad(own, (0, tree_width - n)))

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        everything = len(rows) == len(attn.slot_mapping)
        return RowPlan(None if everything else tensor(rows), attn.block_tables, tensor(row_seq),
                       tensor(first), tensor(visible), tensor(tree_start), torch.cat(masks).to(device))

    @staticmethod
    def _plan_padded(attn: AttentionMetadata, seqs: list[int], starts: list[int],
                     block_size: int, window: int | None) -> _PaddedGroup:
        device = attn.slot_mapping.device
        query_lens = [attn.query_lens_list[b] for b in seqs]
        seq_lens = [attn.seq_lens_list[b] for b in seqs]
        max_n, max_s = max(query_lens), max(seq_lens)
        num_blocks = -(-max_s // block_size)
        tables = attn.block_tables if len(seqs) == len(attn.query_lens_list) else \
            attn.block_tables[torch.tensor(seqs, device=device)]
        block_ids = tables[:, :num_blocks].reshape(-1)

        mask = None
        if max_n > 1 or min(seq_lens) != max_s or window_applies(window, max_s):
            # Padded query slots may attend key 0, so that no row is fully masked (NaN).
            query_pos = [[s - n + i if i < n else 0 for i in range(max_n)]
                         for n, s in zip(query_lens, seq_lens)]
            query_pos_t = torch.tensor(query_pos, dtype=torch.int64, device=device)
            key_pos = torch.arange(max_s, device=device)
            mask = (key_pos <= query_pos_t[:, :, None]).unsqueeze(1)
            for g, b in enumerate(seqs):
                parents = attn.trees[b] if attn.trees is not None else None
                if parents is not None:
                    mask[g, 0, : len(parents), : seq_lens[g]] = tree_mask(parents, seq_lens[g], device)
            if window_applies(window, max_s):
                trees = attn.trees or [None] * len(attn.query_lens_list)
                for g, (b, n, s) in enumerate(zip(seqs, query_lens, seq_lens)):
                    mask[g, 0, :n] &= window_mask(new_positions(s - n, n, trees[b]), max_s,
                                                  window, device)

        if len(seqs) == len(attn.query_lens_list) and min(query_lens) == max_n:
            return _PaddedGroup(len(seqs), max_n, max_s, block_ids, mask, None, None, None)

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        # Padding slots repeat the sequence's last row: any real query will do, it is dropped.
        gather = [starts[b] + min(i, n - 1) for b, n in zip(seqs, query_lens) for i in range(max_n)]
        valid = [g * max_n + i for g, n in enumerate(query_lens) for i in range(n)]
        scatter = [starts[b] + i for b, n in zip(seqs, query_lens) for i in range(n)]
        return _PaddedGroup(len(seqs), max_n, max_s, block_ids, mask,
                            tensor(gather), tensor(valid), tensor(scatter))


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim], rotary already applied
    kv: torch.Tensor,  # [T, 2 * num_kv_heads, head_dim], keys (rotary applied) then values
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    plan: AttentionPlan,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [T, num_heads * head_dim]
    """Write the new keys/values into the cache, then attend each new token causally to its
    sequence's cached tokens (itself included). scale: of the scores, None for
    head_dim ** -0.5; softcap: scores become softcap * tanh(scores / softcap)."""
    num_tokens, num_heads, head_dim = q.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    kv = kv.view(num_tokens, 2, num_kv_heads, head_dim).transpose(0, 1)
    kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim) \
        .index_copy_(1, plan.slot_mapping, kv.to(kv_cache.dtype))

    if plan.rows is not None:
        rows = plan.rows
        queries = q if rows.rows is None else q.index_select(0, rows.rows)
        out = attend_rows(queries, kv_cache, rows, head_dim ** -0.5 if scale is None else scale, softcap)
        if rows.rows is None:
            return out
        result = q.new_empty(num_tokens, num_heads * head_dim)
        result.index_copy_(0, rows.rows, out)
        _attend_singles(q, kv, kv_cache, plan, result, scale, softcap)
        return result

    group = plan.padded
    padded_out = None
    if group is not None:
        gathered = kv_cache.index_select(1, group.block_ids)
        queries = q if group.gather_rows is None else q.index_select(0, group.gather_rows)
        if plan.widen_padded:
            gathered, queries = gathered.float(), queries.float()
        gathered = gathered.view(2, group.num_seqs, -1, num_kv_heads, head_dim)
        keys = gathered[0, :, : group.max_seq_len].transpose(1, 2)
        values = gathered[1, :, : group.max_seq_len].transpose(1, 2)
        queries = queries.view(group.num_seqs, group.max_query_len, num_heads, head_dim)
        out = _attend(queries.transpose(1, 2), keys, values, group.mask, False, scale, softcap)
        padded_out = out.transpose(1, 2).reshape(-1, num_heads * head_dim).to(q.dtype)
        if group.gather_rows is None:
            return padded_out

    result = q.new_empty(num_tokens, num_heads * head_dim)
    if padded_out is not None:
        result.index_copy_(0, group.scatter_rows, padded_out.index_select(0, group.valid_slots))
    _attend_singles(q, kv, kv_cache, plan, result, scale, softcap)
    return result


def _attend(
    q: torch.Tensor,  # [B, num_heads, n, head_dim]
    k: torch.Tensor,  # [B, num_kv_heads, S, head_dim]
    v: torch.Tensor,  # [B, num_kv_heads, S, head_dim]
    mask: torch.Tensor | None,  # [B, 1, n, S] or [n, S] bool, True where attended
    causal: bool,  # without a mask: causal (n == S), or else every key attended
    scale: float | None,
    softcap: float | None,
) -> torch.Tensor:  # [B, num_heads, n, head_dim]
    """SDPA, or without it (soft-capped scores) products and a float32 softmax as transformers'
    eager attention computes them."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=scale, enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(v.dtype), v)


def _attend_singles(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    kv: torch.Tensor,  # [2, T, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    plan: AttentionPlan,
    result: torch.Tensor,  # [T, num_heads * head_dim], the singles' rows written
    scale: float | None = None,
    softcap: float | None = None,
) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[3]
    for single in plan.singles:
        queries = q[single.start : single.end].transpose(0, 1).unsqueeze(0)
        if single.block_ids is None:
            keys = kv[0, single.start : single.end].transpose(0, 1).unsqueeze(0)
            values = kv[1, single.start : single.end].transpose(0, 1).unsqueeze(0)
        else:
            gathered = kv_cache.index_select(1, single.block_ids)
            gathered = gathered.view(2, -1, num_kv_heads, head_dim)[:, : single.seq_len]
            keys = gathered[0].transpose(0, 1).unsqueeze(0)
            values = gathered[1].transpose(0, 1).unsqueeze(0)
        out = _attend(queries, keys, values, single.mask, single.mask is None, scale,
                      softcap)
        result[single.start : single.end] = out[0].transpose(0, 1).reshape(-1, num_heads * head_dim)
