"""Times one verify step: verispec's rejection_sample against the straightforward baseline.

The baseline is what most stacks write first: softmax every target row, gather p(x) and q(x),
cumprod the acceptance mask, compute the residual max(p - q, 0) of EVERY draft row, normalise
and sample every row, then pick per request. Ours turns one row per request into probabilities
and reads draft rows only at the point it needs them.

Both run in one process on the same inputs, side by side; the table shows median times, their
ratio, and the bytes floor (logits + draft probabilities read once, at the copy bandwidth
measured in the same run). JSON goes to bench/results/verify.json (or --json).

    python bench/verify.py                      # CPU, 2 threads
    python bench/verify.py --device cuda --batch 1 8 64 256 --k 3 5 --vocab 128256 \
        --dtype float32 bfloat16 --modes random greedy top-k50-p0.9   # + the Triton path
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

import torch
from common import Table, copy_bandwidth, measure, write_json

from verispec import SamplingMetadata, SamplingParams
from verispec.sample import DraftProbs, rejection_sample


def baseline_filter(
    logits: torch.Tensor,  # [B, K + 1, V] float32
    top_k: int,
    top_p: float,
) -> torch.Tensor:  # [B, K + 1, V] with filtered tokens at -inf
    """Top-k then top-p the usual way: sort every row."""
    ordered, index = logits.sort(dim=-1, descending=True)
    ordered[..., top_k:] = float("-inf")
    probs = ordered.softmax(dim=-1)
    outside = probs.cumsum(dim=-1) - probs > top_p
    ordered = ordered.masked_fill(outside, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, index, ordered)


def baseline_verify(
    target_logits: torch.Tensor,  # [B, K + 1, V]
    draft_ids: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor,  # [B, K, V]
    filters: tuple[int, float] | None,
) -> torch.Tensor:  # [B, K + 1]
    batch, k1, _ = target_logits.shape
    k = k1 - 1
    logits = target_logits.float()
    if filters is not None:
        logits = baseline_filter(logits, *filters)
    p = logits.softmax(dim=-1)
    px = p[:, :k].gather(2, draft_ids[..., None])[..., 0]
    qx = draft_probs.gather(2, draft_ids[..., None])[..., 0]
    accept = torch.rand(batch, k, device=p.device) * qx < px
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)
    residual = (p[:, :k] - draft_probs).clamp(min=0)
    residual = residual / residual.sum(dim=-1, keepdim=True).clamp(min=1e-20)
    rows = torch.cat([residual, p[:, k:]], dim=1)  # [B, K + 1, V]
    # Exponential race per row: argmax w / E, one draw for every row.
    exp = torch.empty_like(rows).exponential_()
    candidates = (rows / exp).argmax(dim=-1)  # [B, K + 1]
    final = candidates.gather(1, num_accepted[:, None])
    slot = torch.arange(k + 1, device=p.device)[None]
    padded = torch.cat([draft_ids, draft_ids[:, :1]], dim=1)
    n = num_accepted[:, None]
    return torch.where(slot < n, padded, torch.where(slot == n, final, -1))


MODES = {
    "random": SamplingParams(temperature=1.0),
    "greedy": SamplingParams(temperature=0.0),
    "top-k50-p0.9": SamplingParams(temperature=1.0, top_k=50, top_p=0.9),
}


def run_case(batch: int, k: int, vocab: int, mode: str, dtype: torch.dtype, device: torch.device, reps: int,
             backends: list[str]) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(batch, k + 1, vocab, device=device, generator=g) * 3).to(dtype)
    draft_probs = torch.softmax(torch.randn(batch, k, vocab, device=device, generator=g) * 3, dim=-1)
    draft_ids = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=g).reshape(batch, k)
    params = MODES[mode]
    filters = (params.top_k, params.top_p) if params.top_k else None
    sampling = SamplingMetadata.from_params([params] * batch, device=device)
    flat_logits = logits.reshape(-1, vocab)
    flat_ids = draft_ids.reshape(-1)
    cu = torch.arange(batch + 1, device=device) * k
    draft = DraftProbs(draft_probs.reshape(-1, vocab))

    def ours(backend: str) -> Callable[[], object]:
        # Named always: left out, a CUDA tensor takes the default backend, Triton.
        return lambda: rejection_sample(
            flat_logits, flat_ids, cu, sampling, draft=draft,
            max_num_draft_tokens=k, validate=False, backend=backend,
        )

    row = {"batch": batch, "k": k, "vocab": vocab, "mode": mode, "dtype": str(dtype).removeprefix("torch.")}
    row["baseline_s"] = measure(lambda: baseline_verify(logits, draft_ids, draft_probs, filters), device, reps)
    for backend in backends:
        row[f"{backend}_s"] = measure(ours(backend), device, reps)
        row[f"{backend}_speedup"] = row["baseline_s"] / row[f"{backend}_s"]
    row["bytes"] = logits.numel() * logits.element_size() + draft_probs.numel() * 4
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--k", type=int, nargs="+", default=[5])
    parser.add_argument("--vocab", type=int, nargs="+", default=[128_256, 49_152])
    parser.add_argument("--modes", nargs="+", default=["random", "greedy"], choices=sorted(MODES))
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"],
                        help="dtype of the target logits")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per figure on CPU (median)")
    parser.add_argument("--json", type=Path, default=Path("bench/results/verify.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    backends = ["native"]
    if device.type == "cuda":
        backends.append("triton")
    bandwidth = copy_bandwidth(device)
    rows = []
    print(f"device={device} threads={args.threads} copy bandwidth={bandwidth / 1e9:.1f} GB/s")
    table = Table("B", "K", "V", "dtype", "mode", "floor µs", "baseline µs",
                  *(f"{b} {unit}" for b in backends for unit in ("µs", "speed-up")), digits=1)
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        for vocab in args.vocab:
            for k in args.k:
                for batch in args.batch:
                    for mode in args.modes:
                        row = run_case(batch, k, vocab, mode, dtype, device, args.reps, backends)
                        row["floor_s"] = row["bytes"] / bandwidth
                        rows.append(row)
                        table.row(batch, k, vocab, dtype_name, mode, row["floor_s"] * 1e6, row["baseline_s"] * 1e6,
                                  *(cell for b in backends
                                    for cell in (row[f"{b}_s"] * 1e6, f"{row[f'{b}_speedup']:.2f}x")))
    write_json(args.json, device, rows, copy_bandwidth_bytes_per_s=bandwidth)


if __name__ == "__main__":
    main()
