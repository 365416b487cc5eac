"""Quantized weights on the CPU: verispec running the embedded GGUF's 4-bit blocks as stored,
side by side with llama.cpp (llama-cpp-python, the same file and prompt token ids) and Hugging
Face transformers (float32), and the kernel table (all matrix products of one decode step, by
rows M).

Every engine runs in its own process (peak RSS and start-up are its own), in turn, round after
round (interleaved), with the same thread count. Batch 1: 4 chat prompts, greedy (tokens until
EOS or --max-tokens) and sampled (temperature 0.8, top-k 50, top-p 0.9, fixed length); tok/s is
the tokens of all prompts over their total time, the median over rounds. Start-up: process
start to the first token of the first prompt. Peak RSS (VmHWM) twice: after the batch-1 runs
("RSS b1", what llama.cpp's rows measure too) and at the end, batch 16's KV cache included.
llama.cpp's batch 16 runs its own batched API (llama_batch, one sequence per prompt).

    python bench/quant.py                              # everything, 2 threads, 2 rounds
    python bench/quant.py --llama-python /path/to/python-with-llama_cpp
    python bench/quant.py --skip-kernels --rounds 1
    python bench/quant.py --engines "verispec 4-bit, no drafts" --kernels avx2   # a kernel side by side

llama-cpp-python is not a dependency: build it from source into any Python
(CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python) and name that interpreter with
--llama-python (default: this one); without it the llama.cpp rows are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how vaccines train the immune system, step by step.",
    "Give me a packing list for a week of hiking in the mountains, with reasons.",
    "Compare Python and Rust for writing a command-line tool.",
]
SAMPLED = dict(temperature=0.8, top_k=50, top_p=0.9)
# name -> what the worker runs
ENGINES = {
    "verispec 4-bit, no drafts": ("verispec", dict(dtype="auto", draft="none")),
    "verispec 4-bit, n-gram": ("verispec", dict(dtype="auto", draft="ngram")),
    "verispec 4-bit, lookup + EAGLE": ("verispec", dict(dtype="auto", draft="ngram+eagle")),
    "verispec float32, no drafts": ("verispec", dict(dtype="float32", draft="none")),
    "verispec float32, int4 self-draft": ("verispec", dict(dtype="float32", draft="int4")),
    "verispec float32, int4 self-draft K=5": ("verispec", dict(dtype="float32", draft="int4",
                                                               adaptive=False)),
    "llama.cpp": ("llama.cpp", dict(lookup=False)),
    "llama.cpp, prompt lookup": ("llama.cpp", dict(lookup=True)),
    "HF transformers float32": ("hf", {}),
}


def prompt_ids() -> list[list[int]]:
    from verispec.model import load_model

    _, tokenizer = load_model(quantization="gguf", progress=False)
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                           add_generation_prompt=True),
                             add_special_tokens=False) for p in PROMPTS]


def _peak_rss_mib() -> float:
    # VmHWM, not getrusage's ru_maxrss: that one keeps the parent's peak across fork + exec.
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _verispec(options: dict, prompts: list[list[int]], max_tokens: int, started: float) -> dict:
    from verispec import LLM, SamplingParams

    llm = LLM(progress=False, **options)
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    sampled = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=0, **SAMPLED)
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    startup = time.perf_counter() - started
    out = {"startup_s": startup}
    for name, params in (("greedy", greedy), ("sampled", sampled)):
        tokens, steps, seconds = 0, 0, 0.0
        for ids in prompts:
            start = time.perf_counter()
            result = llm.generate([ids], params, use_tqdm=False)[0]
            seconds += time.perf_counter() - start
            tokens += len(result.token_ids)
            steps += result.stats.num_steps
        out[name] = tokens / seconds
        out[f"{name}_tokens_per_step"] = tokens / steps
    out["rss_batch1_mib"] = _peak_rss_mib()  # before batch 16's KV cache (llama.cpp's rows have no batch 16)
    batch = [ids for ids in prompts for _ in range(4)]
    start = time.perf_counter()
    results = llm.generate(batch, greedy, use_tqdm=False)
    out["batch16"] = sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)
    return out


def _llama_cpp(options: dict, prompts: list[list[int]], max_tokens: int, started: float,
               model_path: str, threads: int) -> dict:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=5) if options["lookup"] else None
    llm = Llama(model_path, n_threads=threads, n_threads_batch=threads, n_ctx=2048,
                verbose=False, draft_model=draft)
    eos = llm.token_eos()

    def run(ids: list[int], sampled: bool) -> int:
        llm.reset()
        count = 0
        kwargs = SAMPLED if sampled else dict(temp=0.0, top_k=1)
        kwargs = {("temp" if k == "temperature" else k): v for k, v in kwargs.items()}
        for token in llm.generate(ids, **kwargs):
            if token == eos and not sampled:
                break
            count += 1
            if count == max_tokens:
                break
        return count

    llm.reset()
    next(iter(llm.generate(prompts[0], temp=0.0, top_k=1)))
    out = {"startup_s": time.perf_counter() - started}
    for name, sampled in (("greedy", False), ("sampled", True)):
        tokens, seconds = 0, 0.0
        for ids in prompts:
            start = time.perf_counter()
            tokens += run(ids, sampled)
            seconds += time.perf_counter() - start
        out[name] = tokens / seconds
    if not options["lookup"]:
        out["rss_batch1_mib"] = _peak_rss_mib()
        del llm
        out["batch16"] = _llama_cpp_batch([ids for ids in prompts for _ in range(4)], max_tokens,
                                          model_path, threads)
    return out


def _llama_cpp_batch(prompts: list[list[int]], max_tokens: int, model_path: str, threads: int) -> float:
    """Output tok/s of llama.cpp's own batched API (llama_batch over one sequence per prompt,
    as its `batched` example): every prompt prefilled in one decode, then one token per live
    sequence per decode, greedy (argmax of the logits), a sequence ending at an end-of-generation
    token or max_tokens, as the verispec batch-16 row."""
    import ctypes

    import llama_cpp as C
    import numpy as np

    C.llama_backend_init()
    model = C.llama_model_load_from_file(model_path.encode(), C.llama_model_default_params())
    vocab = C.llama_model_get_vocab(model)
    n_vocab = C.llama_vocab_n_tokens(vocab)
    params = C.llama_context_default_params()
    total = sum(len(p) for p in prompts)
    params.n_ctx = len(prompts) * (max(len(p) for p in prompts) + max_tokens + 8)
    params.n_batch = params.n_ubatch = max(total, len(prompts))
    params.n_seq_max = len(prompts)
    params.n_threads = params.n_threads_batch = threads
    ctx = C.llama_init_from_model(model, params)
    batch = C.llama_batch_init(params.n_batch, 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:  # (token, position, seq, logits)
        batch.n_tokens = len(entries)
        for i, (token, position, seq, wants) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position, 1
            batch.seq_id[i][0], batch.logits[i] = seq, wants
        if C.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(index: int) -> int:
        row = C.llama_get_logits_ith(ctx, index)
        return int(np.ctypeslib.as_array(ctypes.cast(row, ctypes.POINTER(ctypes.c_float)), (n_vocab,)).argmax())

    start = time.perf_counter()
    entries = [(t, i, s, i == len(p) - 1) for s, p in enumerate(prompts) for i, t in enumerate(p)]
    decode(entries)
    last = {s: sum(len(q) for q in prompts[:s + 1]) - 1 for s in range(len(prompts))}  # batch index
    length = {s: len(p) for s, p in enumerate(prompts)}
    count = dict.fromkeys(range(len(prompts)), 0)
    live = set(range(len(prompts)))
    while live:
        step = []
        for s in sorted(live):
            token = argmax(last[s])
            if C.llama_vocab_is_eog(vocab, token):  # not counted, as in the batch-1 rows
                live.discard(s)
                continue
            count[s] += 1
            if count[s] == max_tokens:
                live.discard(s)
                continue
            step.append((token, length[s], s, True))
            length[s] += 1
        if step:
            decode(step)
            last = {seq: i for i, (_, _, seq, _) in enumerate(step)}
    produced = sum(count.values())
    seconds = time.perf_counter() - start
    C.llama_batch_free(batch)
    C.llama_free(ctx)
    C.llama_model_free(model)
    return produced / seconds


def _hf(prompts: list[list[int]], max_tokens: int, started: float) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from verispec.model.loader import converted_checkpoint_dir

    model = AutoModelForCausalLM.from_pretrained(converted_checkpoint_dir(progress=False),
                                                 dtype=torch.float32).eval()
    with torch.no_grad():
        model.generate(torch.tensor([prompts[0]]), max_new_tokens=1, do_sample=False)
        out = {"startup_s": time.perf_counter() - started}
        tokens, seconds = 0, 0.0
        for ids in prompts:
            start = time.perf_counter()
            result = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens,
                                    do_sample=False)
            seconds += time.perf_counter() - start
            tokens += result.shape[1] - len(ids)
    out["greedy"] = tokens / seconds
    return out


def worker(args: argparse.Namespace) -> None:
    # Start-up counts from the process's start, interpreter and imports included.
    started = time.perf_counter() - (time.time() - float(os.environ["BENCH_SPAWNED_AT"]))
    kind, options = ENGINES[args.worker]
    prompts = json.loads(Path(args.prompts_file).read_text())
    if kind == "verispec":
        import torch

        torch.set_num_threads(args.threads)
        out = _verispec(options, prompts, args.max_tokens, started)
    elif kind == "llama.cpp":
        out = _llama_cpp(options, prompts, args.max_tokens, started, args.gguf, args.threads)
    else:
        import torch

        torch.set_num_threads(args.threads)
        out = _hf(prompts, args.max_tokens, started)
    out["peak_rss_mib"] = _peak_rss_mib()
    out.setdefault("rss_batch1_mib", out["peak_rss_mib"])
    print("RESULT " + json.dumps(out), flush=True)


def run_worker(name: str, python: str, args: argparse.Namespace, prompts_file: Path,
               kernel: str | None = None) -> dict | None:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), BENCH_SPAWNED_AT=str(time.time()))
    if kernel is not None:
        env["VERISPEC_CPU_KERNEL"] = kernel
    command = [python, __file__, "--worker", name, "--prompts-file", str(prompts_file),
               "--max-tokens", str(args.max_tokens), "--threads", str(args.threads),
               "--gguf", args.gguf]
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        print(f"  {name}: failed ({done.stderr.strip().splitlines()[-1:]})", file=sys.stderr)
        return None
    result = json.loads(lines[-1][len("RESULT "):])
    result["wall_s"] = time.perf_counter() - start
    return result


def kernel_table(threads: int) -> list[dict]:
    """All matrix products of one decode step of the embedded model, by rows M."""
    import torch
    import torch.nn.functional as F

    from verispec.model import load_model
    from verispec.model.linear import cpu_fp32_product, fp32_kind
    from verispec.model.quant.kernels import available_kernels, qlinear

    torch.set_num_threads(threads)
    model, _ = load_model(quantization="gguf", progress=False)
    layers = [getattr(layer, name) for layer in model.layers
              for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")] + [model.lm_head]
    weights = [part for layer in layers for part in layer.parts]
    dense = [w.dequantize() for w in weights]
    nbytes = sum(w.nbytes for w in weights)

    def step(rows: int, product) -> float:
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for w, d in zip(weights, dense):
                product(inputs[w.shape[1]], w, d)
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:]) * 1e3

    copy = torch.empty(64 * 2**20 // 4)
    target = torch.empty_like(copy)
    start = time.perf_counter()
    for _ in range(5):
        target.copy_(copy)
    bandwidth = 2 * copy.numel() * 4 * 5 / (time.perf_counter() - start)
    rows = []
    for m in (1, 2, 5, 16, 17, 32):
        row = {"M": m, "float32 F.linear": step(m, lambda x, w, d: F.linear(x, d))}
        # verispec's own float32 products: F.linear, skinny or compiled per shape and rows, as
        # measured at load.
        row["float32 verispec"] = step(m, lambda x, w, d: cpu_fp32_product(
            d, x, torch.float32, fp32_kind(x.shape[0], tuple(d.shape))))
        for kernel in available_kernels():
            row[kernel] = step(m, lambda x, w, d, k=kernel: qlinear(x, w, k))
        rows.append(row)
    return [{"weights_mb": nbytes / 1e6, "copy_gb_s": bandwidth / 1e9,
             "floor_ms": nbytes / bandwidth * 1e3, "rows": rows}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--engines", nargs="*", default=list(ENGINES), choices=list(ENGINES),
                        metavar="NAME")
    parser.add_argument("--kernels", nargs="*", default=[], metavar="KERNEL",
                        help="also run each verispec engine with these kernels forced "
                             "(VERISPEC_CPU_KERNEL), e.g. avx2 beside the default avx512bw")
    parser.add_argument("--llama-python", default=sys.executable)
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench/results/quant.json"))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--prompts-file", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--gguf", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    import torch
    from common import Table, write_json  # the parent only: a worker may run in a Python without torch

    from verispec.model.loader import default_model_path

    args.gguf = str(default_model_path())
    prompts_file = args.out.with_suffix(".prompts.json")
    prompts_file.parent.mkdir(parents=True, exist_ok=True)
    prompts_file.write_text(json.dumps(prompt_ids()))
    kernels = [] if args.skip_kernels else kernel_table(args.threads)
    if kernels:
        table = kernels[0]
        print(f"weights {table['weights_mb']:.1f} MB, copy {table['copy_gb_s']:.1f} GB/s, "
              f"floor {table['floor_ms']:.2f} ms")
        printed = Table(*table["rows"][0])
        for row in table["rows"]:
            printed.row(*row.values())
    # (row name, engine, forced kernel or None)
    workers = [(name, name, None) for name in args.engines] + [
        (f"{name}, {kernel} kernel", name, kernel) for name in args.engines
        if ENGINES[name][0] == "verispec" for kernel in args.kernels]
    results: dict[str, list[dict]] = {row: [] for row, _, _ in workers}
    for round_number in range(args.rounds):
        for row, name, kernel in workers:
            python = args.llama_python if ENGINES[name][0] == "llama.cpp" else sys.executable
            result = run_worker(name, python, args, prompts_file, kernel)
            if result is not None:
                results[row].append(result)
                print(f"round {round_number + 1} {row}: {result}", flush=True)
    rows = []
    for name, runs in results.items():
        if not runs:
            continue
        row = {"engine": name}
        for key in runs[0]:
            row[key] = statistics.median(r[key] for r in runs)
        rows.append(row)
    base = next((r for r in rows if r["engine"] == "llama.cpp"), None)
    engines = Table("engine", "greedy tok/s", "vs llama.cpp", "sampled tok/s", "batch 16 tok/s", "RSS b1 MiB",
                    "peak RSS MiB", "start-up s", "tok/step", digits=1)
    for row in rows:
        ratio = row["greedy"] / base["greedy"] if base else float("nan")
        engines.row(row["engine"], row["greedy"], f"{ratio:.2f}x", row.get("sampled", float("nan")),
                    row.get("batch16", float("nan")), f"{row['rss_batch1_mib']:.0f}", f"{row['peak_rss_mib']:.0f}",
                    f"{row['startup_s']:.2f}", f"{row.get('greedy_tokens_per_step', float('nan')):.2f}")
    write_json(args.out, torch.device("cpu"), rows, kernels=kernels, max_tokens=args.max_tokens,
               rounds=args.rounds, prompts=PROMPTS)


if __name__ == "__main__":
    main()
