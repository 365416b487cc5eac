"""`make demo`: speculative generation on the embedded default model, then the sampler alone.

Part 0 runs the embedded GGUF file as stored (4-bit layers, 8-bit embedding and LM head, compiled
integer kernels: the default) next to its weights widened to float32, without drafts.

Part 1 streams a greedy chat reply from SmolLM2-135M-Instruct with n-gram drafts and checks that
it is token for token the reply generated without speculation, with both speeds.

Part 2 answers an open prompt, where n-gram lookup finds little to copy, with the EAGLE and
Medusa heads shipped for the embedded model, next to n-gram drafts and no speculation: speed,
tokens per verify step, and the same tokens as plain greedy decoding.

Part 3, the sampler on real-shaped data: for drafters of decreasing quality against a target distribution over the embedded model's
vocabulary size (49,152), it verifies many draft chains in one batched call and shows the
acceptance rate next to its theoretical value Σ min(p, q), the mean number of tokens emitted per
step, and an exactness check: the emitted first tokens against the target distribution
(chi-square at a 1e-6 false-alarm rate over the tokens with most mass).
"""

from __future__ import annotations

import math
import time

import torch

from .sample import DraftProbs, SamplingMetadata, rejection_sample
from .sampling_params import SamplingParams
from .spec_decode.metrics import expected_acceptance, expected_emitted_tokens

VOCAB = 49_152
BATCH = 1024
K = 3


def _chi_square_pvalue_ok(tokens: torch.Tensor, p: torch.Tensor, top: int = 30) -> tuple[float, float]:
    """Chi-square of the emitted tokens over the `top` likeliest tokens + one tail bin.

    Returns (statistic, threshold at false-alarm 1e-6) using the Wilson-Hilferty approximation of
    the chi-square quantile, so the demo needs no scipy.
    """
    order = p.argsort(descending=True)[:top]
    probs = torch.cat([p[order], (1 - p[order].sum()).reshape(1)]).double()
    counts = torch.bincount(tokens, minlength=p.shape[0]).double()
    observed = torch.cat([counts[order], (tokens.numel() - counts[order].sum()).reshape(1)])
    expected = probs * tokens.numel()
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = top
    z = 4.753  # standard normal quantile at 1 - 1e-6
    threshold = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return stat, threshold


def sampler_table() -> None:
    torch.manual_seed(0)
    target_logits = torch.randn(VOCAB) * 2.5
    p = target_logits.softmax(-1)
    drafters = {
        "q = p (perfect)": target_logits,
        "close (noise 0.5)": target_logits + torch.randn(VOCAB) * 0.5,
        "rough (noise 1.5)": target_logits + torch.randn(VOCAB) * 1.5,
        "over-confident": target_logits * 2,
        "uniform": torch.zeros(VOCAB),
    }
    print(f"Verifying {BATCH} requests x K={K} drafts, vocabulary {VOCAB}, one batched call each\n")
    print(
        f"{'drafter':<20} {'alpha':>6} {'theory':>7} {'tokens/step':>12} {'theory':>7}"
        f" {'chi2':>6} {'limit':>6} {'exact':>6} {'ms':>6}"
    )
    for name, draft_logits in drafters.items():
        q = draft_logits.softmax(-1)
        ids = torch.multinomial(q, BATCH * K, replacement=True)
        # The same target row at every position keeps the theory column a single number.
        target = target_logits.expand(BATCH * (K + 1), VOCAB)
        sampling = SamplingMetadata.from_params([SamplingParams(seed=i) for i in range(BATCH)])
        start = time.perf_counter()
        out = rejection_sample(
            target, ids, torch.arange(BATCH + 1) * K, sampling,
            draft=DraftProbs(q.expand(BATCH * K, VOCAB)), max_num_draft_tokens=K, validate=False,
        )
        ms = (time.perf_counter() - start) * 1e3
        alpha = (out.num_accepted >= 1).double().mean().item()
        theory = min(1.0, float(expected_acceptance(p, q)))
        stat, limit = _chi_square_pvalue_ok(out.token_ids[:, 0], p)
        print(
            f"{name:<20} {alpha:>6.3f} {theory:>7.3f} {out.num_emitted.double().mean().item():>12.2f}"
            f" {expected_emitted_tokens(theory, K):>7.2f} {stat:>6.1f} {limit:>6.1f}"
            f" {'yes' if stat <= limit else 'NO':>6} {ms:>6.0f}"
        )
    print("\nalpha: fraction of first drafts accepted; theory: sum min(p, q) = 1 - TV(p, q).")
    print("tokens/step: emitted per verify step; theory: (1 - alpha^(K+1)) / (1 - alpha).")
    print("exact: the first emitted token passes chi-square against p, whatever the drafter.")


