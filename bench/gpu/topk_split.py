"""Top-k + top-p verify time by how each row's threshold search is split: one program per row
(unsplit) against rows split across programs with 8 to 64 pivots a pass. The split search
compares every column with every pivot, so its work grows with the pivots while its launches
shrink with them; this measures where that balance lies on the card (issue 42: B = 64 / K = 5
top-k 50 + top-p 0.9 at V = 128,256 took 58.7 ms split with 64 pivots, 7.1 ms unsplit). The
row "default" is what tiles.split_tiles chooses.

    python bench/gpu/topk_split.py --json $OUT/topk_split.json            # on a GPU
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import Table, write_json  # noqa: E402
from verify import run_case  # noqa: E402

from verispec.sample.kernels import tiles  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--pivots", type=int, nargs="*", default=[8, 16, 32, 64],
                        help="pivot counts to try split (none: the default and unsplit only)")
    parser.add_argument("--json", type=Path, default=Path("bench/results/topk_split.json"))
    args = parser.parse_args()
    device = torch.device(args.device)
    backend = "triton" if device.type == "cuda" else "native"  # native: a CPU dry run of the script
    split_tiles, default_pivots = tiles.split_tiles, tiles._SPLIT_PIVOTS
    variants = {"default": (split_tiles, default_pivots), "unsplit": (lambda *_: None, default_pivots)}
    variants.update({f"split, {n} pivots": (split_tiles, n) for n in args.pivots})
    table = Table("B", "search", "splits", "µs", digits=1)
    rows = []
    for batch in args.batch:
        for name, (chooser, pivots) in variants.items():
            tiles.split_tiles, tiles._SPLIT_PIVOTS = chooser, pivots
            shape = tiles.split_tiles(batch * 6, args.vocab, device)
            row = run_case(batch, 5, args.vocab, "top-k50-p0.9", torch.bfloat16, device, 5, [backend])
            rows.append({"search": name, "splits": shape.num_splits if shape else 1, **row})
            table.row(batch, name, rows[-1]["splits"], row[f"{backend}_s"] * 1e6)
    tiles.split_tiles, tiles._SPLIT_PIVOTS = split_tiles, default_pivots
    write_json(args.json, device, rows)


if __name__ == "__main__":
    main()
