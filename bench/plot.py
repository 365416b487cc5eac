"""The headline comparisons of docs/benchmarks.md as pictures: reads the figures' JSON files
(docs/figures/*.json: {"meta": where, when, on what, "rows": [...]}, as bench/common.write_json
writes them) and draws a PNG beside each, with its machine and date in the caption.

    python bench/plot.py                      # every figure docs/figures holds
    python bench/plot.py --figures DIR        # another folder of the same JSON files
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a server or in CI
import matplotlib.pyplot as plt  # noqa: E402


def _caption(meta: dict) -> str:
    where = meta.get("machine") or f"{meta.get('device', '?')}, {meta.get('cpus', '?')} CPUs"
    return f"{where}; {meta.get('date', '?')}, commit {meta.get('commit') or '?'}"


def _bars(ax, labels: list[str], series: dict[str, list[float]], unit: str, fmt: str = ",.0f") -> None:
    """Horizontal grouped bars, one group per label, the first label on top."""
    height = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        ys = [len(labels) - 1 - j + (len(series) / 2 - i - 0.5) * height for j in range(len(labels))]
        measured = [(y, v) for y, v in zip(ys, values) if v is not None]  # None: not measured
        ax.barh([y for y, _ in measured], [v for _, v in measured], height, label=name)
        for y, v in measured:
            ax.text(v, y, f" {v:{fmt}}", va="center", fontsize=7)
    ax.set_yticks(range(len(labels)), labels[::-1], fontsize=8)
    ax.set_xlabel(unit)
    ax.legend(fontsize=8, loc="lower right")


def cpu_engines(data: dict, ax) -> str:
    rows = data["rows"]
    _bars(ax, [r["engine"] for r in rows], {
        "greedy, batch 1": [r["greedy_tok_s"] for r in rows],
        "sampled, batch 1": [r["sampled_tok_s"] for r in rows],
        "batch 16": [r["batch16_tok_s"] for r in rows],
    }, "tokens / s (higher is faster)")
    return "Embedded SmolLM2-135M on the CPU: verispec against llama.cpp"


def serving(data: dict, ax) -> str:
    servers = list(dict.fromkeys(r["server"] for r in data["rows"]))
    for server in servers:
        rows = [r for r in data["rows"] if r["server"] == server]
        ax.plot([r["clients"] for r in rows], [r["output_tok_s"] for r in rows], marker="o", label=server)
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 4, 16], ["1", "4", "16"])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("output tokens / s")
    ax.legend(fontsize=8)
    return "Serving throughput: verispec serve against llama-server and transformers serve"


def startup(data: dict, ax) -> str:
    rows = data["rows"]
    series = {"wall, median": [r["median_s"] for r in rows]}
    if all("cpu_s" in r for r in rows):  # runs before the CPU column have wall times only
        series["CPU (user + sys), median"] = [r["cpu_s"] for r in rows]
    _bars(ax, [r["command"] for r in rows], series, "seconds to the first token / to /health (lower is better)",
          ".2f")
    return "Start-up as whole processes, the cached embedded model"


def gpu_verify(data: dict, ax) -> str:
    """The verify step on the GPU against the anchors the page names (log scale: 70 µs to 10 ms)."""
    rows = data["rows"]
    anchors = sorted({name for r in rows for name in r["anchors_us"]})
    _bars(ax, [f"B={r['batch']} K={r['k']} {r['mode']}" for r in rows], {
        "verispec Triton, fp32": [r["triton_fp32_us"] for r in rows],
        "verispec Triton, bf16": [r["triton_bf16_us"] for r in rows],
        **{name: [r["anchors_us"].get(name) for r in rows] for name in anchors},
        "target": [r["target_us"] for r in rows],
    }, "µs per verify step, V = 128,256 (lower is faster; log scale)")
    ax.set_xscale("log")
    ax.legend(fontsize=8, loc="upper right")  # the short B = 1 bars leave that corner free
    return "Verify step on an NVIDIA H100 against vLLM's sampler and the targets"


def acceptance(data: dict, ax) -> str:
    """bench/drafters.py, fixed K: the share of steps whose draft at each position was accepted."""
    drafters = list(dict.fromkeys(row["drafter"] for row in data["rows"]))
    for row in data["rows"]:
        rates = row["per_position_acceptance"]
        ax.plot(range(1, len(rates) + 1), rates, marker="o", linestyle="-" if row["mode"] == "greedy" else "--",
                color=f"C{drafters.index(row['drafter'])}", label=f"{row['drafter']}, {row['mode']}")
    ax.set_xticks(range(1, max(len(r["per_position_acceptance"]) for r in data["rows"]) + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafted at that position")
    ax.set_ylim(0, None)
    ax.legend(fontsize=8)
    return "Acceptance by draft position on the 4-bit target, batch 1, K = 4"


def speculation(data: dict, ax) -> str:
    """bench/drafters.py --classes: each drafter against no drafts, per prompt class, batch 1 greedy."""
    rows = [r for r in data["rows"] if r["batch"] == 1 and r["mode"] == "greedy" and not r.get("scan")
            and r["drafter"] != "none"]
    classes = list(rows[0]["per_category_speedup"])
    _bars(ax, classes, {r["drafter"]: [r["per_category_speedup"][c] for c in classes] for r in rows},
          "tok/s relative to no drafts (1 = as fast; higher is faster)", ".2f")
    ax.axvline(1.0, color="gray", linewidth=0.8)
    return "Drafters on the 4-bit target, batch 1 greedy, adaptive K: speed-up over no drafts"


def k_scan(data: dict, ax) -> str:
    """bench/drafters.py --classes --k-scan: tok/s at each fixed K, per drafter."""
    rows = [r for r in data["rows"] if r.get("scan")]
    for drafter in dict.fromkeys(r["drafter"] for r in rows):
        mine = sorted((r["k"], r["tok_s"]) for r in rows if r["drafter"] == drafter)
        ax.plot([k for k, _ in mine], [t for _, t in mine], marker="o", label=drafter)
    ax.set_xlabel("K, drafts per step (fixed; 0 = no drafts)")
    ax.set_ylabel("output tokens / s, batch 1 greedy")
    ax.legend(fontsize=8)
    return "Tokens per second against K on the 4-bit target, every prompt class"


FIGURES: dict[str, Callable[[dict, object], str]] = {
    "cpu_engines": cpu_engines, "serving": serving, "startup": startup, "speculation": speculation,
    "k_scan": k_scan, "gpu_verify": gpu_verify, "acceptance": acceptance,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--figures", type=Path, default=Path("docs/figures"))
    args = parser.parse_args()
    for path in sorted(args.figures.glob("*.json")):
        draw = FIGURES.get(path.stem)
        if draw is None:
            raise SystemExit(f"{path}: no drawing for {path.stem!r} (expected one of {sorted(FIGURES)})")
        data = json.loads(path.read_text())
        fig, ax = plt.subplots(figsize=(8, 4.5))
        ax.set_title(draw(data, ax), fontsize=10)
        fig.text(0.01, 0.01, _caption(data["meta"]), fontsize=6, color="gray")
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        fig.savefig(path.with_suffix(".png"), dpi=110)
        plt.close(fig)
        print(f"wrote {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