DEMO_PROMPT = (
    "Repeat the following text exactly, word for word:\n\nThe quick brown fox jumps over the lazy "
    "dog. Pack my box with five dozen liquor jugs. How vexingly quick daft zebras jump! Sphinx of "
    "black quartz, judge my vow."
)


def weights_demo() -> None:
    from .engine.llm import LLM
    from .model.quant.kernels import default_kernel

    print("== Part 0: the GGUF file's 4-bit blocks as stored vs widened to float32 (CPU) ==\n")
    print("loading the embedded model twice (the first float32 run dequantizes the file, ~10 s) ...",
          flush=True)
    prompt = None
    params = SamplingParams(temperature=0, max_tokens=64)
    for dtype, label in (("auto", f"4-bit as stored ({default_kernel()} kernel)"),
                         ("float32", "float32 (widened)")):
        llm = LLM(draft="none", dtype=dtype, kv_cache_gib=0.25, progress=False)
        prompt = prompt or llm.tokenizer.apply_chat_template([{"role": "user", "content": OPEN_PROMPT}])
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        rate = len(out.token_ids) / (time.perf_counter() - start)
        print(f"{label:<38} {rate:6.1f} tok/s, no drafts: {out.text[:40]!r}...")
    print()


def generation_demo() -> None:
    from .cli import stream_to_stdout
    from .engine.llm import LLM

    print("== Part 1: exact speculative decoding on SmolLM2-135M-Instruct (CPU) ==\n")
    spec = LLM(draft="ngram", num_speculative_tokens=5, kv_cache_gib=0.25)
    plain = LLM(draft="none", kv_cache_gib=0.25, progress=False)
    prompt = spec.tokenizer.apply_chat_template([{"role": "user", "content": DEMO_PROMPT}])
    params = SamplingParams(temperature=0, max_tokens=96)
    print(f"\nuser: {DEMO_PROMPT}\nassistant (streamed, n-gram drafts, K=5):\n")
    last, spec_s = stream_to_stdout(spec, prompt, params)
    start = time.perf_counter()
    (reference,) = plain.generate([prompt], params, use_tqdm=False)
    plain_s = time.perf_counter() - start
    n = len(last.token_ids)
    stats = last.stats
    print(f"\n\n{n} tokens: {n / spec_s:.1f} tok/s with n-gram speculation, "
          f"{len(reference.token_ids) / plain_s:.1f} tok/s without "
          f"(acceptance rate {stats.acceptance_rate:.2f}, mean acceptance length {stats.mean_acceptance_length:.2f})")
    same = reference.token_ids == last.token_ids
    print(f"identical to non-speculative greedy output: {'yes' if same else 'NO'}\n")


DEMO_DRAFTERS = ("none", "ngram", "medusa", "ngram+eagle", "eagle")  # the last one streams
OPEN_PROMPT = "Explain why the sky is blue to a ten-year-old, in a few sentences."


def learned_demo() -> None:
    """An open prompt, where n-gram lookup finds little to copy: the learned heads shipped for
    the embedded model (alone, and behind prompt lookup) against n-gram drafts and no
    speculation, greedy, same tokens required."""
    from .cli import stream_to_stdout
    from .engine.llm import LLM

    print("== Part 2: learned drafters (EAGLE / Medusa heads trained here) on an open prompt ==\n")
    llms = {name: LLM(draft=name, num_speculative_tokens=4, kv_cache_gib=0.25, progress=False)
            for name in DEMO_DRAFTERS}
    prompt = llms["none"].tokenizer.apply_chat_template([{"role": "user", "content": OPEN_PROMPT}])
    params = SamplingParams(temperature=0, max_tokens=96)
    print(f"user: {OPEN_PROMPT}\nassistant (streamed, EAGLE drafts, K=4):\n")
    last, seconds = stream_to_stdout(llms["eagle"], prompt, params)
    results = {"eagle": (last, seconds)}
    for name in DEMO_DRAFTERS[:-1]:
        start = time.perf_counter()
        (out,) = llms[name].generate([prompt], params, use_tqdm=False)
        results[name] = (out, time.perf_counter() - start)
    reference = results["none"][0].token_ids
    print(f"\n\n{'drafter':<11} {'tok/s':>6} {'x none':>6} {'tokens/step':>11} {'same tokens':>11}")
    base = len(reference) / results["none"][1]
    for name in DEMO_DRAFTERS:
        out, secs = results[name]
        rate = len(out.token_ids) / secs
        print(f"{name:<11} {rate:>6.1f} {rate / base:>6.2f} {out.stats.mean_acceptance_length:>11.2f} "
              f"{'yes' if out.token_ids == reference else 'NO':>11}")
    print("tokens/step: tokens emitted per target forward pass (accepted drafts + 1).\n")


def main() -> None:
    weights_demo()
    generation_demo()
    learned_demo()
    print("== Part 3: the rejection sampler alone ==\n")
    sampler_table()


if __name__ == "__main__":
    main()
