"""RowPlan: the new tokens of a forward pass that are attended row by row (model/attention.py),
as the row attention's backends read them (model/row_attention.py, triton_attention.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowPlan:
    """Row r reads row row_seq[r] of block_tables and attends positions row_first[r] ..
    row_visible[r] - 1, and for a tree row the new positions row_tree_start[r] + j where
    tree_mask[r, j]."""

    rows: torch.Tensor | None  # [R] int64 their new-token rows; None: all T rows, in order
    block_tables: torch.Tensor  # [B, max_blocks] int64
    row_seq: torch.Tensor  # [R] int64 row -> its block table row
    row_first: torch.Tensor  # [R] int64 first position attended (> 0 under a sliding window)
    row_visible: torch.Tensor  # [R] int64 positions row_first .. row_visible - 1 attended
    row_tree_start: torch.Tensor  # [R] int64 first new position of a tree row's sequence
    tree_mask: torch.Tensor  # [R, max_new] bool new positions a tree row attends (0 columns: none)

    def tensors(self) -> list[torch.Tensor]:
        """The plan as the compiled decoder layers take it (every new token a row, in order)."""
        if self.rows is not None:
            raise ValueError("the compiled layers attend every new token row by row")
        return [t.contiguous() for t in (self.block_tables, self.row_seq, self.row_first,
                                         self.row_visible, self.row_tree_start, self.tree_mask)]
