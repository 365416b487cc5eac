"""Where an engine step's time goes: wall time per step against the time the device is busy.

On a GPU a small model's step is often bound by the host (Python, kernel launches), not the
device: then the kernels' busy time is a small part of the step's wall time, and replaying the
step as a CUDA graph, or fusing launches, is what would pay. For each batch size and drafter:
steps, wall ms per step, device-busy ms per step (torch.profiler: the kernels' own time),
kernel launches per step, and the top kernels and host ops by time. JSON to --json.

    python bench/step_profile.py --device cuda --dtype bfloat16 --batch 1 16 --draft none ngram
    python bench/step_profile.py                  # the CPU: busy = products and attention

On the CPU "busy" is the matrix products and the attention: torch's mm / addmm / bmm / SDPA
and the compiled kernels' ranges (verispec::product, verispec::quantize, the activations'
quantization that feeds the integer products, verispec::attention); the rest of the step
("overhead": Python, small ops, norms, rotary, sampling) is wall minus busy. Wall comes from a
run without the profiler, which slows the host side.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from common import Table, write_json
from torch.profiler import ProfilerActivity, profile

from verispec import LLM, SamplingParams

# The CPU's products and attention, by the names torch.profiler gives them.
CPU_BUSY = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
            "verispec::product", "verispec::quantize", "verispec::attention")
TOPICS = ["the ocean", "volcanoes", "bees", "the moon", "chess", "bread", "rivers", "owls"]


def profile_one(llm: LLM, batch: int, max_tokens: int, on_gpu: bool, rounds: int) -> dict:
    prompts = [[{"role": "user", "content": f"Write a story about {TOPICS[i % len(TOPICS)]} ({i})."}]
               for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.chat(prompts, params, use_tqdm=False)  # warm: kernels compiled, caches allocated
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    # Plain and profiled runs alternate, and each keeps its fastest round: on a shared machine
    # the noise only ever slows a run, and a ratio of two single runs moved by +-10 points.
    wall = busy_us = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        outs = llm.chat(prompts, params, use_tqdm=False)
        if on_gpu:
            torch.cuda.synchronize()
        wall = min(wall, time.perf_counter() - start)
        with profile(activities=activities) as prof:
            llm.chat(prompts, params, use_tqdm=False)
        events = prof.key_averages()
        if on_gpu:
            kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
            busy = sum(e.self_device_time_total for e in kernels)
        else:
            busy = sum(e.self_cpu_time_total for e in events if e.key in CPU_BUSY)
        if busy < busy_us:
            busy_us, kept = busy, events
    events = kept
    steps = max(o.stats.num_steps for o in outs)
    if on_gpu:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        top_device = sorted(kernels, key=lambda e: -e.self_device_time_total)[:8]
        device_rows = [(e.key[:60], e.self_device_time_total / steps, e.count / steps) for e in top_device]
    else:
        device_rows = []
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    top_host = sorted((e for e in events if e.key.startswith(("aten::", "verispec::"))),
                      key=lambda e: -e.self_cpu_time_total)[:8]
    return {
        "batch": batch, "tokens": sum(len(o.token_ids) for o in outs), "steps": steps,
        "wall_ms_per_step": wall / steps * 1e3, "busy_ms_per_step": busy_us / steps / 1e3,
        "overhead_share": 1 - busy_us / 1e6 / wall,
        "launches_per_step": launches / steps, "tok_per_s": sum(len(o.token_ids) for o in outs) / wall,
        "top_device_kernels_us_per_step": device_rows,
        "top_host_ops_us_per_step": [(e.key, e.self_cpu_time_total / steps, e.count / steps) for e in top_host],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--model", default=None, help="checkpoint directory or .gguf (default: the embedded one)")
    parser.add_argument("--dtype", default="auto", help="as LLM(dtype=...) (default: auto)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--draft", nargs="+", default=["none", "ngram"], help="drafters, as LLM(draft=...)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="plain and profiled runs, fastest kept")
    parser.add_argument("--json", type=Path, default=Path("bench/results/step_profile.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    on_gpu = torch.device(args.device).type == "cuda"
    rows = []
    table = Table("draft", "batch", "steps", "tok/s", "wall ms/step", "busy ms/step", "overhead", "launches/step")
    for draft in args.draft:
        llm = LLM(args.model, draft=draft, dtype=args.dtype, device=args.device, kv_cache_gib=0.5,
                  max_num_seqs=max(args.batch), progress=False)
        for batch in args.batch:
            row = dict(profile_one(llm, batch, args.max_tokens, on_gpu, args.rounds), draft=draft)
            rows.append(row)
            table.row(draft, batch, row["steps"], f"{row['tok_per_s']:.1f}", row["wall_ms_per_step"],
                      row["busy_ms_per_step"], f"{row['overhead_share']:.0%}", f"{row['launches_per_step']:.0f}")
    print()
    ops = Table("draft", "batch", "µs / step", "calls / step", "kernel or op (the costliest)", digits=1)
    for row in rows:
        for name, us, count in row["top_device_kernels_us_per_step"] or row["top_host_ops_us_per_step"]:
            ops.row(row["draft"], row["batch"], us, count, name)
    write_json(args.json, torch.device(args.device), rows)


if __name__ == "__main__":
    main()
